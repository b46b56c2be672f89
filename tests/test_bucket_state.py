"""The bucket's state transitions (engine/buckets/bucket_state.py): a normal step's go through,
the two the schedule must never make raise and name the bucket."""

from __future__ import annotations

import pytest
import torch

import megatron_fsdp
from megatron_fsdp.engine.buckets.bucket_state import WeightState
from models import Block, make_batch, make_model


def _sharded_model_and_optimizer():
    model = make_model()
    return megatron_fsdp.fully_shard(
        model, torch.optim.Adam(model.parameters(), lr=0.1), fsdp_unit_modules=[Block],
        zero_dp_strategy="optim_grads_params",
    )


def _names_the_bucket(message: str, bucket) -> bool:
    return bucket.names[0] in message and bucket.names[-1] in message


def test_normal_steps_move_through_the_states_without_raising(single_rank_group) -> None:
    model, optimizer = _sharded_model_and_optimizer()
    buckets = [b for unit in model.units for b in unit.buckets]
    assert all(b.weights.state.current is WeightState.SHARDED for b in buckets)
    for step in range(2):  # the second step gathers and reduces each bucket again
        model(*make_batch(step, 2)).backward()
        assert all(b.weights.state.current is WeightState.SHARDED for b in buckets), "resharded after backward"
        optimizer.step()
        optimizer.zero_grad()
    # A gather, its reshard, and a gather again: the cycle the schedule runs each step.
    bucket = model.units[1].buckets[0]
    for _ in range(2):
        bucket.weights.gather(async_op=False)
        bucket.weights.point_params_at_full()
        assert bucket.weights.state.current is WeightState.GATHERED
        bucket.weights.release()
        assert bucket.weights.state.current is WeightState.SHARDED


def test_a_second_gather_without_a_reshard_raises_and_names_the_bucket(single_rank_group) -> None:
    model, _ = _sharded_model_and_optimizer()
    bucket = model.units[1].buckets[0]
    bucket.weights.gather(async_op=False)
    with pytest.raises(RuntimeError, match="gathered again without a reshard") as raised:
        bucket.weights.gather(async_op=False)
    assert _names_the_bucket(str(raised.value), bucket), raised.value
    assert bucket.weights.state.current is WeightState.GATHERED, "the refused gather changed the state"
    bucket.weights.point_params_at_full()
    bucket.weights.release()  # the first gather is still given back
    assert bucket.weights.state.current is WeightState.SHARDED


def test_a_reduction_with_no_gradient_taken_raises_and_names_the_bucket(single_rank_group) -> None:
    model, _ = _sharded_model_and_optimizer()
    bucket = model.units[1].trainable_buckets[0]
    with pytest.raises(RuntimeError, match="no gradient taken") as raised:
        bucket.grads.start_reduction(async_op=False)  # before any backward
    assert _names_the_bucket(str(raised.value), bucket), raised.value
    model(*make_batch(0, 2)).backward()  # takes and reduces every bucket's gradients
    with pytest.raises(RuntimeError, match="no gradient taken") as raised:
        bucket.grads.start_reduction(async_op=False)  # a second reduction of the same gradients
    assert _names_the_bucket(str(raised.value), bucket), raised.value
