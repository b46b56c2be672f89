"""A bucket's gradients through a step (the transitions bucket_state.py names): each
parameter's ``.grad`` noted and taken into a pooled un-reduced buffer, reduced once per bucket
and added into the main gradient (sharded for strategies 1..3), averaged over the outer
replicas (HSDP: launched during backward, waited for by whatever reads or changes the
gradients next), offloaded, zeroed, and shown to the optimizer's pieces and the faces.

The bucket (buffer.py) owns this object, the main params and the pieces the optimizer steps.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_fsdp import _ops
from megatron_fsdp.engine.buckets.bucket_state import GradsState
from megatron_fsdp.engine.buckets.grad_reduction import (
    PendingReduction,
    launch_outer_average,
    launch_reduction,
    new_unreduced_buffer,
)
from megatron_fsdp.engine.groups.collectives import wait_for
from megatron_fsdp.engine.params.dtensor_params import local_grad
from megatron_fsdp.engine.params.piece_dtensor import plain_attribute_access

if TYPE_CHECKING:
    from megatron_fsdp.engine.buckets.buffer import Bucket


class BucketGrads:
    """The gradients of ``bucket``: ``unreduced_grad`` (pooled, this backward's), ``main_grad``
    (reduced over the shard group), ``outer_grad`` (HFSDP: reduced over the outer group too) and
    ``optimizer_grads`` (what the optimizer's pieces and the faces show)."""

    def __init__(self, bucket: Bucket, report_nonfinite: bool) -> None:
        self.bucket = bucket
        params = bucket.params
        self.state = GradsState(bucket.name, len(params))
        self.unreduced_grad: torch.Tensor | None = None
        # Parameters whose gradient the un-reduced buffer holds: a parameter's first gradient is
        # copied in, later ones (micro-batches accumulated locally) added, so a fresh buffer
        # needs no zeroing pass; only its padding is zeroed, as one multi-tensor op over its gaps
        # (kept as ranges: an index of every padding element grows with the world size).
        self.grads_written = [False] * len(params)
        gaps = bucket.layout.padding_ranges()
        self.padding_offsets = [lo for lo, _ in gaps]
        self.padding_shapes = [torch.Size([hi - lo]) for lo, hi in gaps]
        # One flag per parameter, set on the device when a local gradient holds NaN/Inf.
        self.nonfinite_flags = torch.zeros(len(params), dtype=torch.bool, device=bucket.device) if report_nonfinite else None
        self.grad_start, self.grad_end = bucket.geometry.grad_range
        # Reduced over the shard group, then averaged over the outer one: in place (HSDP) or into
        # outer_grad (HFSDP). Both exist from the first reduction after zero_grad(set_to_none=True)
        # until the next one, as torch's .grad: forward, which holds the activations, runs without
        # them. Offloaded, only until they are sent to the host, which accumulates from then on.
        self.main_grad: torch.Tensor | None = None
        self.outer_grad: torch.Tensor | None = None
        # The dp_outer average launched during backward and not waited for yet: it writes the
        # gradients, so everything that reads or changes them waits for it first.
        self.outer_average: PendingReduction | None = None
        # What the optimizer reads, shown once per change: the fully reduced gradients in the
        # main-parameter dtype (themselves when the dtypes agree or read_main_grads_as_they_are).
        self.optimizer_grads: torch.Tensor | None = None
        self.optimizer_reads_main_grads = False

    # -- one backward -------------------------------------------------------------------------

    def note_grad(self, index: int) -> bool:
        """Parameter ``index``'s ``.grad`` holds a new gradient (torch adds a second one of the
        same backward into it); True once every parameter of the bucket has delivered one in this
        backward, the moment to :meth:`take`."""
        return self.state.note_grad(index)

    def take(self) -> None:
        """Moves the gradients the parameters' ``.grad`` hold into the un-reduced buffer and
        releases them: a parameter's first gradient is copied in, later ones (micro-batches
        accumulated locally) added, each as one multi-tensor op for the bucket. Per parameter,
        the host's launch would cost more than the GPU's copy of a bucket."""
        held = self.state.held
        if not held:
            return
        bucket = self.bucket
        targets = _ops.param_views(self._grad_buffer(), bucket.offsets, bucket.shapes)
        grads, copy_to, copy_from, add_to, add_from = [], [], [], [], []
        for index in held:
            grad = local_grad(bucket.params[index])
            grads.append(grad)
            if self.grads_written[index]:
                add_to.append(targets[index])
                add_from.append(grad)
            else:
                copy_to.append(targets[index])
                copy_from.append(grad)
                self.grads_written[index] = True
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)
        if add_to:
            torch._foreach_add_(add_to, add_from)
        if self.nonfinite_flags is not None:
            rows = torch.tensor(held, device=bucket.device)
            self.nonfinite_flags[rows] = self.nonfinite_flags[rows].logical_or(_ops.find_non_finite(grads))
        for index in held:
            bucket.params[index].grad = None
        self.state.forget_held()

    def _grad_buffer(self) -> torch.Tensor:
        """The un-reduced buffer the gradients go into, set up by the first take since the last
        reduction; only its padding is zeroed, unless it holds earlier micro-batches."""
        if self.unreduced_grad is None:
            self.unreduced_grad, holds_earlier = new_unreduced_buffer(self)
            self.grads_written = [holds_earlier] * len(self.bucket.params)
            if not holds_earlier and self.padding_offsets:
                torch._foreach_zero_(_ops.param_views(self.unreduced_grad, self.padding_offsets, self.padding_shapes))
        return self.unreduced_grad

    def end_backward(self) -> None:
        self.state.end_backward()

    def drop_unreduced(self) -> None:
        """After a backward that raised: forgets the gradients not yet reduced, those the
        parameters' ``.grad`` hold and the un-reduced buffer (with it, micro-batches that
        strategies 0/1 accumulated locally)."""
        with plain_attribute_access():
            for param in self.bucket.params:
                param.grad = None
        self.state.forget_held()
        if self.unreduced_grad is not None and self.unreduced_grad is not self.main_grad:
            self.bucket.pool.release(self.unreduced_grad)
        self.unreduced_grad = None
        if self.nonfinite_flags is not None:
            self.nonfinite_flags.zero_()

    # -- reductions ---------------------------------------------------------------------------

    def start_reduction(self, async_op: bool) -> PendingReduction:
        """Launches the reduction of the un-reduced buffer (grad_reduction.py)."""
        bucket = self.bucket
        unreduced, self.unreduced_grad = self.unreduced_grad, None
        if unreduced is None:
            raise RuntimeError(f"{self.state.name}: a reduction was started with no gradient taken since the last one")
        for index, written in enumerate(self.grads_written):
            if not written:  # no gradient this backward: it contributes zeros
                slot = bucket.layout.slots[index]
                unreduced[slot.offset : slot.end].zero_()
        return launch_reduction(self, unreduced, async_op)

    def main_grad_to_write(self) -> tuple[torch.Tensor, bool]:
        """The main gradient, and whether it is fresh: created (uninitialised) by the first
        reduction since it was released, which writes it instead of adding to zeros."""
        self.finish_outer_average()
        self.state.grads_changing()
        if self.main_grad is None:
            dtype, device = self.bucket.dtypes.main_grads, self.bucket.device
            self.main_grad = torch.empty(self.grad_end - self.grad_start, dtype=dtype, device=device)
            return self.main_grad, True
        return self.main_grad, False

    def accumulate(self, reduced: torch.Tensor, scale: float) -> None:
        main_grad, fresh = self.main_grad_to_write()
        if fresh:
            torch.mul(reduced, scale, out=main_grad)
        else:
            main_grad.add_(reduced, alpha=scale)

    def finish_reduction(self, pending: PendingReduction) -> None:
        bucket = self.bucket
        if pending.work is not None:
            what = f"the gradient reduction of the {self.state.name} ({len(bucket.names)} parameters)"
            wait_for(pending.work, bucket.collective_timeout, what, bucket.dp.group, bucket.device)
        pending.finish()
        self.state.reduction_finished(bucket.outer is not None)

    def start_outer_average(self, async_op: bool) -> None:
        """HSDP: launches the average over the outer group of the shard-group-reduced gradients,
        when one is due (:meth:`finish_outer_average` waits for it). Averaging again later is
        harmless: the part already averaged is equal on every outer rank."""
        if not self.state.outer_sync_due:
            return
        self.state.grads_changing()
        self.outer_average = launch_outer_average(self, async_op)
        self.state.outer_launched()
        if not async_op:
            self.finish_outer_average()

    def finish_outer_average(self) -> None:
        """Waits for the outer average in flight, if any, and divides by the outer count."""
        pending, self.outer_average = self.outer_average, None
        if pending is None:
            return
        bucket = self.bucket
        if pending.work is not None:
            what = f"the dp_outer average of the {self.state.name} ({len(bucket.names)} parameters)"
            wait_for(pending.work, bucket.collective_timeout, what, bucket.outer.group, bucket.device)
        pending.finish()
        self.state.outer_synced()

    def optimizer_source(self) -> torch.Tensor | None:
        """The fully reduced gradients of the range the optimizer steps; None when no gradient
        was reduced since they were released."""
        self.finish_outer_average()
        return self.outer_grad if self.bucket.splits_shard else self.main_grad

    # -- reduced gradients --------------------------------------------------------------------

    def zero(self, set_to_none: bool = True) -> None:
        """Releases the main gradients (``set_to_none``) or zeroes them in place, and with them
        what the optimizer's pieces and the parameters' faces show."""
        bucket = self.bucket
        self.finish_outer_average()
        if set_to_none:
            self.main_grad = self.outer_grad = self.optimizer_grads = None
            self.state.outer_dropped()
            if bucket.host is not None:
                bucket.host.clear_grads()
            self._point_pieces()
        else:
            for grad in self._held():
                grad.zero_()

    def zero_of(self, params: Collection[nn.Parameter]) -> None:
        """Zeroes in place the main gradients of those of the bucket's faces that are in
        ``params``, in every copy this object holds; its other faces' stay (an optimizer over part
        of the model clears its own, optim/grad_release.py). The main gradient covers the
        gradient range; the outer one, the optimizer's copy and the host's the main range (under
        HFSDP a part of it)."""
        bucket = self.bucket
        self.finish_outer_average()
        indices = [index for index, face in enumerate(bucket.faces) if face.param in params]
        zeroed: set[int] = set()
        if self.main_grad is not None:
            for lo, hi in (bucket.geometry.piece(index, self.grad_start, self.grad_end) for index in indices):
                self.main_grad[lo - self.grad_start : hi - self.grad_start].zero_()
            zeroed.add(id(self.main_grad))
        for grad in self._held():
            if id(grad) not in zeroed:
                for lo, hi in (bucket.optim_ranges[index] for index in indices):
                    grad[lo:hi].zero_()

    def scale(self, factor: float) -> None:
        """Multiplies every gradient this object holds by ``factor``: held back un-reduced, the
        main gradient, the outer-reduced one, the optimizer's cast copy and the host's (each
        once)."""
        for grad in self._held(include_unreduced=True):
            grad.mul_(factor)

    def _held(self, include_unreduced: bool = False) -> list[torch.Tensor]:
        """Every distinct gradient tensor held; offloaded, the host's complete (a copy in flight
        to them has landed, or it would carry a change twice or not at all)."""
        self.finish_outer_average()
        held = [self.unreduced_grad] if include_unreduced else []
        held += [self.main_grad, self.outer_grad, self.optimizer_grads]
        if self.bucket.host is not None:
            held.append(self.bucket.host.grads())
        return list({id(g): g for g in held if g is not None}.values())

    def offload(self) -> None:
        """Offloaded: launches the copy of the fully reduced device gradients to the host and
        releases them (the host adds later ones to what it holds); the gradient sync waits for
        the copy. Not while an outer (HSDP) average is due or in flight (backward goes on; the
        sync sends them once averaged)."""
        host = self.bucket.host
        if host is None or self.state.outer_sync_due or self.state.outer_in_flight:
            return
        source = self.optimizer_source()
        # Reduced in place (a shard group of one), the main gradient is also the un-reduced
        # buffer while micro-batches accumulate without sync: not reduced yet, it stays.
        if source is None or source is self.unreduced_grad:
            return
        host.send_grads(source)
        self.main_grad = self.outer_grad = None

    # -- what the optimizer reads -------------------------------------------------------------

    def read_main_grads_as_they_are(self) -> None:
        """The optimizer steps with kernels that upcast the gradient in registers: show it the
        main gradients in their own dtype (bf16 under fp32 main params) instead of a copy in the
        main-parameter dtype, held from backward to zero_grad. The pieces' and faces' ``.grad``
        may then differ in dtype from the parameter (torch's ``grad_dtype = None``)."""
        self.optimizer_reads_main_grads = True
        self.state.grads_changing()
        with plain_attribute_access():
            for optim_param, face in zip(self.bucket.optim_params, self.bucket.faces):
                optim_param.grad_dtype = None
                face.param.grad_dtype = None

    def show(self) -> None:
        """Points the optimizer's pieces and the parameters' DTensor faces (``.grad``) at the
        fully reduced gradients, once per change of them: a clip in between scales what the
        optimizer then reads. Without any (nothing reduced since zero_grad) they get None, and
        torch's optimizers skip them, as for any ``.grad``."""
        self.finish_outer_average()
        if self.state.grads_shown:
            return
        bucket = self.bucket
        if bucket.host is not None:
            self.offload()
            self.optimizer_grads = bucket.host.grads()
        else:
            source = self.optimizer_source()
            main_dtype = bucket.main_params.dtype
            cast = source is not None and source.dtype != main_dtype and not self.optimizer_reads_main_grads
            self.optimizer_grads = source.to(main_dtype) if cast else source
        self._point_pieces()

    def _point_pieces(self) -> None:
        """The optimizer's pieces and the faces show ``optimizer_grads`` (None: no gradient)."""
        bucket = self.bucket
        with plain_attribute_access():
            for optim_param, face, (lo, hi) in zip(bucket.optim_params, bucket.faces, bucket.optim_ranges):
                piece = None if self.optimizer_grads is None else self.optimizer_grads[lo:hi]
                optim_param.grad = piece
                face.show_grad(piece)
        self.state.grads_now_shown()
