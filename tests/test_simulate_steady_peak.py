"""The simulator's peak is a training step's as every step after the first runs it (issue 60): a
second real step (``optimizer.zero_grad()``, forward, backward, optimizer step) with the
optimizer state held from its start. The first step's peak, before AdamW's moments exist, is kept
beside it. Both sides: ours (the allocation log) and torch's FSDP2 (FSDPMemTracker)."""

from __future__ import annotations

import pytest
import torch

from megatron_fsdp.simulate import MeshSizes, simulate_rank
from megatron_fsdp.simulate.models import hugging_face
from megatron_fsdp.simulate.torch_fsdp2 import simulate_torch_fsdp2
from megatron_fsdp.simulate.traffic import Collective, count_difference

pytest.importorskip("transformers")

# Llama-3 8B's shapes, one layer, at W = 8: AdamW's state (8 bytes an element of the rank's
# shard) is as large as the rest of the peak, so a peak without it is visibly short.
MESH = MeshSizes(8)
OPTIONS = dict(seq_len=128)


@pytest.fixture(scope="module")
def llama():
    return hugging_face("llama3-8b", torch.bfloat16, num_hidden_layers=1)


def test_our_steady_state_peak_holds_the_optimizer_state_the_first_step_lacks(llama) -> None:
    one = simulate_rank(llama.build, MESH, 7, fsdp_unit_modules=list(llama.units), steps=1, **OPTIONS)
    two = simulate_rank(llama.build, MESH, 7, fsdp_unit_modules=list(llama.units), **OPTIONS)
    assert two.steps == 2 and one.steps == 1
    state = two.model_states["optimizer state"]
    assert state > 0.25 * two.first_step_peak  # the case means something: the state is a large part (30%)
    # No leak: the second step leaves the rank holding what the first left, kind by kind.
    assert two.model_states == one.model_states
    # The first step is the same step either way; at its peak (backward) no optimizer state exists.
    assert two.first_step_peak == one.step_peak == one.first_step_peak
    assert two.first_step_breakdown == one.peak_breakdown
    assert "optimizer state" not in one.peak_breakdown
    # The second step's peak is the same moment with the whole state held: the first's plus the
    # state, to the byte (the bucket pool hands its blocks back, so nothing else is carried over).
    assert two.peak_breakdown["optimizer state"] == state
    assert two.step_peak == one.step_peak + state
    row = two.to_dict()
    assert (row["step_peak"], row["first_step_peak"]) == (two.step_peak, one.step_peak)
    assert row["step_peak_is"].startswith("the second step's")
    assert f"first step's peak: {one.step_peak / 2**30:.3f} GiB" in str(two)
    # One step's collectives are reported: the same with one step or two.
    assert two.step_collectives() == one.step_collectives() and two.sent_per_step() == one.sent_per_step()


def test_torch_fsdp2s_steady_state_peak_is_read_over_the_second_step(llama) -> None:
    one = simulate_torch_fsdp2(llama.build, MESH, 7, fsdp_unit_modules=list(llama.units), steps=1, **OPTIONS)
    two = simulate_torch_fsdp2(llama.build, MESH, 7, fsdp_unit_modules=list(llama.units), **OPTIONS)
    state = two.model_states["OptState"]
    assert two.model_states == one.model_states
    assert two.first_step_peak == one.step_peak and "OptState" not in one.peak_breakdown
    # FSDPMemTracker entered again for the second step: its peak holds the whole state, and its
    # total is the first step's plus the state (the tracker may file the rest under other kinds).
    assert two.peak_breakdown["OptState"] == state
    assert two.step_peak == one.step_peak + state


def test_a_second_step_that_issues_other_collectives_is_named() -> None:
    def gather(nbytes: int, phase: str = "forward") -> Collective:
        return Collective(phase, "all_gather", 8, torch.bfloat16, nbytes, nbytes * 7 // 8, tuple(range(8)))

    phases = ("forward", "backward")
    first = [gather(64), gather(128), gather(64, "backward")]
    assert count_difference(first, [gather(128), gather(64), gather(64, "backward")], phases) is None  # order aside
    assert count_difference(first, first + [gather(64, "optimizer step")], phases) is None  # other phases aside
    assert count_difference(first, [gather(64), gather(128)], phases) == (
        "('backward', 'all_gather') bfloat16 64 bytes: 1 in the first step, 0 in the second")


def test_steps_other_than_one_or_two_are_refused(llama) -> None:
    with pytest.raises(ValueError, match="steps=3"):
        simulate_rank(llama.build, MESH, 7, fsdp_unit_modules=list(llama.units), steps=3, **OPTIONS)
