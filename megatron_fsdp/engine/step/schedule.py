"""The per-step pipeline: when units gather and reshard, when gradient buckets reduce, and the
bookkeeping of reductions in flight.

A step moves IDLE -> FORWARD -> BACKWARD -> IDLE. Reductions start when a bucket's last gradient
arrives (strategies 2/3 always; 0/1 only when gradients sync this micro-batch) and are finished
oldest-first, at most ``max_reductions_in_flight`` at a time, so un-reduced buffers never pile up.
Under HSDP a finished reduction of the step's last backward launches the bucket's average over
the replicas at once, so it runs under the rest of backward as FSDP2's all-reduce does; the sync
waits for those in flight and averages what is still due.

A backward that raised (an out-of-memory error in a hook, say) never reaches its end: the step
stays in BACKWARD with no autograd pass running. :meth:`StepScheduler.abandon_failed_step` then
puts everything back as between steps, dropping the failed step's gradients not yet reduced;
the wrapper calls it at the next ``zero_grad`` or forward (docs/troubleshooting.md).
"""

from __future__ import annotations

import contextlib
import enum
from collections import deque
from collections.abc import Callable, Iterator

import torch
from torch.autograd import Variable

from megatron_fsdp import _ops
from megatron_fsdp.engine.buckets.grad_reduction import PendingReduction
from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.config import FSDPSettings
from megatron_fsdp.engine.groups.collectives import all_gather_shards, all_reduce_max
from megatron_fsdp.engine.groups.mesh import DataParallelGroup
from megatron_fsdp.engine.step.units import FSDPUnit


FAILED_BACKWARD_ADVICE = (
    "call optimizer.zero_grad() (or model.zero_grad_buffer()) to drop that step's gradients, then train on"
)


