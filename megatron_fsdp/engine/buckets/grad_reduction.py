"""The buffers and collectives of a bucket's gradients (bucket_grads.py decides when): the
pooled buffer a reduction's gradients are taken into; one reduction of them over the shard group
(an all-reduce, a reduce-scatter, or an all-to-all summed in a higher precision) and how its
result is added into the main gradient once it is done; the average over the outer replicas,
launched the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_fsdp import _ops
from megatron_fsdp.engine.config import ShardingStrategy
from megatron_fsdp.engine.groups.collectives import all_gather_shards, all_reduce_sum, all_to_all, reduce_scatter_sum

if TYPE_CHECKING:
    from megatron_fsdp.engine.buckets.bucket_grads import BucketGrads
    from megatron_fsdp.engine.buckets.buffer import Bucket


@dataclass
class PendingReduction:
    """A launched reduction: ``finish`` runs once ``work`` is done and adds the result into the
    main gradient."""

    bucket: Bucket
    work: dist.Work | None
    finish: Callable[[], None]


def new_unreduced_buffer(grads: BucketGrads) -> tuple[torch.Tensor, bool]:
    """A buffer for the gradients of the next reduction, and whether it holds earlier
    micro-batches' (to add to, not to write)."""
    bucket = grads.bucket
    if bucket.reduces_in_place():
        # The main gradient is the un-reduced buffer: a fresh one is written, one that holds
        # earlier micro-batches is added to.
        main_grad, fresh = grads.main_grad_to_write()
        return main_grad, not fresh
    # Strategies 0/1 accumulate micro-batches locally: in the main-gradient dtype.
    # 2/3 hold one micro-batch: straight in the communication dtype.
    dtype = bucket.dtypes.comm if bucket.strategy.shards_grads else bucket.dtypes.main_grads
    return bucket.pool.fetch(bucket.layout.padded_numel, dtype, bucket.device, bucket.pool_key("grads")), False


def launch_reduction(grads: BucketGrads, unreduced: torch.Tensor, async_op: bool) -> PendingReduction:
    """Launches the reduction of ``unreduced``. Same-precision communication: an all-reduce
    (no_shard) or reduce-scatter. Lower-precision communication: an all-to-all of the chunks,
    summed in the main-gradient dtype by ``promoting_reduce``."""
    bucket = grads.bucket
    if bucket.reduces_in_place():
        return PendingReduction(bucket, None, lambda: None)  # already in the main gradient
    comm = _in_comm_dtype(bucket, unreduced)
    group, pool, device = bucket.dp.group, bucket.pool, bucket.device
    if bucket.dtypes.promotes_reduction:
        received = pool.fetch(bucket.layout.padded_numel, comm.dtype, device, bucket.pool_key("received_grads"))
        work = all_to_all(received, comm, group, async_op=async_op)
        return PendingReduction(bucket, work, lambda: _finish_promoted(grads, comm, received))
    if bucket.strategy is ShardingStrategy.NO_SHARD or bucket.dp.size == 1:
        # Every rank keeps the whole sum (over one rank its shard is the whole bucket).
        work = all_reduce_sum(comm, group, async_op=async_op)
        return PendingReduction(bucket, work, lambda: _add_to_main_grad(grads, comm, spent=None))
    reduced = pool.fetch(bucket.layout.shard_numel, comm.dtype, device, bucket.pool_key("reduced_grads"))
    work = reduce_scatter_sum(reduced, comm, group, async_op=async_op)
    return PendingReduction(bucket, work, lambda: _add_to_main_grad(grads, reduced, spent=comm))


def _in_comm_dtype(bucket: Bucket, unreduced: torch.Tensor) -> torch.Tensor:
    """The un-reduced gradients in the communication dtype: a pooled copy only when the dtypes
    differ, released right after the reduction."""
    if unreduced.dtype == bucket.dtypes.comm:
        return unreduced
    comm = bucket.pool.fetch(unreduced.numel(), bucket.dtypes.comm, bucket.device, bucket.pool_key("comm_grads"))
    comm.copy_(unreduced)
    bucket.pool.release(unreduced)
    return comm


def _add_to_main_grad(grads: BucketGrads, reduced: torch.Tensor, spent: torch.Tensor | None) -> None:
    """Adds the pooled ``reduced`` gradients into the main gradient and releases them. ``spent``
    (the reduction's input, no longer read) goes back first: a main gradient created now can take
    its memory."""
    pool = grads.bucket.pool
    if spent is not None:
        pool.release(spent)
    # Gradients are averaged over data-parallel ranks: each rank's loss is a mean over its own batch.
    grads.accumulate(reduced, 1.0 / grads.bucket.grad_divisor)
    pool.release(reduced)


def _finish_promoted(grads: BucketGrads, comm: torch.Tensor, received: torch.Tensor) -> None:
    bucket = grads.bucket
    pool, shard_numel = bucket.pool, bucket.layout.shard_numel
    chunks = received.view(bucket.dp.size, shard_numel)
    if bucket.strategy is ShardingStrategy.NO_SHARD:
        # This rank sums its shard in high precision, then every rank gathers every shard.
        shard = pool.fetch(shard_numel, bucket.dtypes.main_grads, bucket.device, bucket.pool_key("reduced_grads"))
        _ops.promoting_reduce(chunks, shard, scale=1.0 / bucket.grad_divisor)
        all_gather_shards(comm, shard.to(comm.dtype), bucket.dp.group)
        pool.release(shard)
        grads.accumulate(comm, 1.0)
        pool.release(comm)
    else:
        pool.release(comm)  # sent: a main gradient created now can take its memory
        main_grad, fresh = grads.main_grad_to_write()
        _ops.promoting_reduce(chunks, main_grad, scale=1.0 / bucket.grad_divisor, accumulate=not fresh)
    pool.release(received)


def launch_outer_average(grads: BucketGrads, async_op: bool) -> PendingReduction:
    """Launches the average of the shard-group-reduced main gradient over the outer group: a sum
    in place (HSDP), or reduce-scattered into ``outer_grad`` (HFSDP: made when None), which
    ``finish`` divides by the outer count once the collective is done."""
    bucket = grads.bucket
    if bucket.splits_shard:
        if grads.outer_grad is None:
            numel = bucket.main_end - bucket.main_start
            grads.outer_grad = torch.empty(numel, dtype=bucket.dtypes.main_grads, device=bucket.device)
        averaged = grads.outer_grad
        work = reduce_scatter_sum(averaged, grads.main_grad, bucket.outer.group, async_op=async_op)
    else:
        averaged = grads.main_grad
        work = all_reduce_sum(averaged, bucket.outer.group, async_op=async_op)

    def divide() -> None:
        if bucket.outer_divisor != 1:
            averaged.div_(bucket.outer_divisor)

    return PendingReduction(bucket, work, divide)
