"""Where each DTensor face's values sit in its bucket, and per-element values (optimizer state,
a loaded parameter) brought to a face's layout: what the optimizer's step, FSDP2's state-dict
hooks and checkpoint loading share while training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.params.dtensor_params import ParamExtent
from megatron_fsdp.engine.params.sharded_params import ShardSpec, sharded_dtensor


@dataclass(frozen=True)
class FaceSource:
    """Where a face's values sit in the parameter: its piece (what the optimizer steps), where
    the piece starts in this rank's flattened region, that region (``extent``) and the spec."""

    piece: torch.Tensor
    start: int
    extent: ParamExtent
    spec: ShardSpec


def bucket_face_sources(bucket: Bucket) -> list[FaceSource]:
    """The :class:`FaceSource` of each of ``bucket``'s parameters, in order."""
    return [
        FaceSource(piece, start, extent, sharded.spec)
        for (piece, start), extent, sharded in zip(bucket.checkpoint_pieces(), bucket.extents, bucket.faces)
    ]


def to_face_layout(value: Any, source: FaceSource, what: str) -> Any:
    """A per-element optimizer-state entry as a DTensor laid out like the face (its own storage
    when it already is one, e.g. filled in place by ``dcp.load``); from a full tensor or a
    DTensor of another layout (gathered on every rank: the decision reads metadata only).
    Entries that are not per-element tensors (a step count) stay as they are."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if isinstance(value, DTensor) and holds_this_piece(value, source.spec):
        return value
    if tuple(value.shape) != tuple(source.spec.global_shape):
        raise ValueError(
            f"optimizer state {what} has shape {tuple(value.shape)}, not the parameter's {tuple(source.spec.global_shape)}: "
            "megatron_fsdp shards elementwise optimizers, whose per-element state has the parameter's shape"
        )
    local = local_piece(value, source.piece, source.start, source.extent, source.spec)
    return sharded_dtensor(local.to(source.piece.device, copy=True), source.spec)


def holds_this_piece(value: DTensor, spec: ShardSpec) -> bool:
    """Whether ``value``'s local tensor is this rank's piece as ``spec`` places it (our own state
    dict, filled by ``dcp.load``, or a copy of it). Decided from metadata alone, so every rank
    decides alike and either none gathers the full tensor or all do."""
    return (
        value.device_mesh == spec.mesh
        and tuple(value.placements) == spec.placements
        and value.shape == spec.global_shape
        and getattr(value, "_flat_layout", None) == spec.layout
    )


def local_piece(value: Any, piece: torch.Tensor, start: int, extent: ParamExtent, spec: ShardSpec) -> Any:
    """This rank's piece of a parameter or a per-element state entry: from a DTensor holding it
    (no communication), else from the full tensor (a DTensor of another layout is gathered, on
    every rank); other entries (a step count) as they are."""
    if isinstance(value, DTensor):
        with torch.no_grad():
            if holds_this_piece(value, spec):
                return value.to_local().reshape(piece.shape)
            if value.device.type != value.device_mesh.device_type:
                # A host copy (torch's broadcast with cpu_offload=True) gathers on the mesh's
                # device: NCCL has no CPU tensors.
                value = value.to(value.device_mesh.device_type)
            value = value.full_tensor()
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return extent.local_region(value).reshape(-1)[start : start + piece.numel()]
    return value