class StepState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class StepScheduler:
    def __init__(self, units: list[FSDPUnit], settings: FSDPSettings, dp: DataParallelGroup) -> None:
        self.units = units
        self.settings = settings
        self.dp = dp
        self.state = StepState.IDLE
        # no_sync() turns this off: strategies 0/1 then accumulate locally.
        self.sync_grads = True
        # set_model_auto_sync(): whether each backward finishes its reductions and shows the
        # gradients; off, strategies 0/1 also accumulate locally until the sync.
        self.auto_sync = settings.sync_model_each_microbatch
        # no_sync() ended since the last sync: the next backward outside it is the step's last
        # (upstream's is_last_microbatch), whose buckets are averaged over dp_outer as they reduce.
        self._last_micro_batch_next = False
        # Reductions in flight, each with whether its dp_outer average follows once it is done.
        self._pending: deque[tuple[PendingReduction, bool]] = deque()
        # Unit forward calls of this step and of the last one: the order to prefetch in.
        self._forward_calls: list[FSDPUnit] = []
        self._last_forward_calls: list[FSDPUnit] = []
        self._backward_cursor = 0
        # Front doors' own work once a backward has shown its gradients (fsdp2: unused ones).
        self.after_backward: list[Callable[[], None]] = []

    # -- forward ------------------------------------------------------------------------------

    def before_unit_forward(self, unit: FSDPUnit) -> None:
        if self.state is StepState.BACKWARD:
            if unit.is_root:
                raise RuntimeError(
                    f"unit {unit.name} ran forward while a backward pass is in progress; finish backward() first"
                )
            # Activation checkpointing re-runs a unit's forward inside backward, which needs the
            # weights gathered anyway: nothing is recorded, prefetched or resharded for it.
            unit.unshard()
            return
        if self.state is StepState.IDLE:
            self._forward_calls = []
        self.state = StepState.FORWARD
        unit.unshard()
        if not unit.is_root:
            self._forward_calls.append(unit)
            self._prefetch(self._last_forward_calls, len(self._forward_calls))

    def _prefetch(self, order: list[FSDPUnit], position: int) -> None:
        """Starts gathering the unit at ``position`` of ``order`` while the current one computes."""
        if self.settings.overlap_param_gather and 0 <= position < len(order):
            order[position].start_unshard()

    def after_unit_forward(self, unit: FSDPUnit) -> bool:
        """Reshards after a forward; False for a forward recomputed inside backward, whose
        outputs need no pre-backward hook (backward has reached the unit already)."""
        if self.state is StepState.BACKWARD:
            return False
        if unit.reshards_after_forward:
            unit.reshard()
        return True

    def end_forward_without_backward(self) -> None:
        """Inference (no_grad, or nothing to differentiate): nothing stays gathered."""
        for unit in self.units:
            unit.reshard()
        self._last_forward_calls = self._forward_calls
        self.state = StepState.IDLE

    # -- a step that raised ---------------------------------------------------------------------

    def backward_failed(self) -> bool:
        """Whether a backward began and never ended: it raised, and no autograd pass runs now."""
        # torch's own FSDP tells "inside backward" the same way.
        return self.state is StepState.BACKWARD and torch._C._current_graph_task_id() == -1

    def abandon_failed_step(self) -> None:
        """After a backward that raised: finishes the reductions it launched (every rank that
        failed alike launched the same ones), drops its gradients not yet reduced, reshards every
        unit and returns to IDLE. The main gradients still hold what was reduced: the caller
        releases them."""
        while self._pending:
            pending, _ = self._pending.popleft()
            pending.bucket.grads.finish_reduction(pending)
        for unit in self.units:
            for bucket in unit.trainable_buckets:
                bucket.grads.finish_outer_average()
                bucket.grads.drop_unreduced()
            unit.reshard()
            unit.end_backward()
        self._forward_calls = []
        self._last_micro_batch_next = False
        self.state = StepState.IDLE

    # -- backward -----------------------------------------------------------------------------

    def before_unit_backward(self, unit: FSDPUnit | None, root: FSDPUnit | None = None) -> None:
        """``unit``'s backward begins; ``root``: the backward of a root forward begins."""
        if self.state is not StepState.BACKWARD:
            self.state = StepState.BACKWARD
            self._last_forward_calls = self._forward_calls
            self._backward_cursor = len(self._forward_calls)
            # Runs once the autograd engine has finished this backward pass.
            Variable._execution_engine.queue_callback(self._end_backward)
        if unit is not None and unit.is_root:
            # A root resharded after forward: gathered again before backward computes in it.
            unit.unshard()
            self._prefetch(self._forward_calls, self._backward_cursor - 1)
        elif unit is not None:
            unit.unshard()
            # Backward meets the units in reverse forward order: gather the one before next.
            self._backward_cursor -= 1
            self._prefetch(self._forward_calls, self._backward_cursor - 1)
        if root is not None:
            # Pipeline schedules run several forwards before their backwards (1F1B's warm-up):
            # the end of an earlier backward resharded the root this forward's graph reads.
            root.unshard()

    def on_grad(self, unit: FSDPUnit, bucket: Bucket, index: int) -> None:
        if not bucket.grads.note_grad(index):
            return
        if unit.is_root and unit.reshard_after_backward and self.settings.strategy.shards_weights:
            # The root unit stays gathered from forward into backward. A bucket of it (one
            # module's parameters) whose gradients are all in is not read again before the next
            # forward: its weights go back first, so the main gradient created next can take
            # their memory (at the end of backward, where memory peaks, for the embedding's).
            # Not when the unit is to stay gathered after backward (FSDP2's
            # set_reshard_after_backward(False)): the next forward reads these weights.
            bucket.weights.release()
        bucket.grads.take()
        if not (unit.requires_gradient_sync and self._reduces_now()):
            return
        self._start_reduction(bucket, unit)
        if unit.note_bucket_reduced(bucket) and unit.reshard_on_grads and not unit.is_root:
            unit.reshard()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside hold gradients back (docs/sharding_strategies.md); the first
        one after is the step's last: Megatron-LM runs every micro-batch but the last inside, and
        enters it even when there is one micro-batch."""
        previous = self.sync_grads
        self.sync_grads = False
        try:
            yield
        finally:
            self.sync_grads = previous
            self._last_micro_batch_next = previous

    def _syncs_now(self) -> bool:
        """Whether this micro-batch synchronises the gradients (docs/sharding_strategies.md's
        accumulation table): auto-sync on and outside ``no_sync()``."""
        return self.sync_grads and self.auto_sync

    def _reduces_now(self) -> bool:
        """Strategies 2/3 reduce-scatter every micro-batch, as upstream's do (their gradients
        are sharded to save memory); 0/1 only when the micro-batch synchronises."""
        return self.settings.strategy.shards_grads or self._syncs_now()

    def _averages_outer_now(self, unit: FSDPUnit) -> bool:
        """Whether a reduction started now launches its dp_outer average (HSDP) once it is done:
        in a sync, and in the step's last backward (one that synchronises, or the first outside
        ``no_sync()`` with auto-sync off); never for a unit whose replicas' all-reduce is held
        back (FSDP2's ``set_requires_all_reduce(False)``). Other micro-batches leave it due, so
        the replicas exchange each bucket once per step, as upstream's callers expect."""
        if not unit.requires_all_reduce:
            return False
        if self.state is not StepState.BACKWARD:
            return True
        return self.sync_grads and (self.auto_sync or self._last_micro_batch_next)

    def _start_reduction(self, bucket: Bucket, unit: FSDPUnit) -> None:
        overlap = self.settings.overlap_grad_reduce
        pending = bucket.grads.start_reduction(async_op=overlap)
        self._pending.append((pending, bucket.outer is not None and self._averages_outer_now(unit)))
        # A synchronous reduction is already done: finishing it now gives its buffers back.
        in_flight = self.settings.max_reductions_in_flight if overlap else 0
        while len(self._pending) > in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        pending, averages_outer = self._pending.popleft()
        pending.bucket.grads.finish_reduction(pending)
        if averages_outer:
            # Behind the reduction, under the rest of backward (or the sync's other reductions).
            pending.bucket.grads.start_outer_average(async_op=self.settings.overlap_grad_reduce)
        if self.state is StepState.BACKWARD:
            # An offloaded bucket's reduced gradients go to the host now, overlapping the rest of
            # backward; the host adds later micro-batches' to them (what the memory plan counts).
            pending.bucket.grads.offload()

    def _end_backward(self) -> None:
        reduces = self._reduces_now()
        for unit in self.units:
            for bucket in unit.trainable_buckets:
                # A bucket some of whose parameters got no gradient (those contribute zeros), or
                # one whose parameter got another after the bucket was complete.
                bucket.grads.take()
                if bucket.grads.unreduced_grad is not None and reduces and unit.requires_gradient_sync:
                    self._start_reduction(bucket, unit)
            if unit.reshard_after_backward:
                unit.reshard()
            unit.end_backward()
        self.state = StepState.IDLE
        if self._syncs_now():
            self.finish_grad_sync()
        for callback in self.after_backward:
            callback()
        if self.settings.report_nan_in_param_grad:
            self._report_nonfinite_param_grads()

    def _report_nonfinite_param_grads(self) -> None:
        """Raises on every rank, naming each parameter whose local gradient held NaN/Inf this
        backward and the ranks where it did (one all-gather of the per-parameter flags)."""
        buckets = [b for unit in self.units for b in unit.trainable_buckets]
        if not buckets:
            return
        local = torch.cat([b.grads.nonfinite_flags for b in buckets]).to(torch.uint8)
        gathered = torch.empty(self.dp.size * local.numel(), dtype=torch.uint8, device=local.device)
        all_gather_shards(gathered, local, self.dp.group)
        for bucket in buckets:
            bucket.grads.nonfinite_flags.zero_()
        flags = gathered.view(self.dp.size, -1).cpu()
        if not flags.any():
            return
        names = [name for b in buckets for name in b.names]
        offenders = [
            f"{name} (ranks {flags[:, i].nonzero().flatten().tolist()})" for i, name in enumerate(names) if flags[:, i].any()
        ]
        raise FloatingPointError(
            "report_nan_in_param_grad: NaN or Inf in the local gradients of " + ", ".join(offenders)
        )

    # -- optimizer ----------------------------------------------------------------------------

    def finish_grad_sync(self) -> None:
        """Finishes every reduction in flight and reduces gradients still held back (after
        micro-batches run under no_sync or without auto-sync), so the main gradients are
        complete, then shows them as the parameters' ``.grad``."""
        self._require_idle("finish_grad_sync()")
        self.synchronize_gradient_reduce()
        self.show_grads()

    def _require_idle(self, what: str) -> None:
        if self.backward_failed():
            raise RuntimeError(f"{what} was called after a backward that raised: {FAILED_BACKWARD_ADVICE}")
        if self.state is not StepState.IDLE:
            raise RuntimeError(f"{what} was called during forward or backward; call it after backward()")

    def start_grad_sync(self, units: list[FSDPUnit] | None = None) -> None:
        """Launches the reductions of gradients held back (strategies 0/1 accumulating locally,
        or a unit's with gradient sync off until now): ``units``'s, or every unit's."""
        self._require_idle("start_grad_sync()")
        self._start_held_back(self.units if units is None else units)

    def _start_held_back(self, units: list[FSDPUnit]) -> None:
        # A unit with gradient sync off (FSDP2's set_requires_gradient_sync) keeps accumulating.
        for unit in (u for u in units if u.requires_gradient_sync):
            for bucket in unit.trainable_buckets:
                if bucket.grads.unreduced_grad is not None:
                    self._start_reduction(bucket, unit)

    def finish_pending_reductions(self) -> None:
        """Waits for the reductions in flight (and adds them into the main gradients)."""
        while self._pending:
            self._finish_oldest()

    def synchronize_gradient_reduce(self) -> None:
        """Reduces everything held back, waits for every reduction and completes the averages
        over dp_outer (HSDP): those launched during backward are waited for, those still due
        (micro-batches that held back) launched, each as its reduction lands, then waited for.
        The main gradients are complete, but not yet shown as ``.grad``. A unit whose replicas'
        all-reduce is held back (FSDP2's ``set_requires_all_reduce(False)``) keeps it due."""
        self._require_idle("synchronize_gradient_reduce()")
        self._last_micro_batch_next = False
        self._start_held_back(self.units)
        self.finish_pending_reductions()
        overlap = self.settings.overlap_grad_reduce
        for unit in (u for u in self.units if u.requires_all_reduce):
            for bucket in unit.trainable_buckets:
                bucket.grads.start_outer_average(async_op=overlap)
        for unit in self.units:
            for bucket in unit.trainable_buckets:
                bucket.grads.finish_outer_average()

    def show_grads(self) -> None:
        """Points the optimizer's pieces and every face's ``.grad`` at the reduced gradients;
        a unit's whose replicas' average is held back keep showing what they showed (FSDP2's
        ``.grad`` is not written by a backward that skips the all-reduce)."""
        for unit in self.units:
            for bucket in unit.trainable_buckets:
                if unit.requires_all_reduce or not bucket.grads.state.outer_sync_due:
                    bucket.grads.show()

    def start_param_prefetch(self) -> None:
        """Launches the all-gather of the unit that ran forward first last step (strategy 3,
        with ``overlap_param_gather``), so the next forward starts on gathered weights."""
        self._require_idle("start_param_sync()")
        if self._last_forward_calls:
            self._prefetch(self._last_forward_calls, 0)

    def synchronize_param_gather(self) -> None:
        """Waits for every all-gather in flight and reshards what is not in use (between steps:
        every unit)."""
        self._require_idle("synchronize_param_gather()")
        for unit in self.units:
            unit.reshard()

    def check_reduced_grads_finite(self, step: int) -> None:
        """Raises on every rank when any rank's reduced gradient shard holds NaN/Inf."""
        buckets = [b for unit in self.units for b in unit.trainable_buckets]
        # Offloaded, the gradients are on the host by now (shown by the sync before the step).
        sources = (b.grads.optimizer_grads if b.host is not None else b.grads.optimizer_source() for b in buckets)
        # Buckets without gradients are the same on every rank (nothing reduced since zero_grad).
        grads = [g for g in sources if g is not None]
        if not grads:
            return
        on_host = [g for g in grads if g.device != buckets[0].device]
        on_device = [g for g in grads if g.device == buckets[0].device]
        flags = [_ops.find_non_finite(group).any().to(buckets[0].device) for group in (on_host, on_device) if group]
        found = torch.stack(flags).any().to(torch.int32).reshape(1)
        all_reduce_max(found, self.dp.group)
        if found.item():
            raise FloatingPointError(
                f"check_for_nan_in_grad: the reduced gradients hold NaN or Inf before optimizer step {step}; "
                "the step was skipped. Set report_nan_in_param_grad=True to find the parameters"
            )
