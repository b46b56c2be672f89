"""The DTensors megatron_fsdp hands out (model and optimizer state dicts, parameters and their
gradients) under DTensor's own operations, on 2 gloo ranks against the full values gathered by
megatron_fsdp's own full_parameters()/full_gradients() (tested against single-process training
in test_parity.py): full_tensor(), redistribute, to_local(), .to("cpu"), pickling; an operation
that cannot be right on a flat piece raises the same error on every rank."""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

import megatron_fsdp
from _dist import run_distributed
from models import Block, make_batch, make_model

MICRO_ROWS = 2


def _trained(rank: int, world: int, strategy: int):
    module = make_model(seed=0)
    model, optimizer = megatron_fsdp.fully_shard(
        module, torch.optim.Adam(module.parameters(), lr=1e-2), fsdp_unit_modules=[Block], zero_dp_strategy=strategy
    )
    for step in range(2):
        tokens, targets = make_batch(step, world * MICRO_ROWS)
        rows = slice(rank * MICRO_ROWS, (rank + 1) * MICRO_ROWS)
        model(tokens[rows], targets[rows]).backward()
        if step == 0:
            optimizer.step()
            optimizer.zero_grad()
    model.finish_grad_sync()
    return model, optimizer


def _mismatches(rank: int, world: int, strategy: int) -> dict:
    model, optimizer = _trained(rank, world, strategy)
    full_params, full_grads = model.full_parameters(), model.full_gradients()
    bad: dict[str, list[str]] = {}

    def check(kind: str, name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        if got.shape != expected.shape or not torch.equal(got, expected):
            bad.setdefault(kind, []).append(name)

    state = model.state_dict()
    for name, value in state.items():
        if name not in full_params:
            continue
        check("state full_tensor", name, value.full_tensor(), full_params[name])
        check("state redistribute", name, value.redistribute(placements=[Replicate()] * value.device_mesh.ndim).to_local(), full_params[name])
        rows = value.redistribute(placements=[Shard(0)] * value.device_mesh.ndim)
        check("state to Shard(0) rows", name, rows.to_local(), torch.chunk(full_params[name], world)[rank] if full_params[name].shape[0] >= world else rows.to_local())
        check("state .to(cpu)", name, value.to("cpu").full_tensor(), full_params[name])
        check("state elementwise", name, (value * 2).full_tensor(), full_params[name] * 2)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        check("state pickled", name, torch.load(buffer, weights_only=False).full_tensor(), full_params[name])
    for name, param in model.named_parameters():
        check("parameter full_tensor", name, param.full_tensor(), full_params[name])
        if param.grad is not None:
            check("grad full_tensor", name, param.grad.full_tensor(), full_grads[name])
    optimizer_state = get_optimizer_state_dict(model, optimizer)["state"]
    for name, entries in optimizer_state.items():
        for key, value in entries.items():
            if isinstance(value, DTensor):
                if value.shape != full_params[name].shape:
                    bad.setdefault("optimizer state shape", []).append(f"{name}.{key}")
                value.full_tensor()  # a collective: mismatched sizes would fail here
    errors = []
    for name, value in state.items():
        if isinstance(value, DTensor) and value.placements[0].is_shard() and value.dim() > 1:
            try:
                value.t()  # DTensor would make it Shard(1) of transposed flat pieces: wrong rows
                errors.append(f"{name}: t() accepted")
            except NotImplementedError as error:
                errors.append(str(error).split(":")[0])
            break
    return {"bad": bad, "errors": errors}


def test_dtensor_operations_give_full_values_for_every_strategy() -> None:
    for strategy in range(4):
        per_rank = run_distributed(_mismatches, 2, strategy)
        assert per_rank[0]["errors"] == per_rank[1]["errors"], per_rank
        for rank, result in enumerate(per_rank):
            assert result["bad"] == {}, f"strategy {strategy} rank {rank}: {result['bad']}"
            if strategy != 0:  # strategy 0 holds whole parameters: a view is an ordinary DTensor view
                assert result["errors"] and "flat-sharded" in result["errors"][0], result


def _helpers_round_trip(rank: int, world: int, strategy: int) -> dict:
    """torch's get_model_state_dict / set_model_state_dict, full and sharded, with and without
    cpu_offload: what they read equals the model's parameters, and loading it back into a model
    that has trained on restores them bit for bit."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model, optimizer = _trained(rank, world, strategy)
    results = {}
    for full, offload in ((True, False), (True, True), (False, False), (False, True)):
        before = model.full_parameters()
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=offload))
        if full:
            read_right = (offload and rank != 0) or all(torch.equal(state[k].cpu(), v) for k, v in before.items())
        else:
            read_right = all(torch.equal(state[k].full_tensor().cpu(), v) for k, v in before.items())
        kept = {k: v.clone() for k, v in state.items()}
        optimizer.step()  # moves the parameters away from what was read
        optimizer.zero_grad()
        tokens, targets = make_batch(5, world * MICRO_ROWS)
        model(tokens[rank * MICRO_ROWS : (rank + 1) * MICRO_ROWS], targets[rank * MICRO_ROWS : (rank + 1) * MICRO_ROWS]).backward()
        set_model_state_dict(model, kept, options=StateDictOptions(full_state_dict=full, broadcast_from_rank0=full and offload))
        restored = all(torch.equal(model.full_parameters()[k], v) for k, v in before.items())
        results[(full, offload)] = (read_right, restored)
    return results


def test_torch_model_state_dict_helpers_read_and_restore_exactly() -> None:
    for strategy in (0, 3):
        for rank, results in enumerate(run_distributed(_helpers_round_trip, 2, strategy)):
            for (full, offload), (read_right, restored) in results.items():
                label = f"strategy {strategy} rank {rank} full_state_dict={full} cpu_offload={offload}"
                assert read_right, f"{label}: get_model_state_dict read other values than the parameters"
                assert restored, f"{label}: set_model_state_dict did not restore the parameters"


def _meshes_full_values(rank: int, world: int) -> dict:
    """HFSDP on a (2, 2) mesh and FSDP over TP on a (dp 2, tp 2) mesh: state dict, parameter and
    gradient DTensors give the full values megatron_fsdp's own gathers give."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    bad = []
    hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_model = make_model(seed=0)
    for block in tp_model.blocks:
        parallelize_module(block, tp_mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    cases = {
        "hfsdp": (make_model(seed=0), dict(device_mesh=hybrid, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", outer_dp_sharding_strategy="optim"), hybrid["dp_shard"].get_local_rank() * 2 + hybrid["dp_outer"].get_local_rank()),
        "tp": (tp_model, dict(device_mesh=tp_mesh, dp_shard_dim="dp", tp_dim="tp"), tp_mesh["dp"].get_local_rank()),
    }
    for label, (module, arguments, data_rank) in cases.items():
        model = megatron_fsdp.fully_shard_model(module, fsdp_unit_modules=[Block], **arguments)
        data_ranks = 4 if label == "hfsdp" else 2
        tokens, targets = make_batch(0, data_ranks * MICRO_ROWS)
        rows = slice(data_rank * MICRO_ROWS, (data_rank + 1) * MICRO_ROWS)
        model(tokens[rows], targets[rows]).backward()
        model.finish_grad_sync()
        full_params, full_grads = model.full_parameters(), model.full_gradients()
        to_global = {n: e.to_global for b in model.all_buckets() for n, e in zip(b.names, b.extents)}
        for name, value in model.state_dict().items():
            if name in full_params and not torch.equal(value.full_tensor(), to_global[name](full_params[name])):
                bad.append(f"{label} state {name}")
        for name, param in model.named_parameters():
            if not torch.equal(param.full_tensor(), to_global[name](full_params[name])):
                bad.append(f"{label} parameter {name}")
            if param.grad is not None and not torch.equal(param.grad.full_tensor(), to_global[name](full_grads[name])):
                bad.append(f"{label} grad {name}")
    return {"bad": bad}


def test_hybrid_and_tensor_parallel_dtensors_give_full_values() -> None:
    for rank, result in enumerate(run_distributed(_meshes_full_values, 4)):
        assert result["bad"] == [], f"rank {rank}: {result['bad']}"
