"""FSDP with expert parallelism on 4 gloo ranks: dense parameters are sharded over all 4 ranks,
the experts of a mixture-of-experts layer over an expert mesh (expert-data-parallel 2 x
expert-parallel 2), against a single-process run holding every expert on the same global batch.

Both runs route the same tokens to the same experts; they differ in summation order only (fp32
rounding), so the tolerances of test_parity.py (1e-5 relative) apply; measured: 5e-7. The
optimizer is SGD with momentum: Adam divides by the root of the second moment, which for expert
elements that few tokens reach turns rounding noise into full-size updates (3.5e-5 measured after
4 steps, with gradients equal to 1e-5). Expert gradients reduce
over the expert-data-parallel group and are divided by the dense data-parallel size, which the
gradient comparison checks: any other divisor is off by a factor of 2.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
from _dist import run_distributed
from expected_errors import value_error_messages
from models import make_batch
from moe_model import EXPERTS, MoEBlock, make_moe
from parity import Result, build_optimizer, compare, train_data_parallel, train_whole_batches

WORLD, EP = 4, 2
STEPS, MICRO_ROWS = 4, 2
SETUPS = [(0, 1), (1, 1), (2, 1), (3, 1), (3, 2)]
EXPERT_NAMES = ("moe.w_in", "moe.w_out")
OPTIMIZER = "sgd"


def _dense_mesh():
    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))


def _expert_mesh():
    return init_device_mesh("cpu", (WORLD // EP, EP), mesh_dim_names=("dp_shard", "ep"))


def _reference(accum: int) -> Result:
    model = make_moe()
    return train_whole_batches(model, build_optimizer(model.parameters(), OPTIMIZER), STEPS, WORLD * accum * MICRO_ROWS)


def _expert_slice(result: Result, ep_rank: int) -> Result:
    """The reference with expert tensors cut to the experts one expert-parallel rank holds."""
    per_rank = EXPERTS // EP

    def cut(values: dict) -> dict:
        return {
            n: v[ep_rank * per_rank : (ep_rank + 1) * per_rank] if n.endswith(EXPERT_NAMES) else v
            for n, v in values.items()
        }

    return Result(result.losses, cut(result.grads), cut(result.params))


def _sharded(expert_mesh, strategy: int, accum: int):
    model = make_moe(expert_mesh["ep"])
    model, optimizer = megatron_fsdp.fully_shard(
        model, build_optimizer(model.parameters(), OPTIMIZER), device_mesh=_dense_mesh(), dp_shard_dim="dp_shard",
        expt_device_mesh=expert_mesh,
        fsdp_unit_modules=[MoEBlock], zero_dp_strategy=strategy,
    )
    result = train_data_parallel(model, optimizer, STEPS, accum, MICRO_ROWS, dist.get_rank(), WORLD)
    return result, model, optimizer


def _parity_runs(rank: int, world: int) -> dict:
    mesh = _expert_mesh()
    results = {setup: _sharded(mesh, *setup)[0] for setup in SETUPS}
    return {"ep_rank": mesh["ep"].get_local_rank(), "results": results}


@functools.cache
def _parity_results() -> list[dict]:
    return run_distributed(_parity_runs, WORLD, timeout=600)


@pytest.mark.parametrize("strategy, accum", SETUPS)
def test_expert_parallel_fsdp_matches_single_process(strategy: int, accum: int) -> None:
    reference = _reference(accum)
    for rank, ranked in enumerate(_parity_results()):
        expected = _expert_slice(reference, ranked["ep_rank"])
        label = f"s{strategy} accum {accum} rank {rank}"
        compare(ranked["results"][(strategy, accum)], expected, 1e-5, 1e-5, 1e-5, label)


# Expert tensor parallelism: dense data parallelism over "dp" (2; the two ranks of a "tp" pair
# see the same rows), experts over "ep" (2, the dp ranks) and their hidden dim over "etp" (2,
# the tp pair), so every rank holds a different quarter of the expert weights and no expert is
# data-parallel (an expert-data-parallel dim of size 1).
ETP_SETUPS = [(1, 1), (3, 1), (3, 2)]


def _tensor_parallel_experts(rank: int, world: int) -> dict:
    dense = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    experts = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ep", "etp"))
    results = {}
    for strategy, accum in ETP_SETUPS:
        model = make_moe(experts["ep", "etp"])
        model, optimizer = megatron_fsdp.fully_shard(
            model, build_optimizer(model.parameters(), OPTIMIZER), device_mesh=dense, dp_shard_dim="dp",
            expt_device_mesh=experts, fsdp_unit_modules=[MoEBlock], zero_dp_strategy=strategy,
        )
        dp = dense["dp"]
        results[(strategy, accum)] = train_data_parallel(
            model, optimizer, STEPS, accum, MICRO_ROWS, dp.get_local_rank(), dp.size(), dp.get_group()
        )
    return {"ep_rank": experts["ep"].get_local_rank(), "etp_rank": experts["etp"].get_local_rank(), "results": results}


@functools.cache
def _tensor_parallel_expert_results() -> list[dict]:
    return run_distributed(_tensor_parallel_experts, WORLD, timeout=600)


def _expert_quarter(result: Result, ep_rank: int, etp_rank: int) -> Result:
    """The reference with expert tensors cut to one rank's experts and hidden-dim slice."""
    ffn_dims = {"moe.w_in": 2, "moe.w_out": 1}

    def cut(values: dict) -> dict:
        out = {}
        for name, value in values.items():
            ffn_dim = next((d for suffix, d in ffn_dims.items() if name.endswith(suffix)), None)
            if ffn_dim is not None:
                value = value.chunk(EP)[ep_rank].chunk(2, dim=ffn_dim)[etp_rank]
            out[name] = value
        return out

    return Result(result.losses, cut(result.grads), cut(result.params))


