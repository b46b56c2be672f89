"""The one dispatch mode of a simulation: sits above ``FakeTensorMode``, runs each op and shows
it with its result to the allocation log, the collective log and the compute log. One mode for
all, since every mode on the stack costs each op a round through Python."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode

from megatron_fsdp.simulate.compute import ComputeLog
from megatron_fsdp.simulate.memory import AllocationLog
from megatron_fsdp.simulate.traffic import CollectiveLog


class StepObserver(TorchDispatchMode):
    """Shows every op to ``memory``, ``traffic`` and ``compute``; ``start_phase`` names what runs
    next. ``memory`` None: collectives and compute only (torch's FSDP2, whose memory
    FSDPMemTracker reads: torch_fsdp2.py)."""

    def __init__(self, memory: AllocationLog | None, traffic: CollectiveLog, compute: ComputeLog) -> None:
        super().__init__()
        self.memory = memory
        self.traffic = traffic
        self.compute = compute

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.memory is not None:
            self.memory.observe(func, args, kwargs, out)
        self.traffic.observe(func, args, kwargs, out)
        self.compute.observe(func, args, kwargs, out)
        return out

    def start_phase(self, phase: str) -> None:
        if self.memory is not None:
            self.memory.start_phase(phase)
        self.traffic.phase = phase
        self.compute.start_phase(phase)

    @contextmanager
    def recording_apart(self) -> Iterator[tuple[CollectiveLog, ComputeLog]]:
        """Inside, collectives and compute go to fresh logs (yielded), memory to the same log: a
        later step recorded beside the first, whose records stay those of one step."""
        kept = self.traffic, self.compute
        self.traffic, self.compute = CollectiveLog(), ComputeLog()
        try:
            yield self.traffic, self.compute
        finally:
            self.traffic, self.compute = kept

    @contextmanager
    def observing(self) -> Iterator[StepObserver]:
        if self.memory is None:
            with self:
                yield self
            return
        with self.memory.naming_pool_blocks(), self:
            yield self
