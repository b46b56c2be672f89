"""Where every parameter lives in its bucket: offsets, padding and shard ranges.

Pure arithmetic, no tensors and no process groups. A bucket holds its parameters back to back,
each at an offset that is a multiple of ``alignment`` elements; the total is padded to a multiple
of ``world_size * alignment``, so every shard ``[r * S, (r + 1) * S)`` has the same size S and
starts aligned. A parameter may straddle shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its bucket: ``[offset, offset + numel)``."""

    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketLayout:
    slots: tuple[ParamSlot, ...]
    padded_numel: int
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The bucket elements rank ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def padding_ranges(self) -> list[tuple[int, int]]:
        """The bucket ranges ``[start, end)`` no parameter occupies (alignment gaps and the tail)."""
        gaps, cursor = [], 0
        for slot in sorted(self.slots, key=lambda s: s.offset):
            if slot.offset > cursor:
                gaps.append((cursor, slot.offset))
            cursor = max(cursor, slot.end)
        if self.padded_numel > cursor:
            gaps.append((cursor, self.padded_numel))
        return gaps

    def local_range(self, index: int, rank: int) -> tuple[int, int]:
        """The part of parameter ``index`` inside rank ``rank``'s shard, as bucket offsets
        ``[start, end)``; empty (start == end) when the shard holds none of it."""
        slot = self.slots[index]
        shard_start, shard_end = self.shard_range(rank)
        start = min(max(slot.offset, shard_start), shard_end)
        end = max(min(slot.end, shard_end), start)
        return start, end


def build_bucket_layout(numels: Sequence[int], world_size: int, alignment: int, shard_split: int = 1) -> BucketLayout:
    """Lays parameters of the given sizes out back to back at aligned offsets. ``shard_split``
    pads further so every shard splits into that many aligned pieces (HFSDP splits each shard
    across the outer group)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    slots, cursor = [], 0
    for numel in numels:
        if numel < 0:
            raise ValueError(f"a parameter cannot have {numel} elements")
        slots.append(ParamSlot(offset=cursor, numel=numel))
        cursor = _round_up(cursor + numel, alignment)
    padded = _round_up(max(cursor, 1), world_size * alignment * shard_split)
    return BucketLayout(slots=tuple(slots), padded_numel=padded, world_size=world_size)


def alignment_in_elements(alignment_bytes: int, element_size: int) -> int:
    """The element count matching ``alignment_bytes`` (at least one element)."""
    return max(1, alignment_bytes // element_size)


def rectangular_chunks(shape: Sequence[int], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements ``[start, end)`` of a row-major tensor of ``shape``, as rectangular chunks
    ``(offsets, sizes)`` in flat order: a partial first row, whole rows, a partial last row,
    each partial row split the same way one dimension down. Every chunk is also a contiguous
    flat range, so a flat piece of a parameter is written and read as a few plain blocks."""
    if start >= end:
        return []
    if len(shape) == 0:
        return [((), ())]
    row = 1
    for size in shape[1:]:
        row *= size
    rest = tuple(shape[1:])
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def within_row(index: int, lo: int, hi: int) -> None:
        for offsets, sizes in rectangular_chunks(rest, lo, hi):
            chunks.append(((index, *offsets), (1, *sizes)))

    if start % row:
        first = start // row
        within_row(first, start % row, min(end - first * row, row))
        start = (first + 1) * row
    if start < end and end // row > start // row:
        first, last = start // row, end // row
        chunks.append(((first,) + (0,) * len(rest), (last - first, *rest)))
        start = last * row
    if start < end:
        within_row(start // row, 0, end - start)
    return chunks


def flat_offset(shape: Sequence[int], offsets: Sequence[int]) -> int:
    """The row-major flat index of the element at ``offsets``."""
    flat = 0
    for size, offset in zip(shape, offsets):
        flat = flat * size + offset
    return flat