@pytest.mark.parametrize("strategy, accum", ETP_SETUPS)
def test_tensor_parallel_experts_match_single_process(strategy: int, accum: int) -> None:
    model = make_moe()
    reference = train_whole_batches(model, build_optimizer(model.parameters(), OPTIMIZER), STEPS, 2 * accum * MICRO_ROWS)
    for rank, ranked in enumerate(_tensor_parallel_expert_results()):
        expected = _expert_quarter(reference, ranked["ep_rank"], ranked["etp_rank"])
        compare(ranked["results"][(strategy, accum)], expected, 1e-5, 1e-5, 1e-5, f"etp s{strategy} accum {accum} rank {rank}")


def _expert_shard_sizes(rank: int, world: int) -> dict:
    model = megatron_fsdp.fully_shard_model(
        make_moe(_expert_mesh()["ep"]), device_mesh=_dense_mesh(), dp_shard_dim="dp_shard",
        expt_device_mesh=_expert_mesh(), fsdp_unit_modules=[MoEBlock],
    )
    sizes = {"dense": 0, "expert": 0}
    for bucket in (b for unit in model.units for b in unit.buckets):
        kind = "expert" if bucket.names[0].endswith(EXPERT_NAMES) else "dense"
        assert all(n.endswith(EXPERT_NAMES) == (kind == "expert") for n in bucket.names), "mixed bucket"
        sizes[kind] += sum(p.numel() for p in bucket.optim_params)
    return sizes


def test_experts_get_their_own_buckets_sharded_over_the_expert_data_parallel_group() -> None:
    per_rank = run_distributed(_expert_shard_sizes, WORLD)
    reference = make_moe()
    dense = sum(p.numel() for n, p in reference.named_parameters() if not n.endswith(EXPERT_NAMES))
    expert = sum(p.numel() for n, p in reference.named_parameters() if n.endswith(EXPERT_NAMES))
    # Every dense element is stepped once over 4 ranks, every expert element once over its 2
    # expert-data-parallel ranks, and each expert lives on one of 2 expert-parallel ranks.
    assert sum(s["dense"] for s in per_rank) == dense
    assert sum(s["expert"] for s in per_rank) == expert


