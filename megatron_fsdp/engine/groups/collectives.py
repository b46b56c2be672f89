"""The collectives FSDP needs, one call per bucket, named after what they do.

PyTorch 2.13 renamed the single-tensor collectives (``all_gather_single``); 2.11 has only the
older names, so each is picked once here.

Over a group of one rank each is a local copy (or nothing) on the current stream, returning no
work to wait for: the result is the same, and a backend call costs the host about 100 us
(a one-GPU run, or a mesh dimension of size 1, launches a few per unit and step).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_shards(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``full`` = the concatenation of every rank's ``shard``. 8-bit floats go as their bytes."""
    full, shard = _as_bytes(full), _as_bytes(shard)
    if _one_rank(group):
        return _copy_unless_same(full, shard)
    return _all_gather_single(full, shard, group=group, async_op=async_op)


def reduce_scatter_sum(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``shard`` = this rank's slice of the sum of every rank's ``full``."""
    if _one_rank(group):
        return _copy_unless_same(shard, full)
    return _reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``tensor`` = the sum of every rank's ``tensor``, in place."""
    if _one_rank(group):
        return None
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``tensor`` = the elementwise maximum of every rank's ``tensor``, in place."""
    if _one_rank(group):
        return None
    return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=async_op)


def all_to_all(received: torch.Tensor, sent: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Chunk r of ``sent`` goes to rank r; ``received`` holds every rank's chunk for this rank."""
    if _one_rank(group):
        return _copy_unless_same(received, sent)
    return dist.all_to_all_single(received, sent, group=group, async_op=async_op)


def all_to_all_uneven(
    received: torch.Tensor, sent: torch.Tensor, received_splits: list[int], sent_splits: list[int], group: dist.ProcessGroup
):
    """``sent_splits[r]`` values of ``sent`` (in rank order) go to rank r; ``received`` holds
    ``received_splits[r]`` values from each rank r, in rank order."""
    if _one_rank(group):
        return _copy_unless_same(received, sent)
    return dist.all_to_all_single(received, sent, received_splits, sent_splits, group=group)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an 8-bit float tensor (float8 weights, a frozen float8 parameter): gloo
    has no float8 type, and a gather only moves bytes. Other tensors as they are."""
    if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:
        return tensor.view(torch.uint8)
    return tensor


def _one_rank(group: dist.ProcessGroup | None) -> bool:
    return dist.get_world_size(group) == 1


def _copy_unless_same(destination: torch.Tensor, source: torch.Tensor) -> None:
    if destination.numel() != source.numel() or destination.dtype != source.dtype:
        raise ValueError(
            f"a collective over one rank got {source.numel()} {source.dtype} elements for a result of "
            f"{destination.numel()} {destination.dtype}"
        )
    if destination.data_ptr() != source.data_ptr():
        destination.copy_(source.view(destination.shape))
    return None


def wait_for(work: dist.Work | None, timeout: float | None, what: str) -> None:
    """Waits for an asynchronous collective (None: one that ran locally, nothing to wait for). A failure (``timeout`` seconds passed, the process
    group's own timeout, or a peer that died) is re-raised naming ``what``, so a hang says which
    unit and bucket a rank was missing from. The collective is still pending afterwards and the
    process group unusable: the job must restart (e.g. torchrun --max-restarts, from the last
    checkpoint). ``timeout`` bounds CPU (gloo) collectives; a CUDA (NCCL) wait only orders
    streams, and NCCL's watchdog with the process group's timeout catches a hang there."""
    if work is None:
        return
    try:
        if timeout is not None and not _finishes_within(work, timeout):
            raise RuntimeError(f"no result within collective_timeout={timeout:g} s")
        work.wait()
    except RuntimeError as error:
        raise RuntimeError(
            f"{what} did not complete: {error}. A rank is not taking part in this collective: "
            "every rank must run the same forwards and backwards with the same model and configuration; "
            "a rank may also have died. Restart the job from its last checkpoint"
        ) from error


def _finishes_within(work: dist.Work, timeout: float) -> bool:
    """Whether ``work`` completes within ``timeout`` seconds. Not every backend's Work honours
    ``wait(timeout)`` (gloo's reduce-scatter blocks regardless), so a helper thread waits and
    this one stops waiting for it; the caller's own ``wait()`` then returns at once or raises."""
    waiter = threading.Thread(target=_wait_ignoring_errors, args=(work,), name="megatron_fsdp-wait", daemon=True)
    waiter.start()
    waiter.join(timeout)
    return not waiter.is_alive()


def _wait_ignoring_errors(work: dist.Work) -> None:
    try:
        work.wait()
    except RuntimeError:
        pass  # the caller's wait() raises it again, on its own thread
