"""CPU offloading: one bucket's host side and the copies between it and the device.

An offloaded bucket keeps its main parameters (what the optimizer steps, in the main-parameter
dtype) and the gradients the optimizer reads in host memory; its compute weights and every
gathered or reduced buffer stay on the device. What moves when (docs/offloading.md):

- gradients, device to host: once a bucket's gradients are fully reduced, on the offload side
  stream, overlapping the rest of backward; the host waits for them only when it reads them
  (when the gradient sync shows them as ``.grad``);
- weights, host to device: after the host step of the bucket, cast on the host into a staging
  buffer of the compute dtype (half the bytes of fp32 for bf16) and copied into the bucket's
  compute-weight shard on the side stream; the device waits for them only where it reads that
  shard (the unit's next all-gather).

Only the two buffers the copy engine reads or writes are pinned; the main parameters are
ordinary host memory, which no copy touches, so the host may rewrite them (the optimizer step,
a checkpoint load) at any time. On a CPU device the same calls copy synchronously.
"""

from __future__ import annotations

import torch

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One offload stream per device, shared by every bucket: copies run in launch order."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class HostBuffers:
    """The host side of one bucket's optimizer range: main parameters, the gradients the
    optimizer reads, and the pinned staging buffer the new compute weights leave from."""

    def __init__(self, device_values: torch.Tensor, main_dtype: torch.dtype, pin_memory: bool) -> None:
        """``device_values``: the range's current weights on the device (copied once, now)."""
        self.device = device_values.device
        self.on_cuda = self.device.type == "cuda"
        self.pin_memory = pin_memory and self.on_cuda
        self.compute_dtype = device_values.dtype
        self.main_params = device_values.to("cpu", main_dtype, copy=True)
        self._grads: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        # Recorded on the side stream after each launched copy (CUDA only).
        self._grads_copied: torch.cuda.Event | None = None
        self._weights_copied: torch.cuda.Event | None = None

    def _host_empty(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self.main_params.numel(), dtype=dtype, pin_memory=self.pin_memory)

    @property
    def host_bytes(self) -> int:
        """Host bytes held: main parameters, gradients and staging (not the optimizer state)."""
        held = (self.main_params, self._grads, self._staging)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    # -- gradients: device -> host ---------------------------------------------------------------

    def send_grads(self, source: torch.Tensor) -> None:
        """Launches the copy of the fully reduced device gradients into the host gradients (cast
        to the main-parameter dtype on the device first, where they differ)."""
        if self._grads is None:
            self._grads = self._host_empty(self.main_params.dtype)
        if not self.on_cuda:
            self._grads.copy_(source)
            return
        stream = _side_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the reduction wrote source there
        with torch.cuda.stream(stream):
            sent = source if source.dtype == self._grads.dtype else source.to(self._grads.dtype)
            self._grads.copy_(sent, non_blocking=True)
            self._grads_copied = torch.cuda.Event()
            self._grads_copied.record(stream)
        # The main gradient may be released on its own stream while the copy still reads it.
        source.record_stream(stream)

    def grads(self) -> torch.Tensor:
        """The host gradients, once the last copy into them has landed (a host wait)."""
        if self._grads_copied is not None:
            self._grads_copied.synchronize()
            self._grads_copied = None
        return self._grads

    def before_device_grads_change(self) -> None:
        """The device gradients are about to be written: a copy still reading them goes first."""
        if self._grads_copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._grads_copied)

    # -- weights: host -> device -----------------------------------------------------------------

    def send_weights(self, target: torch.Tensor) -> None:
        """Launches the copy of the main parameters, in ``target``'s dtype, into ``target`` (the
        compute-weight range on the device)."""
        if not self.on_cuda:
            target.copy_(self.main_params)
            return
        if self._staging is None:
            self._staging = self._host_empty(target.dtype)
        elif self._weights_copied is not None:
            self._weights_copied.synchronize()  # the last copy out of the staging buffer is done
        self._staging.copy_(self.main_params)
        stream = _side_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # work queued there may read target
        with torch.cuda.stream(stream):
            target.copy_(self._staging, non_blocking=True)
            self._weights_copied = torch.cuda.Event()
            self._weights_copied.record(stream)

    def before_device_reads_weights(self) -> None:
        """The current stream is about to read the compute weights: the copy into them goes first
        (a wait on the device; the host goes on)."""
        if self._weights_copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._weights_copied)
