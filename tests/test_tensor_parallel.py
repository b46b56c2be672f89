"""FSDP on top of tensor parallelism: a model whose MLPs are tensor-parallel DTensors
(``parallelize_module`` with Colwise/Rowwise plans) on a 2 x 2 mesh (dp x tp) of 4 gloo ranks,
against the same model with tensor parallelism alone on the same global batch.

The two runs differ only in where the data-parallel mean is taken (two half-batch gradients
averaged vs one full-batch gradient): fp32 rounding, so the tolerances of test_parity.py
(1e-5 relative) apply. Checkpoints saved under TP + FSDP hold global tensors: they equal the
TP run's full tensors and load into plain FSDP without tensor parallelism.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import megatron_fsdp
from _dist import run_distributed
from expected_errors import value_error_messages
from models import FFN, HIDDEN, Block, make_batch, make_model
from parity import Result, build_optimizer, compare, train_data_parallel, train_whole_batches

WORLD, DP, TP = 4, 2, 2
STEPS, MICRO_ROWS = 4, 2
SETUPS = [(strategy, accum) for strategy in range(4) for accum in (1, 2)]


def _tp_model(tp_mesh) -> torch.nn.Module:
    model = make_model()
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _tp_alone(tp_mesh, accum: int) -> tuple[Result, torch.nn.Module]:
    model = _tp_model(tp_mesh)
    result = train_whole_batches(model, build_optimizer(model.parameters(), "adam"), STEPS, DP * accum * MICRO_ROWS)
    return result, model


def _tp_fsdp(mesh, strategy: int, accum: int) -> tuple[Result, megatron_fsdp.MegatronFSDP, torch.optim.Optimizer]:
    model = _tp_model(mesh["tp"])
    model, optimizer = megatron_fsdp.fully_shard(
        model, build_optimizer(model.parameters(), "adam"), device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp",
        fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
    )
    up = model.module.blocks[0].up.weight
    assert isinstance(up, DTensor) and tuple(up.placements) == (Shard(0),), "the plan did not make DTensors"
    dp = mesh["dp"]
    result = train_data_parallel(model, optimizer, STEPS, accum, MICRO_ROWS, dp.get_local_rank(), DP, dp.get_group())
    return result, model, optimizer


def _parity_runs(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    return {
        (strategy, accum): (_tp_fsdp(mesh, strategy, accum)[0], _tp_alone(mesh["tp"], accum)[0])
        for strategy, accum in SETUPS
    }


@functools.cache
def _parity_results() -> list[dict]:
    return run_distributed(_parity_runs, WORLD, timeout=600)


@pytest.mark.parametrize("strategy, accum", SETUPS)
def test_tp_with_fsdp_matches_tp_alone(strategy: int, accum: int) -> None:
    for rank, results in enumerate(_parity_results()):
        got, expected = results[(strategy, accum)]
        compare(got, expected, 1e-5, 1e-5, 1e-5, f"s{strategy} accum {accum} rank {rank}")


def _seeds_mesh_runs(rank: int, world: int) -> tuple[Result, Result]:
    """Upstream's README mesh (dp_outer, dp_shard, cp, tp) with its flattened dims: sharded over
    dp_shard x cp, HFSDP over dp_outer (the optimizer state split across it too), TP on tp."""
    mesh = init_device_mesh("cpu", (2, 1, 1, TP), mesh_dim_names=("dp_outer", "dp_shard", "cp", "tp"))
    mesh[("dp_outer", "dp_shard")]._flatten("dp")
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    hsdp_group = mesh[("dp_outer", "dp_shard", "cp")]._flatten("hsdp").get_group()
    model = _tp_model(mesh["tp"])
    model, optimizer = megatron_fsdp.fully_shard(
        model, build_optimizer(model.parameters(), "adam"), device_mesh=mesh, dp_shard_dim="dp_shard_cp",
        dp_outer_dim="dp_outer", tp_dim="tp", hybrid_fsdp_group=hsdp_group, zero_dp_strategy=3,
        outer_dp_sharding_strategy=1, fsdp_unit_modules=[Block],
    )
    dp = mesh["dp"]
    sharded = train_data_parallel(model, optimizer, STEPS, 2, MICRO_ROWS, dp.get_local_rank(), dp.size(), dp.get_group())
    return sharded, _tp_alone(mesh["tp"], 2)[0]


def test_hfsdp_with_tp_on_upstreams_mesh_matches_tp_alone() -> None:
    for rank, (got, expected) in enumerate(run_distributed(_seeds_mesh_runs, WORLD)):
        compare(got, expected, 1e-5, 1e-5, 1e-5, f"HFSDP x TP rank {rank}")


def test_tp_params_are_sharded_on_their_local_tensors() -> None:
    # Each rank's pieces of an MLP weight cover its TP-local half: FFN x HIDDEN / TP elements
    # over the DP group, not the global FFN x HIDDEN.
    for results in _parity_results():
        got, _ = results[(3, 1)]
        assert got.params["blocks.0.up.weight"].shape == (FFN // TP, HIDDEN)
        assert got.params["blocks.0.down.weight"].shape == (HIDDEN, FFN // TP)


def _checkpoint_round_trip(rank: int, world: int, path: str) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    _, model, optimizer = _tp_fsdp(mesh, 3, 1)
    _, reference = _tp_alone(mesh["tp"], 1)
    full_reference = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in reference.named_parameters()}
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)

    # The same TP + FSDP layout, fresh: loading restores every piece.
    _, fresh, fresh_optimizer = _tp_fsdp(mesh, 1, 1)
    state = {"model": fresh.state_dict(), "optimizer": fresh_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    fresh_optimizer.load_state_dict(state["optimizer"])
    restored = fresh.full_parameters()
    exact_restore = all(torch.equal(restored[n], p) for n, p in model.full_parameters().items())

    # Plain FSDP over all 4 ranks, no tensor parallelism: global tensors go where they belong.
    plain = megatron_fsdp.fully_shard_model(make_model(seed=1), fsdp_unit_modules=[Block])
    plain_state = {"model": plain.state_dict()}
    dcp.load(plain_state, checkpoint_id=path)
    plain.load_state_dict(plain_state["model"])
    full_state = megatron_fsdp.full_state_dict(model)
    return {
        "reference": full_reference,
        "exact_restore": exact_restore,
        "plain": plain.full_parameters(),
        "full_state": full_state,
    }


def test_tp_checkpoint_holds_global_tensors_and_reshards_to_plain_fsdp(tmp_path) -> None:
    path = str(tmp_path / "tp_fsdp")
    results = run_distributed(_checkpoint_round_trip, WORLD, path)
    reference = results[0]["reference"]
    assert all(r["exact_restore"] for r in results), "a TP + FSDP checkpoint did not restore exactly"
    dcp_to_torch_save(path, str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt")["model"]
    assert saved["blocks.0.up.weight"].shape == (FFN, HIDDEN)
    for name, value in reference.items():
        # The same weights the TP run trained to, within the TP vs TP + FSDP parity bound.
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-5 * value.abs().max().item())
        torch.testing.assert_close(results[0]["full_state"][name], saved[name], rtol=0, atol=0)
        for rank in range(WORLD):
            torch.testing.assert_close(results[rank]["plain"][name], saved[name], rtol=0, atol=0)


def _bad_tp_arguments(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    arguments = {
        "no tp_dim": dict(device_mesh=mesh, dp_shard_dim="dp"),
        "wrong dim": dict(device_mesh=mesh, dp_shard_dim="tp", tp_dim="dp"),
        "absent dim": dict(device_mesh=mesh, dp_shard_dim="dp", tp_dim="cp"),
    }
    return value_error_messages({
        label: functools.partial(megatron_fsdp.fully_shard_model, _tp_model(mesh["tp"]), fsdp_unit_modules=[Block], **kwargs)
        for label, kwargs in arguments.items()
    })


def _replace_weight(model: torch.nn.Module, weight: DTensor) -> torch.nn.Module:
    model.blocks[0].up.weight = torch.nn.Parameter(weight)
    return model


def _unsupported_dtensors(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    uneven_rows = 5 if tp.get_local_rank() == 0 else FFN - 5
    models = {
        "partial": _replace_weight(_tp_model(tp), DTensor.from_local(torch.zeros(FFN, HIDDEN), tp, [Partial()])),
        "uneven": _replace_weight(_tp_model(tp), DTensor.from_local(
            torch.zeros(uneven_rows, HIDDEN), tp, [Shard(0)], run_check=False, shape=(FFN, HIDDEN), stride=(HIDDEN, 1)
        )),
    }
    return value_error_messages({
        label: functools.partial(
            megatron_fsdp.fully_shard_model, model, device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp", fsdp_unit_modules=[Block]
        )
        for label, model in models.items()
    })


def test_unsupported_dtensor_parameters_raise_clear_errors() -> None:
    for errors in run_distributed(_unsupported_dtensors, WORLD):
        assert "blocks.0.up.weight has placements (Partial(sum),); megatron_fsdp supports" in errors["partial"]
        assert "blocks.0.up.weight: local shape" in errors["uneven"]
        assert "is not the even torch.chunk split" in errors["uneven"]


def test_tp_mesh_mistakes_raise_clear_errors() -> None:
    errors = run_distributed(_bad_tp_arguments, WORLD)[0]
    assert "pass tp_dim" in errors["no tp_dim"]
    assert "not on device_mesh[tp_dim]" in errors["wrong dim"]
    assert "no dim named 'cp'" in errors["absent dim"]


def _clip_norms(rank: int, world: int) -> dict:
    """One backward on the same global batch: the norm torch's clip computes over the TP model
    alone, and both ways over TP + FSDP (whose parameters sit on the (dp, tp) mesh)."""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    tokens, targets = make_batch(0, DP * MICRO_ROWS)
    alone = _tp_model(mesh["tp"])
    alone(tokens, targets).backward()
    full_grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in alone.parameters()]
    expected = torch.nn.utils.get_total_norm(full_grads).item()
    model = megatron_fsdp.fully_shard_model(
        _tp_model(mesh["tp"]), device_mesh=mesh, dp_shard_dim="dp", tp_dim="tp", fsdp_unit_modules=[Block]
    )
    rows = slice(mesh["dp"].get_local_rank() * MICRO_ROWS, (mesh["dp"].get_local_rank() + 1) * MICRO_ROWS)
    model(tokens[rows], targets[rows]).backward()
    fused = megatron_fsdp.total_grad_norm(model).item()
    torch_way = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3).full_tensor().item()
    return {"expected": expected, "fused": fused, "torch": torch_way}


def test_clip_norms_count_tensor_parallel_replicas_once() -> None:
    """Plain parameters are replicated over tp, sharded ones split: both ways to clip must give
    the TP model's own norm (a replicated norm counted per tp rank would be sqrt(2) off)."""
    for rank, norms in enumerate(run_distributed(_clip_norms, WORLD)):
        for way in ("fused", "torch"):
            assert abs(norms[way] - norms["expected"]) <= 1e-5 * norms["expected"], f"rank {rank} {way}: {norms}"
