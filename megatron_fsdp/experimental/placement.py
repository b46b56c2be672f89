"""Upstream's v2 DBuffer placements, one per mesh axis: how a :class:`~megatron_fsdp.experimental.DBuffer`
holds its logical tensors along that axis.

- ``Flat()``: the axis splits the buffer into equal contiguous ranges, rank i holding the i-th
  (whole rows of each tensor: see dbuffer.py). Flat axes must be the last axes of a placement
  list, so that each rank's local buffer is one contiguous range of the global one.
- ``Replicate()``: every rank of the axis holds the same values.
- ``Partial(reduce_op=SUM)``: every rank holds an addend; the value is their sum
  (``ReduceOp.SUM``) or mean (``ReduceOp.AVG``, floating-point buffers), taken by the next
  reduction.

These are not torch's DTensor placements: a DBuffer's per-tensor DTensors carry those (``Flat``
as ``Shard(0)``). :class:`~megatron_fsdp.experimental.Placements` also takes ``Flat()`` for
``Shard(0)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


class Placement:
    """What every DBuffer placement is an instance of."""


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank of the axis holds the whole range, the same values."""


@dataclass(frozen=True)
class Partial(Placement):
    """Every rank of the axis holds the whole range, an addend each. ``reduce_op``:
    ``torch.distributed.ReduceOp.SUM`` (default) or ``ReduceOp.AVG``."""

    reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM


@dataclass(frozen=True)
class Flat(Placement):
    """The axis's ranks hold consecutive equal ranges of the buffer, rank i the i-th."""
