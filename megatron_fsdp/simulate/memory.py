"""The memory a simulated rank allocates, read from its fake tensors as they are made and freed.

Every op under the simulation is shown to :class:`AllocationLog` (by the dispatch mode above
``FakeTensorMode``, observer.py): an output whose schema does not alias an input owns a new storage, whose
size is logged, and a finaliser on that storage logs its end. The bucket pool's blocks are fake
allocations too (megatron_fsdp/_fake_bucket_pool.py) and carry their pool key. Nothing holds
memory, so the log is the whole record: the live bytes at every moment, their peak and what was
live at the peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from megatron_fsdp._fake_bucket_pool import BLOCK_ALLOCATION_WATCHERS
from megatron_fsdp.engine.params.dtensor_params import local_tensor

# The dispatcher's namespaces of torch.distributed's collectives.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")

# The label of a block the bucket pool lends: "pool <key>", the key "<purpose>/<role>".
POOL_LABEL = "pool "


@dataclass
class Allocation:
    """One storage: its bytes, what made it (an op, or the pool key), in which phase, and the
    log positions of its birth and death (None while alive)."""

    nbytes: int
    label: str
    phase: str
    born: int
    died: int | None = None

    def live_at(self, position: int) -> bool:
        return self.born <= position and (self.died is None or position < self.died)


class AllocationLog:
    """Logs every storage the ops it observes create and free. ``phase`` names the part of the
    step running (set by :meth:`start_phase`); ``peak(phase)`` is the largest live total seen in it."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.allocations: list[Allocation] = []
        self._live: dict[int, Allocation] = {}
        self._position = 0
        self.live_bytes = 0
        # phase -> (peak live bytes, log position of the peak)
        self._peaks: dict[str, tuple[int, int]] = {}

    @contextmanager
    def naming_pool_blocks(self) -> Iterator[None]:
        """While inside, the bucket pool's blocks are labelled with their pool key."""
        BLOCK_ALLOCATION_WATCHERS.append(self._name_pool_block)
        try:
            yield
        finally:
            BLOCK_ALLOCATION_WATCHERS.remove(self._name_pool_block)

    def observe(self, func, args: tuple, kwargs: dict, out) -> None:
        """After ``func(*args, **kwargs)`` returned ``out``: notes the storages it created. An op
        on DTensors is seen whole (the dispatch mode runs before DTensor), and its local op, which
        makes the memory, is not seen at all: its output's storage is the local tensor's (a DTensor's
        own is a wrapper of the global size, gone as soon as tensor parallelism's ``to_local``
        drops it, while the local output may be kept for backward)."""
        if func is torch.ops.aten.lift_fresh.default:
            # torch.tensor(data): the data was made outside dispatch; its fake is a new storage.
            self._note(out.untyped_storage(), "tensor")
            return
        if any(ret.alias_info is not None for ret in func._schema.returns):
            return
        inputs: set[int] = set()
        if func.namespace in COLLECTIVE_NAMESPACES:
            # Collectives return their (un-annotated) output argument: an input's storage is no new one.
            inputs = {local_tensor(t).untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue  # a meta tensor (a DTensor spec's stand-in, say) holds no memory
            if local_tensor(tensor).untyped_storage()._cdata not in inputs:
                self._note(local_tensor(tensor).untyped_storage(), func.__name__)

    def _note(self, storage: torch.UntypedStorage, label: str) -> None:
        key = storage._cdata
        if key in self._live:
            return
        self._position += 1
        allocation = Allocation(storage.nbytes(), label, self.phase, self._position)
        self._live[key] = allocation
        self.allocations.append(allocation)
        self.live_bytes += allocation.nbytes
        peak = self._peaks.get(self.phase)
        if peak is None or self.live_bytes > peak[0]:
            self._peaks[self.phase] = (self.live_bytes, self._position)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        allocation = self._live.pop(key, None)
        if allocation is None:
            return
        self._position += 1
        allocation.died = self._position
        self.live_bytes -= allocation.nbytes

    def _name_pool_block(self, pool_key: str, block: torch.Tensor) -> None:
        allocation = self._live.get(block.untyped_storage()._cdata)
        if allocation is not None:
            allocation.label = POOL_LABEL + pool_key

    def start_phase(self, phase: str) -> None:
        """From now on allocations belong to ``phase``, whose peak starts at the live bytes now."""
        self.phase = phase
        self._peaks[phase] = (self.live_bytes, self._position)

    def peak(self, phase: str) -> int:
        return self._peaks[phase][0]

    def live_at_peak(self, phases: Iterable[str]) -> tuple[int, list[Allocation]]:
        """The largest peak among ``phases`` (those that ran) and the allocations live at it."""
        nbytes, position = max(self._peaks[phase] for phase in phases if phase in self._peaks)
        return nbytes, [a for a in self.allocations if a.live_at(position)]

    def live(self) -> dict[int, Allocation]:
        return dict(self._live)