def _checkpoint(rank: int, world: int, path: str) -> dict:
    _, model, optimizer = _sharded(_expert_mesh(), 3, 1)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    # The same model without expert parallelism (every expert on every rank, plain FSDP).
    plain = megatron_fsdp.fully_shard_model(make_moe(seed=1), fsdp_unit_modules=[MoEBlock])
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=path)
    plain.load_state_dict(state["model"])
    return {"plain": plain.full_parameters(), "full_state": megatron_fsdp.full_state_dict(model)}


def test_expert_checkpoint_holds_every_expert_and_loads_without_expert_parallelism(tmp_path) -> None:
    path = str(tmp_path / "ep")
    results = run_distributed(_checkpoint, WORLD, path)
    dcp_to_torch_save(path, str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt")["model"]
    reference = _reference(1).params
    for name, value in reference.items():
        assert saved[name].shape == value.shape, name
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-5 * value.abs().max().item())
        torch.testing.assert_close(results[0]["full_state"][name], saved[name], rtol=0, atol=0)
        for rank in range(WORLD):
            torch.testing.assert_close(results[rank]["plain"][name], saved[name], rtol=0, atol=0)


def _expert_mistakes(rank: int, world: int) -> dict:
    return value_error_messages({
        "experts without a mesh": lambda: megatron_fsdp.fully_shard_model(
            make_moe(_expert_mesh()["ep"]), fsdp_unit_modules=[MoEBlock]
        ),
        "a mesh without experts": lambda: megatron_fsdp.fully_shard_model(
            make_moe(), device_mesh=_dense_mesh(), dp_shard_dim="dp_shard", expt_device_mesh=_expert_mesh(),
            fsdp_unit_modules=[MoEBlock],
        ),
        "a 2-D expert mesh without dp_shard_dim": lambda: megatron_fsdp.fully_shard_model(
            make_moe(_expert_mesh()["ep"]), expt_device_mesh=_expert_mesh(), fsdp_unit_modules=[MoEBlock]
        ),
        # Dense data parallelism over 2 ranks (the other dim is unused), experts over 4.
        "an expert mesh larger than the dense one": lambda: megatron_fsdp.fully_shard_model(
            make_moe(), device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "other")),
            dp_shard_dim="dp_shard", expt_device_mesh=_dense_mesh(), fsdp_unit_modules=[MoEBlock],
        ),
    })


def test_expert_mesh_mistakes_raise_clear_errors() -> None:
    errors = run_distributed(_expert_mistakes, WORLD)[0]
    assert "no expt_device_mesh was given" in errors["experts without a mesh"]
    assert "no parameter is marked as an expert parameter" in errors["a mesh without experts"]
    assert "expt_device_mesh has 2 dims ('dp_shard', 'ep'); name its expert-data-parallel dim" in (
        errors["a 2-D expert mesh without dp_shard_dim"]
    )
    assert "dim has 4 ranks, which does not divide the 2 data-parallel ranks" in (
        errors["an expert mesh larger than the dense one"]
    )


def _plain_tensor_experts_state_dict(rank: int, world: int) -> str:
    model = make_moe()  # every expert on every rank, as plain tensors
    for block in model.blocks:
        block.moe.w_in.allreduce = block.moe.w_out.allreduce = False
    model = megatron_fsdp.fully_shard_model(
        model, device_mesh=_dense_mesh(), dp_shard_dim="dp_shard", expt_device_mesh=_dense_mesh(),
        fsdp_unit_modules=[MoEBlock],
    )
    try:
        model.state_dict()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_state_dict_refuses_plain_tensor_experts() -> None:
    for message in run_distributed(_plain_tensor_experts_state_dict, WORLD):
        assert "expert parameter blocks.0.moe.w_in is a plain tensor" in message, message


