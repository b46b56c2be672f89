"""Hybrid sharding on a 2 x 2 mesh (dp_outer x dp_shard) of 4 gloo ranks against a
single-process run on the same global batch (tolerances as in test_parity.py), and the checks
on hybrid arguments."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
from megatron_fsdp.engine.buckets.bucket_state import GradsState, OuterAverage
from _dist import run_distributed
from models import Block, make_batch, make_model
from parity import Setup, check_collectives, compare, reference_run, sharded_runs

WORLD = 4
SETUPS = {
    f"{outer}-s{strategy}-a{accum}": Setup(strategy=strategy, accum=accum, hsdp=(2, 2), outer_strategy=outer, optimizer="sgd" if accum > 1 else "adam")
    for outer, strategies in (("no_shard", range(4)), ("optim", [3]))
    for strategy in strategies
    for accum in (1, 3)
}
# Accumulation, with the collectives counted (test_accumulation_collectives below).
ACCUMULATING = {
    "no_shard-s3-deferred": Setup(strategy=3, accum=3, hsdp=(2, 2), sync_each_microbatch=False, count_collectives=True),
    "optim-s3-no-sync": Setup(
        strategy=3, accum=3, hsdp=(2, 2), outer_strategy="optim", no_sync_until_last=True, count_collectives=True
    ),
    "no_shard-s1-no-sync": Setup(strategy=1, accum=3, hsdp=(2, 2), no_sync_until_last=True, count_collectives=True),
}
SETUPS.update(ACCUMULATING)
# Megatron-LM's loop: auto-sync off (megatron-core builds MegatronFSDP with its default), every
# micro-batch but the last inside no_sync(), then finish_grad_sync().
SETUPS["no_shard-s3-megatron-loop"] = Setup(
    strategy=3, accum=3, hsdp=(2, 2), sync_each_microbatch=False, no_sync_until_last=True, count_collectives=True
)
# Clipping: HSDP replicas must not count twice; HFSDP pieces live on the 2-D mesh.
for _outer, _way in (("no_shard", "torch"), ("no_shard", "fused"), ("optim", "torch"), ("optim", "fused")):
    SETUPS[f"{_outer}-s3-clip-{_way}"] = Setup(strategy=3, accum=2, hsdp=(2, 2), outer_strategy=_outer, clip=_way, steps=4)


@functools.cache
def _results() -> dict:
    names = list(SETUPS)
    return dict(zip(names, run_distributed(sharded_runs, WORLD, [SETUPS[n] for n in names], timeout=600)[0]))


@pytest.mark.parametrize("name", list(SETUPS))
def test_hsdp_and_hfsdp_match_single_process(name: str) -> None:
    setup = SETUPS[name]
    compare(_results()[name], reference_run(setup, WORLD), 1e-5, 1e-5, 1e-5, f"{name} 2x2")


@pytest.mark.parametrize("name", list(ACCUMULATING))
def test_accumulation_defers_the_outer_average_to_the_sync(name: str) -> None:
    """Counted at torch.distributed's functions: micro-batches that hold back reduce only over dp_shard
    (strategy 3) or not at all (strategy 1); the dp_outer average runs once, at the sync."""
    check_collectives(_results()[name], SETUPS[name], name)


def test_megatron_lms_last_micro_batch_averages_each_bucket_over_the_replicas_under_its_backward() -> None:
    """Counted at torch.distributed's functions: the micro-batches under no_sync() reduce-scatter
    only; the last one launches each bucket's all-reduce over dp_outer as soon as its
    reduce-scatter is finished, within its backward, but for the last two buckets' (at most
    max_reductions_in_flight reduce-scatters stay in flight), which finish_grad_sync finishes;
    one all-reduce per bucket a step, as before."""
    result = _results()["no_shard-s3-megatron-loop"]
    buckets = result.trainable_buckets
    for step, windows in enumerate(result.collectives):
        averages = [window["all_reduce"] for window in windows]
        assert averages == [0, 0, buckets - 2, 2], f"step {step}: all-reduces per micro-batch and sync {averages}"


def test_a_bucket_refuses_to_change_its_gradients_while_their_replica_average_is_in_flight() -> None:
    """The all-reduce launched under backward writes the main gradient: a reduction adding into it,
    or its release, before the wait would race with the collective; each raises, naming the bucket."""
    state = GradsState("bucket-7", 1)
    state.reduction_finished(has_outer=True)
    assert state.outer is OuterAverage.DUE
    state.outer_launched()
    with pytest.raises(RuntimeError, match="bucket-7: a reduction finished while its dp_outer average was in flight"):
        state.reduction_finished(has_outer=True)
    with pytest.raises(RuntimeError, match="bucket-7: the gradients were released while"):
        state.outer_dropped()
    state.outer_synced()
    assert state.outer is OuterAverage.AVERAGED
    with pytest.raises(RuntimeError, match="bucket-7: a dp_outer average was waited for while averaged"):
        state.outer_synced()


def _hfsdp_optimizer_sizes(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    sizes = {}
    for outer in ("no_shard", "optim"):
        model = megatron_fsdp.fully_shard_model(
            make_model(), device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
            outer_dp_sharding_strategy=outer, fsdp_unit_modules=[Block],
        )
        sizes[outer] = sum(p.numel() for p in model.optimizer_params().values())
    return sizes


def test_hfsdp_shards_the_optimizer_state_across_the_outer_group_too() -> None:
    per_rank = run_distributed(_hfsdp_optimizer_sizes, WORLD)
    total = sum(p.numel() for p in make_model().parameters())
    # HSDP keeps one optimizer copy per outer replica; HFSDP holds every element exactly once.
    assert sum(sizes["no_shard"] for sizes in per_rank) == 2 * total
    assert sum(sizes["optim"] for sizes in per_rank) == total


def _bad_outer(rank: int, world: int, arguments: dict) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    try:
        megatron_fsdp.fully_shard_model(make_model(), device_mesh=mesh, dp_shard_dim="dp_shard", fsdp_unit_modules=[Block], **arguments)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_invalid_hybrid_combinations_are_rejected_before_any_collective() -> None:
    cases = [
        ({"dp_outer_dim": "dp_outer", "outer_dp_sharding_strategy": "optim", "zero_dp_strategy": "optim_grads"}, "requires zero_dp_strategy='optim_grads_params'"),
        ({"dp_outer_dim": "dp_outer", "outer_dp_sharding_strategy": "optim_grads"}, "is not supported: use no_shard"),
        ({"outer_dp_sharding_strategy": "optim"}, "needs dp_outer_dim"),
        ({"dp_outer_dim": "replicas"}, "no dim named 'replicas'"),
    ]
    for arguments, expected in cases:
        message = run_distributed(_bad_outer, WORLD, arguments)[0]
        assert expected in message, (arguments, message)


def _hybrid_checkpoint(rank: int, world: int, path: str, hybrid: bool) -> dict:
    if hybrid:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
        arguments = dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", outer_dp_sharding_strategy="optim")
    else:
        arguments = {}
    model = make_model(seed=rank if not hybrid else 0)
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block], **arguments)
    if hybrid:
        for step in range(2):
            tokens, targets = make_batch(step, 2 * world)
            model(tokens[rank::world], targets[rank::world]).backward()
            optimizer.step()
            optimizer.zero_grad()
        dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    else:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path + "-again")
    return model.full_parameters()


def test_hfsdp_checkpoints_reshard_to_plain_fsdp(tmp_path) -> None:
    path = str(tmp_path / "hfsdp")
    saved = run_distributed(_hybrid_checkpoint, WORLD, path, True)[0]
    loaded = run_distributed(_hybrid_checkpoint, 2, path, False)[0]
    for name, value in saved.items():
        assert torch.equal(value, loaded[name]), name
    dcp_to_torch_save(path, str(tmp_path / "a.pt"))
    dcp_to_torch_save(path + "-again", str(tmp_path / "b.pt"))
    a, b = torch.load(tmp_path / "a.pt", weights_only=False), torch.load(tmp_path / "b.pt", weights_only=False)
    for fqn, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][fqn][key]), (fqn, key)
