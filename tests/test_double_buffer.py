"""fsdp_double_buffer: persistent pool blocks that matching buckets of successive units take turns
on. It changes where temporary buckets live, never the arithmetic: a run with it must equal the
same run without it bit for bit, for every strategy, with accumulation, on 2 gloo ranks. After
the first step it allocates nothing: the pool's reserved bytes stay flat and a repetitive model's
unit weights alternate on exactly two blocks."""

from __future__ import annotations

import pytest
import torch

import megatron_fsdp
from _dist import run_distributed
from models import Block, make_batch, make_model

STEPS, ACCUM, ROWS = 4, 2, 2
UNIT_WEIGHTS_KEY = "weights/unit:float32:trainable"


def _train(rank: int, world: int, strategy: int, double_buffer: bool, overlap_grad_reduce: bool) -> dict:
    model = make_model(layers=4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = megatron_fsdp.fully_shard(
        model, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, fsdp_double_buffer=double_buffer,
        overlap_grad_reduce=overlap_grad_reduce,
    )
    losses, reserved = [], []
    for step in range(STEPS):
        tokens, targets = make_batch(step, world * ACCUM * ROWS)
        for micro in range(ACCUM):
            rows = slice((micro * world + rank) * ROWS, (micro * world + rank + 1) * ROWS)
            loss = model(tokens[rows], targets[rows])
            (loss / ACCUM).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        reserved.append(model.pool.bytes_reserved())
    return dict(
        losses=losses,
        reserved=reserved,
        blocks=dict(model.pool.blocks_per_key()),
        params={name: value.clone() for name, value in model.full_parameters().items()},
    )


def _both(rank: int, world: int, strategy: int, overlap_grad_reduce: bool) -> tuple[dict, dict]:
    return (_train(rank, world, strategy, False, overlap_grad_reduce),
            _train(rank, world, strategy, True, overlap_grad_reduce))


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_double_buffer_trains_exactly_like_the_size_cache(strategy: int) -> None:
    for rank, (cached, persistent) in enumerate(run_distributed(_both, 2, strategy, True)):
        assert persistent["losses"] == cached["losses"], f"rank {rank}: losses differ"
        for name, value in cached["params"].items():
            assert torch.equal(persistent["params"][name], value), f"rank {rank}: {name} differs after {STEPS} steps"
        assert len(set(persistent["reserved"])) == 1, f"rank {rank}: pool grew after the first step: {persistent['reserved']}"
        blocks = persistent["blocks"]
        if strategy == 3:
            # Unit i's weights are gathered while unit i+1's prefetch lands: two, never more.
            assert blocks[UNIT_WEIGHTS_KEY] == 2, blocks
        else:
            assert not any(key.startswith("weights/") for key in blocks), f"weights are not pooled below ZeRO-3: {blocks}"


def test_reductions_in_flight_get_their_own_persistent_blocks() -> None:
    # Each reduction in flight holds its unit's gradient bucket while the next unit's gradients
    # arrive: the key grows to as many blocks. Without overlap one reduction at a time.
    results = run_distributed(_both, 2, 2, False)
    for rank, (cached, persistent) in enumerate(results):
        assert persistent["losses"] == cached["losses"], f"rank {rank}: losses differ"
        assert len(set(persistent["reserved"])) == 1, persistent["reserved"]
    narrow = results[0][1]["blocks"]
    wide = run_distributed(_both, 2, 2, True)[0][1]["blocks"]
    assert narrow["grads/unit:float32:trainable"] == 1, narrow
    assert wide["grads/unit:float32:trainable"] == 3, wide  # the current unit's and two in flight