def _clip_norms(rank: int, world: int) -> dict:
    mesh = _expert_mesh()
    model = megatron_fsdp.fully_shard_model(
        make_moe(mesh["ep"]), device_mesh=_dense_mesh(), dp_shard_dim="dp_shard", expt_device_mesh=mesh,
        fsdp_unit_modules=[MoEBlock],
    )
    tokens, targets = make_batch(0, WORLD * MICRO_ROWS)
    rows = slice(rank * MICRO_ROWS, (rank + 1) * MICRO_ROWS)
    model(tokens[rows], targets[rows]).backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch_clip = "no error"
    except RuntimeError as error:
        torch_clip = str(error)
    return {"fused": megatron_fsdp.clip_grad_norm_(model, 1e-3).item(), "torch": torch_clip}


def test_fused_clip_counts_every_expert_once_and_torch_clip_refuses_mixed_meshes() -> None:
    """Experts live on another mesh than dense parameters: the fused norm sums every expert
    exactly once (as a single process holding all experts does); torch's clip cannot combine
    DTensors of two meshes and must say so on every rank rather than return a partial norm."""
    reference = make_moe()
    reference(*make_batch(0, WORLD * MICRO_ROWS)).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3).item()
    for rank, result in enumerate(run_distributed(_clip_norms, WORLD)):
        assert abs(result["fused"] - expected) <= 1e-5 * expected, f"rank {rank}: {result['fused']} vs {expected}"
        assert result["torch"] != "no error", f"rank {rank}: torch's clip mixed meshes without an error"


def _expert_dtensors(rank: int, world: int) -> list[str]:
    """Dense and expert parameters' DTensors (state dict, faces, gradients) give the global
    values megatron_fsdp's own gathers give (expert pieces live on the expert mesh)."""
    mesh = _expert_mesh()
    model = megatron_fsdp.fully_shard_model(
        make_moe(mesh["ep"]), device_mesh=_dense_mesh(), dp_shard_dim="dp_shard", expt_device_mesh=mesh,
        fsdp_unit_modules=[MoEBlock],
    )
    tokens, targets = make_batch(0, WORLD * MICRO_ROWS)
    model(tokens[rank * MICRO_ROWS : (rank + 1) * MICRO_ROWS], targets[rank * MICRO_ROWS : (rank + 1) * MICRO_ROWS]).backward()
    model.finish_grad_sync()
    full_params, full_grads = model.full_parameters(), model.full_gradients()
    to_global = {n: e.to_global for b in model.all_buckets() for n, e in zip(b.names, b.extents)}
    bad = []
    state = model.state_dict()
    for name, param in model.named_parameters():
        expected = to_global[name](full_params[name])
        if not torch.equal(state[name].full_tensor(), expected) or not torch.equal(param.full_tensor(), expected):
            bad.append(name)
        if param.grad is not None and not torch.equal(param.grad.full_tensor(), to_global[name](full_grads[name])):
            bad.append(f"{name} grad")
    return bad


def test_expert_and_dense_dtensors_give_global_values() -> None:
    for rank, bad in enumerate(run_distributed(_expert_dtensors, WORLD)):
        assert bad == [], f"rank {rank}: {bad}"


def test_experts_are_found_by_name_when_no_parameter_is_marked() -> None:
    """megatron-core's local MoE layers set no allreduce mark; upstream finds experts by name."""
    from megatron_fsdp.engine.params.dtensor_params import is_expert_param, mark_experts_by_name

    moe = torch.nn.ModuleDict({"router": torch.nn.Linear(4, 2), "experts": torch.nn.ModuleList([torch.nn.Linear(4, 4)] * 2)})
    model = torch.nn.ModuleDict({"mlp": moe})
    mark_experts_by_name(model)
    assert sorted(n for n, p in model.named_parameters() if is_expert_param(p)) == ["mlp.experts.0.bias", "mlp.experts.0.weight"]
    assert not is_expert_param(model["mlp"]["router"].weight)

    marked = torch.nn.ModuleDict({"experts": torch.nn.Linear(4, 4), "other": torch.nn.Linear(4, 4)})
    marked["other"].weight.allreduce = False
    mark_experts_by_name(marked)
    assert not is_expert_param(marked["experts"].weight), "a model with marks of its own keeps them"
