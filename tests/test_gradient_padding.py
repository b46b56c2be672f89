"""A bucket's padding holds no gradient: a fresh un-reduced buffer comes from the pool with whatever
an earlier use left in it, and only its padding ranges are zeroed (the parameters' ranges are
written). Stale NaN there would reach the reduced shards, which check_for_nan_in_grad reads whole."""

from __future__ import annotations

import math

import pytest
import torch

from _dist import run_distributed
from parity import Result, Setup, compare, reference_run, sharded_run

# Float32 throughout; the sharded run sums the same rows in another order: 1e-5 as tests/test_parity.py.
FP32_RTOL = 1e-5


def _with_stale_buffers(rank: int, world: int, setup: Setup) -> Result:
    """``setup``'s sharded run with every fresh un-reduced gradient buffer full of NaN, as a pool
    buffer last used for anything else may be."""
    from megatron_fsdp.engine.buckets import bucket_grads

    fresh_buffer = bucket_grads.new_unreduced_buffer

    def stale_buffer(grads):
        buffer, holds_earlier = fresh_buffer(grads)
        if not holds_earlier:
            buffer.fill_(math.nan)
        return buffer, holds_earlier

    bucket_grads.new_unreduced_buffer = stale_buffer
    try:
        return sharded_run(rank, world, setup)
    finally:
        bucket_grads.new_unreduced_buffer = fresh_buffer


@pytest.mark.parametrize("strategy", [1, 3])  # accumulated in the main gradient, and reduce-scattered from the pool
def test_stale_pool_contents_never_reach_the_gradients(strategy: int) -> None:
    setup = Setup(strategy=strategy, steps=2, clip="fused", check_for_nan_in_grad=True)
    got = run_distributed(_with_stale_buffers, 2, setup)[0]
    assert all(math.isfinite(norm) for norm in got.norms), f"gradient norms {got.norms}"
    compare(got, reference_run(setup, 2), FP32_RTOL, FP32_RTOL, FP32_RTOL, f"strategy {strategy}, stale buffers")
