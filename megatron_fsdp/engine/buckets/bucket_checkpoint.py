"""What a bucket shows checkpoints and inspection: the flat piece of each parameter this rank
saves and loads, the DTensor faces over those pieces, the broadcast after a load, and copies of
the whole bucket. A mixin of :class:`megatron_fsdp.engine.buckets.buffer.Bucket`, whose attributes it reads,
kept apart from the buffers' life in a training step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_fsdp.engine.groups.collectives import all_gather_shards
from megatron_fsdp.engine.params.dtensor_params import ParamExtent
from megatron_fsdp.engine.params.piece_dtensor import FlatLayout
from megatron_fsdp.engine.params.sharded_params import MeshCache, ShardedParam, shard_spec


class BucketCheckpointing:
    """Checkpoint and inspection methods of a bucket (see :class:`megatron_fsdp.engine.buckets.buffer.Bucket`)."""

    def checkpoint_source(self) -> tuple[torch.Tensor, int]:
        """What a checkpoint holds for this bucket (the main params where they exist, else the
        weights) and the bucket offset of its first element."""
        if self.requires_grad:
            return self.main_params, self.main_start
        if self.weights.shard is not None:
            return self.weights.shard, self.shard_start
        return self.weights.full, 0

    def checkpoint_pieces(self) -> list[tuple[torch.Tensor, int]]:
        """Per parameter: the flat piece of it this rank saves and loads (its part of the
        checkpoint source; replicated sources give every rank the same pieces, which DCP
        writes once) and where the piece starts in the flattened parameter."""
        source, base = self.checkpoint_source()
        pieces = []
        for index, slot in enumerate(self.layout.slots):
            lo, hi = self._piece(index, base, base + source.numel())
            pieces.append((source[lo - base : hi - base], lo - slot.offset))
        return pieces

    def add_faces(self, meshes: MeshCache) -> None:
        """Builds each parameter's DTensor face over its checkpoint piece (the main weights where
        they exist): flat-sharded unless this rank holds the whole bucket."""
        source, _ = self.checkpoint_source()
        sharded = source.numel() != self.layout.padded_numel
        self.faces = []
        for index, (extent, (piece, _)) in enumerate(zip(self.extents, self.checkpoint_pieces())):
            # A strided split's rows are not its Shard placement's: it keeps a layout that says so.
            layout = self._flat_layout(index, extent, sharded) if sharded or extent.row_blocks else None
            spec = shard_spec(extent, self.dp, layout, self.device.type, meshes)
            self.faces.append(ShardedParam(piece, spec, self.requires_grad))

    def _flat_layout(self, index: int, extent: ParamExtent, sharded: bool) -> FlatLayout:
        """Where every rank's piece of parameter ``index`` lies in its flattened local tensor:
        shard by shard, and within a shard outer rank by outer rank where HFSDP splits it (not
        ``sharded``: every rank holds the whole)."""
        slot = self.layout.slots[index]
        if not sharded:
            return FlatLayout(tuple(extent.local_shape), tuple(extent.offset), ((0, slot.numel),), 0, extent.row_blocks)
        shard = self.layout.shard_numel
        split = self.outer.size if self.splits_shard and self.requires_grad else 1
        part = shard // split
        pieces = []
        for rank in range(self.dp.size):
            for outer_rank in range(split):
                lo = max(slot.offset, rank * shard + outer_rank * part)
                hi = min(slot.end, rank * shard + (outer_rank + 1) * part)
                pieces.append((min(lo, slot.end) - slot.offset, max(hi - lo, 0)))
        return FlatLayout(
            tuple(extent.local_shape), tuple(extent.offset), tuple(pieces), 2 if split > 1 else 1, extent.row_blocks
        )

    def broadcast_from_first_replica(self) -> None:
        """Copies the checkpoint source (main params, frozen: weights) of the first rank holding
        each piece to the others holding it: all of dp for a full source, dp_outer where the
        outer group replicates it (not HFSDP's split main params). Then installs it."""
        source, _ = self.checkpoint_source()
        groups = []
        if source.numel() == self.layout.padded_numel:
            groups.append(self.dp.group)
        if self.outer is not None and not (self.splits_shard and self.requires_grad):
            groups.append(self.outer.group)
        # Offloaded main params are broadcast through a device copy (the backend may be NCCL).
        on_device = source.to(self.device)
        for group in groups:
            dist.broadcast(on_device, src=dist.get_global_rank(group, 0), group=group)
        if on_device is not source:
            source.copy_(on_device)
        self.sync_after_load()

    def sync_after_load(self) -> None:
        """After pieces were loaded in place: install the main params into the weights."""
        if self.requires_grad:
            self.weights.install()

    def gather_full(self, source: torch.Tensor) -> torch.Tensor:
        """A copy of the whole bucket of a per-rank tensor that is full, this rank's shard, or
        (HFSDP) this outer rank's piece of the shard; on the device (offloaded sources move there)."""
        source = source.to(self.device)
        if source.numel() == self.layout.padded_numel:
            return source.clone()
        if self.splits_shard and source.numel() == self.main_end - self.main_start:
            shard = torch.empty(self.layout.shard_numel, dtype=source.dtype, device=source.device)
            all_gather_shards(shard, source.contiguous(), self.outer.group)
            source = shard
        full = torch.empty(self.layout.padded_numel, dtype=source.dtype, device=source.device)
        all_gather_shards(full, source.contiguous(), self.dp.group)
        return full

    def split_full(self, full: torch.Tensor) -> list[torch.Tensor]:
        return [full[s.offset : s.end].view(shape) for s, shape in zip(self.layout.slots, self.shapes)]
