"""Mistakes that would hang a job raise instead: ranks configured differently fail together at
fully_shard, and a rank missing from a collective makes the others raise within
collective_timeout, naming the unit or bucket they waited for."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

import megatron_fsdp
import fault_drills
from _dist import run_distributed
from megatron_fsdp.engine.groups.collective_watch import PROBE_SECONDS
from models import Block, make_batch, make_model


def _retyped_pos(model: nn.Module, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Module:
    model.pos = nn.Parameter(torch.zeros(shape, dtype=dtype))
    return model


# Each case: what rank 0 and rank 1 pass (model and fully_shard arguments), and the entry of the
# description the error must name.
MISMATCHES = {
    "strategy": ({}, {"zero_dp_strategy": "optim_grads"}, "setting strategy"),
    "unit list": ({}, {"fsdp_unit_modules": [Block, nn.LayerNorm]}, "fsdp_unit_modules"),
    "unit class missing on one rank": ({}, {"fsdp_unit_modules": [Block, nn.Conv2d]}, "fsdp_unit_modules"),
    "model depth": ({}, {"layers": 3}, "parameter blocks.2.norm1.weight"),
    "parameter shape": ({}, {"pos": ((5, 20), torch.float32)}, "parameter pos"),
    "parameter dtype": ({}, {"pos": ((9, 20), torch.float64)}, "parameter pos"),
    "mixed precision": (
        {},
        {"mixed_precision_policy": megatron_fsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32)},
        "setting mixed_precision",
    ),
    "nan check": ({}, {"check_for_nan_in_grad": True}, "setting check_for_nan_in_grad"),
}


def _shard_mismatched_then_matched(rank: int, world: int) -> tuple[dict[str, str], float]:
    messages = {}
    for case, (rank0, rank1, _) in MISMATCHES.items():
        options = dict(rank0 if rank == 0 else rank1)
        model = make_model(layers=options.pop("layers", 2))
        if "pos" in options:
            model = _retyped_pos(model, *options.pop("pos"))
        arguments = {"fsdp_unit_modules": [Block], **options}
        try:
            megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters()), **arguments)
            messages[case] = "no error"
        except ValueError as error:
            messages[case] = str(error)
    # The failed checks left the process group usable: the same configuration trains.
    model = make_model()
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters()), fsdp_unit_modules=[Block])
    tokens, targets = make_batch(0, 2 * world)
    loss = model(tokens[rank::world], targets[rank::world])
    loss.backward()
    optimizer.step()
    return messages, loss.item()


def test_ranks_with_different_configurations_raise_the_same_error_naming_the_difference() -> None:
    (rank0, loss0), (rank1, loss1) = run_distributed(_shard_mismatched_then_matched, 2, timeout=120)
    for case, (_, _, entry) in MISMATCHES.items():
        assert rank0[case] == rank1[case], f"{case}: ranks raised different errors:\n{rank0[case]}\n{rank1[case]}"
        assert "the ranks shard different models or configurations" in rank0[case], f"{case}: {rank0[case]}"
        assert f"\n  {entry}: " in rank0[case], f"{case}: the error does not name {entry!r}:\n{rank0[case]}"
        assert "on ranks [0]" in rank0[case] and "on ranks [1]" in rank0[case], rank0[case]
    assert torch.isfinite(torch.tensor([loss0, loss1])).all(), (loss0, loss1)


TIMEOUT = 2.0


def _one_rank_skips(rank: int, world: int, strategy: str, skipped: str) -> None:
    """Rank 0 skips ``skipped`` ("forward" or "backward"); rank 1 runs the step and must raise."""
    model = make_model()
    model, _ = megatron_fsdp.fully_shard(model, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                         collective_timeout=TIMEOUT)
    tokens, targets = make_batch(0, 2 * world)
    if rank == 0:
        if skipped == "backward":
            model(tokens[rank::world], targets[rank::world])
        time.sleep(60)  # the test fails if rank 1 waits this long
        return
    started = time.monotonic()
    try:
        model(tokens[rank::world], targets[rank::world]).backward()
    except RuntimeError as error:
        raise RuntimeError(f"raised after {time.monotonic() - started:.2f} s: {error}") from None


@pytest.mark.parametrize(
    "strategy, skipped, named",
    [
        # optim_grads_params gathers the root unit's weights first thing in forward.
        ("optim_grads_params", "forward", r"unit '<root>': the all-gather of its weights \(bucket 0: torch.float32, "),
        # optim_grads has nothing to gather; the first gradient bucket to reduce is the root
        # unit's final norm (the root has one bucket per module, and the norm's grads come first).
        ("optim_grads", "backward", r"the gradient reduction of the torch.float32 bucket of norm\.weight \.\. norm\.bias"),
    ],
)
def test_a_rank_missing_from_a_collective_makes_the_others_raise_within_the_timeout(strategy, skipped, named) -> None:
    with pytest.raises(RuntimeError) as failure:
        run_distributed(_one_rank_skips, 2, strategy, skipped, timeout=50)
    report = str(failure.value)
    match = re.search(r"raised after ([0-9.]+) s: (.*)", report)
    assert match, f"rank 1 did not raise in time:\n{report}"
    elapsed, message = float(match.group(1)), match.group(2)
    # Past the timeout the heartbeats are read twice, PROBE_SECONDS apart.
    assert TIMEOUT <= elapsed < TIMEOUT + PROBE_SECONDS + 3, f"raised after {elapsed} s with collective_timeout={TIMEOUT}"
    assert re.search(named, message), f"the error does not name {named!r}: {message}"
    assert f"did not complete: no result within collective_timeout={TIMEOUT:g} s" in message, message
    # Rank 0 sleeps outside any collective: its heartbeat goes on, naming it as the one missing.
    assert "rank 0 is alive but not in this collective (it waits for no collective)" in message, message


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "10", True])
def test_collective_timeout_must_be_a_positive_number_of_seconds(bad, single_rank_group) -> None:
    with pytest.raises(ValueError, match="collective_timeout must be None or a number of seconds > 0"):
        megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block], collective_timeout=bad)


def test_a_killed_rank_makes_the_others_raise_naming_it() -> None:
    # gloo notices the closed connection at once; the heartbeats then name the rank that died.
    results = run_distributed(fault_drills.one_rank_fails, 2, "killed", "cpu", dying_ranks=frozenset({1}), timeout=60)
    fault_drills.check_survivors(results, "killed", slack=3)
