"""CPU offloading: each offloaded bucket's host side and the copies between it and the device.

An offloaded bucket keeps its main parameters (what the optimizer steps, in the main-parameter
dtype) and the gradients the optimizer reads in host memory; its compute weights and every
gathered or reduced buffer stay on the device. What moves when (docs/offloading.md):

- gradients, device to host: once a bucket's gradients are fully reduced, on the model's
  offload stream, overlapping the rest of backward; the device gradients are released as soon
  as the copy has read them, and a later micro-batch's gradients are added to the host ones
  (through one of two pinned landing buffers); the host waits for them only when it reads them
  (when the gradient sync shows them as ``.grad``);
- weights, host to device: cast on the host into one of two pinned staging buffers of the
  compute dtype (half the bytes of fp32 for bf16) and copied into the bucket's compute-weight
  range on the offload stream; the device waits for them only where it reads that range (the
  unit's next all-gather). The host optimizer op writes them into the staging buffer as it steps
  the bucket (``stage_weights``, then ``send_staged_weights``); any other step is followed by a
  cast of the main parameters (``send_weights``).

The host gradients and the two landing buffers (the copy engine writes them) and the two
staging buffers (it reads them) are pinned; the main parameters are ordinary host memory that
no copy touches, so the host may rewrite them (the optimizer step, a checkpoint load) at any
time. On a CPU device the same calls copy synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class OffloadTransfers:
    """One model's offload stream and its two staging buffers per compute dtype (each as large
    as the largest bucket range sent so far), taken in turn: casting the next bucket overlaps
    the copy of the one before."""

    SLOTS = 2

    def __init__(self, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.pin_memory = pin_memory and self.on_cuda
        self.stream = torch.cuda.Stream(device) if self.on_cuda else None
        self._staging: dict[torch.dtype, list[torch.Tensor | None]] = {}
        self._staging_copied: dict[torch.dtype, list[torch.cuda.Event | None]] = {}
        self._next: dict[torch.dtype, int] = {}
        # Landing buffers of gradients added to host gradients that already hold some: each slot
        # with the bucket whose addition from it is still due.
        self._landing: list[torch.Tensor | None] = [None] * self.SLOTS
        self._landing_owner: list[HostBuffers | None] = [None] * self.SLOTS
        self._next_landing = 0

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory the copy engine reads or writes: pinned when asked for (and on a GPU)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory)

    def staging(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """The next staging buffer (its first ``numel`` elements) and its slot, once the copy that
        last read it has landed."""
        buffers = self._staging.setdefault(dtype, [None] * self.SLOTS)
        events = self._staging_copied.setdefault(dtype, [None] * self.SLOTS)
        slot = self._next.get(dtype, 0)
        self._next[dtype] = (slot + 1) % self.SLOTS
        if events[slot] is not None:
            events[slot].synchronize()
            events[slot] = None
        if buffers[slot] is None or buffers[slot].numel() < numel:
            buffers[slot] = self.host_empty(numel, dtype)
        return buffers[slot][:numel], slot

    def staging_sent(self, dtype: torch.dtype, slot: int, copied: torch.cuda.Event) -> None:
        self._staging_copied[dtype][slot] = copied

    def landing(self, numel: int, dtype: torch.dtype, owner: HostBuffers) -> torch.Tensor:
        """The next landing buffer (its first ``numel`` elements) for ``owner``'s incoming
        gradients, once the bucket that used it last has added what landed there."""
        slot = self._next_landing
        self._next_landing = (slot + 1) % self.SLOTS
        previous = self._landing_owner[slot]
        if previous is not None:
            previous.settle_grads()
        buffer = self._landing[slot]
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = self._landing[slot] = self.host_empty(numel, dtype)
        self._landing_owner[slot] = owner
        return buffer[:numel]

    def landed(self, owner: HostBuffers) -> None:
        """``owner`` has added what landed for it: its slot is free."""
        self._landing_owner = [None if o is owner else o for o in self._landing_owner]

    @property
    def staging_bytes(self) -> int:
        buffers = [b for slots in self._staging.values() for b in slots] + self._landing
        return sum(b.numel() * b.element_size() for b in buffers if b is not None)


@dataclass(frozen=True)
class StagedWeights:
    """Host memory for one bucket range's new weights, in the compute dtype: ``buffer``, to be
    filled with the main parameters cast, then sent into ``target`` on the device."""

    buffer: torch.Tensor
    target: torch.Tensor
    # The staging slot ``buffer`` belongs to; None on a CPU device, where ``buffer`` is ``target``.
    slot: int | None


class HostBuffers:
    """The host side of one bucket's optimizer range: main parameters and the gradients the
    optimizer reads, and the events of the copies in flight."""

    def __init__(self, device_values: torch.Tensor, main_dtype: torch.dtype, transfers: OffloadTransfers) -> None:
        """``device_values``: the range's current weights on the device (copied once, now)."""
        self.transfers = transfers
        self.device = device_values.device
        self.main_params = device_values.to("cpu", main_dtype, copy=True)
        self._grads: torch.Tensor | None = None
        # Whether the host gradients hold what was sent since they were last cleared, and the
        # landing buffer of a sent part still to be added to them.
        self.holds_grads = False
        self._incoming: torch.Tensor | None = None
        # Recorded on the offload stream after each launched copy (CUDA only).
        self._grads_copied: torch.cuda.Event | None = None
        self._weights_copied: torch.cuda.Event | None = None

    @property
    def host_bytes(self) -> int:
        """Host bytes held: main parameters and gradients (not the optimizer state)."""
        held = (self.main_params, self._grads)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    # -- gradients: device -> host ---------------------------------------------------------------

    def send_grads(self, source: torch.Tensor) -> None:
        """Launches the copy of the device gradients reduced since the last send (cast to the
        main-parameter dtype on the device first, where they differ) to the host, where they are
        added to the gradients held, or become them. ``source`` may be released right after."""
        if self._grads is None:
            self._grads = self.transfers.host_empty(self.main_params.numel(), self.main_params.dtype)
        accumulate, self.holds_grads = self.holds_grads, True
        stream = self.transfers.stream
        if stream is None:
            self._grads.add_(source) if accumulate else self._grads.copy_(source)
            return
        self.settle_grads()  # the part sent before is added first
        target = self.transfers.landing(self._grads.numel(), self._grads.dtype, self) if accumulate else self._grads
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the reduction wrote source there
        with torch.cuda.stream(stream):
            sent = source if source.dtype == target.dtype else source.to(target.dtype)
            target.copy_(sent, non_blocking=True)
            self._grads_copied = torch.cuda.Event()
            self._grads_copied.record(stream)
        # The caller releases source on its own stream while the copy may still read it.
        source.record_stream(stream)
        if accumulate:
            self._incoming = target

    def settle_grads(self) -> None:
        """Waits for the last copy to land (a host wait) and adds what landed in a landing buffer."""
        if self._grads_copied is not None:
            self._grads_copied.synchronize()
            self._grads_copied = None
        if self._incoming is not None:
            self._grads.add_(self._incoming)
            self._incoming = None
            self.transfers.landed(self)

    def grads(self) -> torch.Tensor | None:
        """The host gradients, complete (None when none were sent since they were cleared)."""
        self.settle_grads()
        return self._grads if self.holds_grads else None

    def clear_grads(self) -> None:
        """Forgets the host gradients (``zero_grad(set_to_none=True)``); their memory is kept for
        the next send, which a copy still in flight precedes on the offload stream."""
        self.settle_grads()
        self.holds_grads = False

    # -- weights: host -> device -----------------------------------------------------------------

    def send_weights(self, target: torch.Tensor) -> None:
        """Launches the copy of the main parameters, in ``target``'s dtype, into ``target`` (the
        compute-weight range on the device): cast into a staging buffer first."""
        staged = self.stage_weights(target)
        staged.buffer.copy_(self.main_params)
        self.send_staged_weights(staged)

    def stage_weights(self, target: torch.Tensor) -> StagedWeights:
        """Host memory for ``target``'s new weights, of its dtype and size: the next staging
        buffer, once the copy that last read it has landed; on a CPU device ``target`` itself (the
        weights are then written in place, and sending copies nothing)."""
        if self.transfers.stream is None:
            return StagedWeights(buffer=target, target=target, slot=None)
        buffer, slot = self.transfers.staging(target.numel(), target.dtype)
        return StagedWeights(buffer=buffer, target=target, slot=slot)

    def send_staged_weights(self, staged: StagedWeights) -> None:
        """Launches the copy of ``staged.buffer``, filled with every main parameter cast, into
        its target."""
        stream = self.transfers.stream
        if stream is None:
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))  # work queued there may read target
        with torch.cuda.stream(stream):
            staged.target.copy_(staged.buffer, non_blocking=True)
            self._weights_copied = torch.cuda.Event()
            self._weights_copied.record(stream)
        self.transfers.staging_sent(staged.target.dtype, staged.slot, self._weights_copied)

    def before_device_reads_weights(self) -> None:
        """The current stream is about to read the compute weights: the copy into them goes first
        (a wait on the device; the host goes on)."""
        if self._weights_copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._weights_copied)
