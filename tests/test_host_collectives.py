"""The engine's collectives on host tensors (gloo) return only once gloo's worker thread has let
go of the tensors (engine/groups/collectives.py): a worker dropping the last reference to a tensor
Python knows during interpreter exit aborted one run in three of a script ending right after an
HFSDP step.

Checked right after each collective returns: every alias it ran on is gone, and the caller's
tensors have their reference counts of before. With the engine's wait removed, an alias outlives
the call about one call in three (torch's own collectives leave the caller's tensors held as
often), so the loops below catch a wait that stops early."""

from __future__ import annotations

import sys
import weakref

import torch
import torch.distributed as dist

from megatron_fsdp.engine.groups import collectives

from _dist import run_distributed

CALLS = 40


def _references(*tensors: torch.Tensor) -> tuple[int, ...]:
    return tuple(sys.getrefcount(tensor) for tensor in tensors)


def _recorded(alias: torch.Tensor, aliases: list[weakref.ref]) -> torch.Tensor:
    aliases.append(weakref.ref(alias))
    return alias


def _collectives_let_go(rank: int, world: int) -> list[str]:
    group = dist.new_group(list(range(world)))
    shard = torch.full((4,), float(rank + 1), dtype=torch.float64)
    full = torch.zeros(4 * world, dtype=torch.float64)
    summed = torch.zeros(4, dtype=torch.float64)
    received = torch.zeros(4, dtype=torch.float64)
    everyone = torch.arange(1, world + 1, dtype=torch.float64)
    calls = {
        "all_gather_shards": (lambda: collectives.all_gather_shards(full, shard, group), (full, shard),
                              lambda: torch.equal(full, everyone.repeat_interleave(4))),
        "prefetched all_gather_shards": (lambda: collectives.all_gather_shards(full, shard, group, async_op=True).wait(),
                                         (full, shard), lambda: torch.equal(full, everyone.repeat_interleave(4))),
        "reduce_scatter_sum": (lambda: collectives.reduce_scatter_sum(summed, full.fill_(1.0), group), (summed, full),
                               lambda: torch.equal(summed, torch.full((4,), float(world), dtype=torch.float64))),
        "all_reduce_max": (lambda: collectives.all_reduce_max(shard, group), (shard,),
                           lambda: torch.equal(shard, torch.full((4,), float(world), dtype=torch.float64))),
        "all_to_all_uneven": (lambda: collectives.all_to_all_uneven(received, shard, [4 // world] * world,
                                                                    [4 // world] * world, group),
                              (received, shard), lambda: bool((received == float(world)).all())),
    }
    aliases: list[weakref.ref] = []
    make_alias = collectives._alias
    # Each alias a collective makes, recorded (this pooled process gets the function back after).
    collectives._alias = lambda tensor: _recorded(make_alias(tensor), aliases)
    failures = []
    try:
        for name, (call, tensors, result_is_right) in calls.items():
            before = _references(*tensors)
            held = 0
            for _ in range(CALLS):
                aliases.clear()
                call()
                held += _references(*tensors) != before or not aliases or any(alias() is not None for alias in aliases)
            if held or not result_is_right():
                failures.append(f"{name}: still referenced after {held} of {CALLS} calls, result right: {result_is_right()}")
    finally:
        collectives._alias = make_alias
    return failures


def test_host_collectives_return_after_gloo_let_go_of_their_tensors() -> None:
    for rank, failures in enumerate(run_distributed(_collectives_let_go, 2)):
        assert failures == [], f"rank {rank}: {failures}"
