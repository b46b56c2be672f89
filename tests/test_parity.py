"""Sharded training on 2 and 4 gloo ranks against a single-process run of the same model, data
and seed: the loss of every step, the reduced gradients of the last step and the parameters
after 5 steps, for every strategy, accumulation count, dtype and model feature.

fp32 tolerance 1e-5 relative (to each tensor's largest entry): the runs differ only in the
order of fp32 sums (per-rank partial sums, reduce-scatter), about 1e-7 relative per step; 5
Adam steps measured below 1e-6, so 1e-5 leaves a 10x margin and any real bug (wrong shard,
missing average, gradient counted twice) is O(1). bf16: see parity.compare_low_precision.

float64 (a float64 model whose main params stay float64, as FSDP2 trains float64 parameters):
the same order-of-summation differences at float64's unit roundoff (1e-16), 1e-12 relative
leaves the same kind of margin; a step in fp32 anywhere (main params, gradients or
communication) would be 1e-7 off and fail it.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _dist import run_distributed
from megatron_fsdp import MixedPrecisionPolicy
from parity import Setup, check_collectives, compare, compare_low_precision, reference_run, sharded_runs

FP32_RTOL = 1e-5
FP64_RTOL = 1e-12

SETUPS: dict[str, Setup] = {}
for _strategy in range(4):
    for _accum in (1, 3):
        SETUPS[f"fp32-s{_strategy}-a{_accum}"] = Setup(strategy=_strategy, accum=_accum, count_collectives=True)
        SETUPS[f"bf16-s{_strategy}-a{_accum}"] = Setup(strategy=_strategy, accum=_accum, dtype=torch.bfloat16, optimizer="sgd")
    # main_params_dtype=None: the main params in the model's dtype, float64.
    SETUPS[f"fp64-s{_strategy}-a2"] = Setup(
        strategy=_strategy, accum=2, dtype=torch.float64, policy=MixedPrecisionPolicy(main_params_dtype=None)
    )
    # SGD: with frozen norms and a block run twice some gradients sit near zero on some steps,
    # where Adam turns 1e-7 rounding differences into 1e-5 parameter differences.
    SETUPS[f"untied-frozen-reused-s{_strategy}"] = Setup(
        strategy=_strategy, accum=2, optimizer="sgd", model_options=(("tie", False), ("frozen", True), ("reuse_last_block", True))
    )
    SETUPS[f"no-sync-s{_strategy}"] = Setup(strategy=_strategy, accum=3, no_sync_until_last=True, count_collectives=True)
    SETUPS[f"deferred-sync-s{_strategy}"] = Setup(
        strategy=_strategy, accum=3, sync_each_microbatch=False, count_collectives=True
    )
    # Clipping, either way, with accumulation: every step clips (MAX_NORM is below every norm).
    SETUPS[f"clip-torch-s{_strategy}"] = Setup(strategy=_strategy, accum=2, clip="torch", steps=4)
    SETUPS[f"clip-fused-s{_strategy}"] = Setup(strategy=_strategy, accum=2, clip="fused", steps=4)
SETUPS["sgd-s3"] = Setup(strategy="optim_grads_params", optimizer="sgd")
SETUPS["adamw-foreach-s1"] = Setup(strategy="optim", optimizer="adamw_foreach", accum=2)
SETUPS["adam-fused-s3"] = Setup(strategy=3, optimizer="adam_fused")
SETUPS["adam-fused-s2"] = Setup(strategy="optim_grads", optimizer="adam_fused")
# As Megatron-LM calls it under optim and optim_grads: no units (the whole model is one), or only
# classes the model does not hold.
SETUPS["no-units-s1"] = Setup(strategy="optim", accum=2, unit_modules=())
SETUPS["absent-units-s2"] = Setup(strategy="optim_grads", unit_modules=(torch.nn.LSTM,))


@functools.cache
def _sharded_results(world: int) -> dict:
    """Every setup trained in one launch of ``world`` processes (rank 0's view)."""
    names = list(SETUPS)
    per_rank = run_distributed(sharded_runs, world, [SETUPS[n] for n in names], timeout=600)
    for rank, results in enumerate(per_rank[1:], start=1):
        for name, theirs, ours in zip(names, results, per_rank[0]):
            for key, value in ours.params.items():
                assert torch.equal(value, theirs.params[key]), f"{name}: rank {rank} ends with other parameters than rank 0"
    return dict(zip(names, per_rank[0]))


def _check(name: str, world: int) -> None:
    setup = SETUPS[name]
    got = _sharded_results(world)[name]
    reference = reference_run(setup, world)
    if setup.dtype in (torch.float32, torch.float64):
        rtol = FP64_RTOL if setup.dtype == torch.float64 else FP32_RTOL
        compare(got, reference, rtol, rtol, rtol, f"{name} world {world}")
    else:
        exact = reference_run(setup, world, compute_dtype=torch.float32)
        compare_low_precision(got, reference, exact, f"{name} world {world}")


WORLDS = [2, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [n for n in SETUPS if n.startswith(("fp32", "fp64", "bf16"))])
def test_every_strategy_accumulation_and_dtype_matches_single_process(name: str, world: int) -> None:
    _check(name, world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", range(4))
def test_tied_frozen_non_unit_and_reused_modules_match_single_process(strategy: int, world: int) -> None:
    _check(f"untied-frozen-reused-s{strategy}", world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", range(4))
def test_no_sync_and_deferred_sync_accumulate_each_gradient_once(strategy: int, world: int) -> None:
    _check(f"no-sync-s{strategy}", world)
    _check(f"deferred-sync-s{strategy}", world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", range(4))
def test_each_micro_batch_launches_the_reductions_the_accumulation_table_names(strategy: int, world: int) -> None:
    """Counted at torch.distributed's functions: synced each micro-batch, every strategy reduces every
    bucket each micro-batch; inside no_sync() or with auto-sync off, 0/1 launch no collective
    until the sync and 2/3 reduce-scatter each bucket once per micro-batch."""
    for name in (f"fp32-s{strategy}-a3", f"no-sync-s{strategy}", f"deferred-sync-s{strategy}"):
        check_collectives(_sharded_results(world)[name], SETUPS[name], f"{name} world {world}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", range(4))
def test_clip_grad_norm_torch_and_fused_match_single_process_clipping(strategy: int, world: int) -> None:
    """torch.nn.utils.clip_grad_norm_(model.parameters()) on the DTensor gradients and
    megatron_fsdp.clip_grad_norm_ return the single process's norm and clip the same way."""
    _check(f"clip-torch-s{strategy}", world)
    _check(f"clip-fused-s{strategy}", world)


@pytest.mark.parametrize("world", WORLDS)
def test_optim_strategy_reduces_each_gradient_once(world: int) -> None:
    """Seed 004's bug: ``optim`` added the reduced shard back onto the un-reduced gradient,
    doubling it. Accumulating over 3 micro-batches, synced each time or only at the end, the
    gradients must equal the reference's."""
    for name in ("fp32-s1-a3", "no-sync-s1", "deferred-sync-s1"):
        _check(name, world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["sgd-s3", "adamw-foreach-s1", "adam-fused-s3", "adam-fused-s2"])
def test_sgd_foreach_and_fused_optimizers_match_single_process(name: str, world: int) -> None:
    _check(name, world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["no-units-s1", "absent-units-s2"])
def test_without_units_the_whole_model_trains_as_one_unit_like_single_process(name: str, world: int) -> None:
    _check(name, world)


# One rank: every collective is a local copy, and under strategies 2/3 with gradients kept in
# the communication dtype the gradients go straight into the main gradient (no reduction
# buffer); accumulation, unused and twice-used parameters and clipping each meet those paths
# once (test_mixed_precision.py runs the mixed-precision policies on one rank).
ONE_RANK_SETUPS = {
    **{f"s{strategy}-a3": Setup(strategy=strategy, accum=3) for strategy in range(4)},
    "untied-frozen-reused-s3": Setup(
        strategy=3, accum=2, optimizer="sgd", model_options=(("tie", False), ("frozen", True), ("reuse_last_block", True))
    ),
    "clip-torch-s2": Setup(strategy=2, accum=2, clip="torch", steps=4),
    "deferred-sync-s3": Setup(strategy=3, accum=3, sync_each_microbatch=False),
}


@functools.cache
def _one_rank_results() -> dict:
    names = list(ONE_RANK_SETUPS)
    return dict(zip(names, run_distributed(sharded_runs, 1, [ONE_RANK_SETUPS[n] for n in names], timeout=600)[0]))


@pytest.mark.parametrize("name", list(ONE_RANK_SETUPS))
def test_one_rank_matches_single_process(name: str) -> None:
    compare(_one_rank_results()[name], reference_run(ONE_RANK_SETUPS[name], 1), FP32_RTOL, FP32_RTOL, FP32_RTOL, f"{name} world 1")
