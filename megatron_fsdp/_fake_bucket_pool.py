"""The bucket pool under ``FakeTensorMode``: what the C++ ``BucketPool`` is to a real tensor, this
is to a fake one (a simulated rank, megatron_fsdp.simulate), as a fake kernel is to an op.

The C++ pool lends memory by swapping a tensor's storage pointer, which a fake tensor (whose
storage is a meta storage) cannot take. This class keeps the same methods and bookkeeping
(``csrc/common/bucket_pool.h``) and makes each block it lends a fake allocation of the block's
size, so whoever watches allocations sees the pool's memory come and go as the GPU would. It
follows the pool's CUDA behaviour: without ``double_buffer`` a released block goes back to the
caching allocator (here: is dropped); with it, each key keeps persistent blocks grown to its
largest request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

# The pool's granule (kRoundBytes in bucket_pool.cpp).
ROUND_BYTES = 512

# Process-wide: called with (pool key, block) as each block is allocated, so that a memory
# tracker can name the allocation. megatron_fsdp.simulate's tracker is the one owner.
BLOCK_ALLOCATION_WATCHERS: list[Callable[[str, torch.Tensor], None]] = []


@dataclass(eq=False)
class _Block:
    memory: torch.Tensor
    nbytes: int
    lent: bool = False


def _round_up(nbytes: int) -> int:
    return (nbytes + ROUND_BYTES - 1) // ROUND_BYTES * ROUND_BYTES


def _storage_key(bucket: torch.Tensor) -> int:
    return bucket.untyped_storage()._cdata


class FakeBucketPool:
    """``BucketPool(double_buffer)`` for fake tensors made under ``mode``."""

    def __init__(self, double_buffer: bool, mode: FakeTensorMode) -> None:
        self._double_buffer = double_buffer
        self._mode = mode
        self._slots: dict[tuple[str, str], list[_Block]] = {}
        self._lent: dict[int, tuple[torch.Tensor, _Block]] = {}
        self._bytes_in_use = 0
        self._bytes_reserved = 0
        self._high_water_mark = 0

    def placeholder(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D fake tensor of ``numel`` elements that holds no memory until ``fill``: made
        outside every dispatch mode, so no tracker counts it as an allocation."""
        if numel < 0:
            raise RuntimeError(f"BucketPool.placeholder: numel must be >= 0, got {numel}")
        with _disable_current_modes():
            meta = torch.empty(numel, dtype=dtype, device="meta")
        return FakeTensor(self._mode, meta, torch.device(device))

    def _allocate(self, nbytes: int, device: torch.device, key: str) -> _Block:
        memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for watch in BLOCK_ALLOCATION_WATCHERS:
            watch(key, memory)
        self._bytes_reserved += nbytes
        return _Block(memory, nbytes)

    def _take_block(self, nbytes: int, device: torch.device, key: str) -> _Block:
        if not self._double_buffer:
            return self._allocate(nbytes, device, key)
        slots = self._slots.setdefault((key, str(device)), [])
        chosen = next((block for block in slots if not block.lent), None)
        if chosen is None:
            block = self._allocate(nbytes, device, key)
        else:
            slots.remove(chosen)
            block = chosen
            if block.nbytes < nbytes:
                self._bytes_reserved -= block.nbytes
                block = self._allocate(nbytes, device, key)
        slots.append(block)
        return block

    def fill(self, bucket: torch.Tensor, key: str) -> None:
        storage = _storage_key(bucket)
        if storage in self._lent:
            raise RuntimeError("BucketPool.fill: this bucket already holds pool memory; release() it first")
        needed = (bucket.storage_offset() + bucket.numel()) * bucket.element_size()
        block = self._take_block(_round_up(needed), bucket.device, key)
        block.lent = True
        self._lent[storage] = (bucket, block)
        self._bytes_in_use += block.nbytes
        self._high_water_mark = max(self._high_water_mark, self._bytes_in_use)

    def release(self, bucket: torch.Tensor) -> None:
        found = self._lent.pop(_storage_key(bucket), None)
        if found is None:
            raise RuntimeError("BucketPool.release: this bucket holds no pool memory (released twice, or never filled)")
        block = found[1]
        self._bytes_in_use -= block.nbytes
        block.lent = False
        if not self._double_buffer:
            self._bytes_reserved -= block.nbytes  # back to the caching allocator: the block dies here

    def fetch(self, numel: int, dtype: torch.dtype, device: torch.device, key: str) -> torch.Tensor:
        bucket = self.placeholder(numel, dtype, device)
        self.fill(bucket, key)
        return bucket

    def is_filled(self, bucket: torch.Tensor) -> bool:
        return _storage_key(bucket) in self._lent

    def bytes_in_use(self) -> int:
        return self._bytes_in_use

    def bytes_reserved(self) -> int:
        return self._bytes_reserved

    def high_water_mark(self) -> int:
        return self._high_water_mark

    def reset_high_water_mark(self) -> None:
        self._high_water_mark = self._bytes_in_use

    def empty_cache(self) -> None:
        for slots in self._slots.values():
            for block in [block for block in slots if not block.lent]:
                self._bytes_reserved -= block.nbytes
                slots.remove(block)

    def double_buffer(self) -> bool:
        return self._double_buffer

    def blocks_per_key(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for (key, _), slots in self._slots.items():
            counts[key] = counts.get(key, 0) + len(slots)
        return counts

    def move_new_blocks(self) -> int:
        """Nothing to move: a fake block has no memory of any allocator."""
        if not self._double_buffer:
            raise RuntimeError("BucketPool.move_new_blocks: only a double_buffer pool keeps persistent blocks")
        return 0
