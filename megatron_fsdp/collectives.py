"""The collectives FSDP needs, one call per bucket, named after what they do.

PyTorch 2.13 renamed the single-tensor collectives (``all_gather_single``); 2.11 has only the
older names, so each is picked once here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_shards(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``full`` = the concatenation of every rank's ``shard``."""
    return _all_gather_single(full, shard, group=group, async_op=async_op)


def reduce_scatter_sum(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``shard`` = this rank's slice of the sum of every rank's ``full``."""
    return _reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``tensor`` = the sum of every rank's ``tensor``, in place."""
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_to_all(received: torch.Tensor, sent: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Chunk r of ``sent`` goes to rank r; ``received`` holds every rank's chunk for this rank."""
    return dist.all_to_all_single(received, sent, group=group, async_op=async_op)
