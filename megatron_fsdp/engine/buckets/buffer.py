"""A bucket: one unit's parameters of one (dtype, requires_grad) group in flat buffers.

The compute weights live in one flat buffer (sharded for ``optim_grads_params``, gathered into a
pooled bucket when used) and every parameter's ``.data`` is a view into it. Gradients are added
into a pooled un-reduced buffer, reduced once per bucket, and accumulated into the main gradient
(sharded for strategies 1..3). Trainable buckets also hold the fp32 main parameters that the
optimizer steps, one tensor per parameter covering this rank's piece of it; with CPU offloading
those and the gradients the optimizer reads live on the host (offload.py). What a bucket holds
through a step (weights gathered or not, gradients held, reduced, shown) is named in
bucket_state.py.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp import _ops
from megatron_fsdp.engine.buckets.bucket_checkpoint import BucketCheckpointing
from megatron_fsdp.engine.buckets.bucket_geometry import BucketGeometry
from megatron_fsdp.engine.buckets.bucket_state import BucketState
from megatron_fsdp.engine.buckets.offload import HostBuffers, OffloadTransfers, StagedWeights
from megatron_fsdp.engine.config import FSDPSettings, ShardingStrategy
from megatron_fsdp.engine.groups.collectives import (
    HostWork,
    all_gather_shards,
    all_reduce_sum,
    all_to_all,
    reduce_scatter_sum,
    wait_for,
)
from megatron_fsdp.engine.groups.mesh import DataParallelGroup
from megatron_fsdp.engine.params.dtensor_params import local_grad, local_tensor, param_extent
from megatron_fsdp.engine.params.layout import BucketLayout
from megatron_fsdp.engine.params.piece_dtensor import plain_attribute_access
from megatron_fsdp.engine.params.sharded_params import ShardedParam
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy


@dataclass
class PendingReduction:
    """A launched reduction: ``finish`` runs once ``work`` is done and adds the result into the
    main gradient."""

    bucket: Bucket
    work: dist.Work | None
    finish: Callable[[], None]


class Bucket(BucketCheckpointing):
    # Whether the compute weights are float8 made from the main params (float8_bucket.py).
    float8_weights = False

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        dp: DataParallelGroup,
        settings: FSDPSettings,
        pool: torch.ScriptObject,
        pool_role: str,
        grad_divisor: int | None = None,
        transfers: OffloadTransfers | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """``transfers``: the model's offload stream and staging buffers, given when it offloads.
        ``compute_dtype``: the weights' dtype when it is not the parameters' own (FSDP2's
        ``param_dtype``); the main parameters are then made from the parameters' exact values."""
        self.names = names
        # Pool keys are "<purpose>/<role>": buckets of the same role in different units take
        # turns on the same persistent blocks under fsdp_double_buffer.
        self.pool_role = pool_role
        self.params = params
        # What the buffers hold of each parameter: the parameter itself, or a DTensor's local
        # tensor, whose global place ``extents`` record (for checkpoints; also Megatron-Core's
        # plain tensor-parallel blocks).
        self.locals = [local_tensor(p) for p in params]
        tensor_parallel_mesh = dp.model_parallel_mesh()
        self.extents = [param_extent(n, p, tensor_parallel_mesh) for n, p in zip(names, params)]
        self.dp = dp
        # Reduced gradients are divided by this: the data-parallel size, or for expert buckets
        # (reduced over the smaller expert-data-parallel group) the dense one; 1 (a sum) for a
        # per-token loss.
        self.grad_divisor = 1 if settings.calculate_per_token_loss else (grad_divisor or dp.size)
        self.outer_divisor = 1 if settings.calculate_per_token_loss else (dp.outer.size if dp.outer is not None else 1)
        self.strategy = settings.strategy
        self.collective_timeout = settings.collective_timeout
        self.pool = pool
        self.dtype = compute_dtype or self.locals[0].dtype
        self.dtypes = settings.mixed_precision.resolve(self.dtype)
        self.device = self.locals[0].device
        self.state = BucketState(f"{self.dtype} bucket of {names[0]} .. {names[-1]}", len(params))
        self.requires_grad = params[0].requires_grad
        # Offloaded: the main parameters and the gradients the optimizer reads live on the host.
        self.offloaded = transfers is not None and self.requires_grad
        self.host: HostBuffers | None = None
        # The DTensor parameters users see, one per parameter (set by add_faces).
        self.faces: list[ShardedParam] = []
        self.shapes = [t.shape for t in self.locals]
        self.outer = dp.outer
        self.geometry = BucketGeometry.build(
            [t.numel() for t in self.locals], self.dtype.itemsize, settings.alignment_bytes, dp.rank, dp.size,
            self.strategy, self.dtypes, self.requires_grad, self.offloaded,
            outer_size=self.outer.size if self.outer is not None else 1,
            outer_rank=self.outer.rank if self.outer is not None else 0,
            outer_shards_optimizer=dp.outer_shards_optimizer, float8_weights=self.float8_weights,
        )
        self.splits_shard = self.geometry.splits_shard
        self.layout: BucketLayout = self.geometry.layout
        self.offsets = [slot.offset for slot in self.layout.slots]
        self.shard_start, self.shard_end = self.geometry.shard_range

        self.weight_shard: torch.Tensor | None = None
        self.views: list[torch.Tensor] | None = None
        self.gathers_from_main = self.geometry.gathers_from_main
        self._gather_input: torch.Tensor | None = None
        self._init_weights()

        self.unreduced_grad: torch.Tensor | None = None
        # Parameters whose gradient the un-reduced buffer holds: a parameter's first gradient is
        # copied in, later ones (micro-batches accumulated locally) added, so a fresh buffer
        # needs no zeroing pass; only its padding is zeroed, by one indexed fill.
        self.grads_written = [False] * len(params)
        gaps = self.layout.padding_ranges()
        self.padding_index = (
            torch.cat([torch.arange(lo, hi, device=self.device) for lo, hi in gaps]) if gaps else None
        )
        # One flag per parameter, set on the device when a local gradient holds NaN/Inf.
        self.nonfinite_flags = (
            torch.zeros(len(params), dtype=torch.bool, device=self.device) if settings.report_nan_in_param_grad else None
        )
        if self.requires_grad:
            self._init_main_state(transfers)
        self._release_full_params()

    # -- construction -------------------------------------------------------------------------

    def _init_weights(self) -> None:
        """The compute weights: this rank's shard and a pooled bucket to gather into
        (optim_grads_params), else the whole bucket, which the parameters then view."""
        if self.strategy.shards_weights:
            if not self.gathers_from_main:
                self.weight_shard = self._local_pieces(self.shard_start, self.shard_end, self.dtype)
            self.full_weight = self.pool.placeholder(self.layout.padded_numel, self.dtype, self.device)
        else:
            self.full_weight = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
            _ops.flatten_copy([t.detach() for t in self.locals], self.offsets, self.full_weight)
            self.views = _ops.param_views(self.full_weight, self.offsets, self.shapes)
            for local, view in zip(self.locals, self.views):
                local.data = view

    def _release_full_params(self) -> None:
        if self.strategy.shards_weights:
            # Everything needed was copied out of the full parameters: let them go. A sharded
            # parameter's .data is an empty tensor, so stray reads fail loudly; one serves every
            # reshard (no allocation per parameter and step).
            self._placeholder = torch.empty(0, dtype=self.dtype, device=self.device)
            for local in self.locals:
                local.data = self._placeholder

    def _initial_main_params(self) -> torch.Tensor:
        """Main params of another dtype than the weights, made from the weights."""
        return self._main_weight_target().to(self.dtypes.main_params)

    def _local_pieces(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Bucket elements ``[start, end)`` built from the parameters' current values."""
        out = torch.zeros(end - start, dtype=dtype, device=self.device)
        for index, local in enumerate(self.locals):
            lo, hi = self._piece(index, start, end)
            if hi > lo:
                slot = self.layout.slots[index]
                out[lo - start : hi - start].copy_(local.detach().reshape(-1)[lo - slot.offset : hi - slot.offset])
        return out

    def _piece(self, index: int, start: int, end: int) -> tuple[int, int]:
        return self.geometry.piece(index, start, end)

    def _init_main_state(self, transfers: OffloadTransfers | None) -> None:
        self.grad_start, self.grad_end = self.geometry.grad_range
        self.main_start, self.main_end = self.geometry.main_range
        self.main_params_alias_weights = self.geometry.main_params_alias_weights
        if self.offloaded:
            self.host = HostBuffers(self._main_weight_target(), self.dtypes.main_params, transfers)
            self.main_params = self.host.main_params
        elif self.gathers_from_main:
            self.main_params = self._local_pieces(self.main_start, self.main_end, self.dtypes.main_params)
        elif self.main_params_alias_weights:
            self.main_params = self._main_weight_target()
        else:
            self.main_params = self._initial_main_params()
        # Gradients reduced over the shard group accumulate here; with an outer group, they are
        # averaged over it when synced: in place (HSDP) or reduce-scattered into outer_grad (HFSDP).
        # Both exist only from the first reduction after zero_grad(set_to_none=True) until the
        # next one, as torch's own .grad: forward, which holds the activations, runs without them.
        # Offloaded, only until they are sent to the host, which accumulates from then on.
        self.main_grad: torch.Tensor | None = None
        self.outer_grad: torch.Tensor | None = None
        self.optim_params: list[nn.Parameter] = []
        self.optim_ranges: list[tuple[int, int]] = []
        # What the optimizer reads: the fully reduced gradients in the main-parameter dtype (the
        # main gradients themselves when the dtypes agree, or when it reads them as they are:
        # see read_main_grads_as_they_are), shown once per change.
        self.optimizer_grads: torch.Tensor | None = None
        self.optimizer_reads_main_grads = False
        for lo, hi in self.geometry.main_pieces():
            self.optim_ranges.append((lo - self.main_start, hi - self.main_start))
            self.optim_params.append(nn.Parameter(self.main_params[lo - self.main_start : hi - self.main_start]))

    def _main_weight_target(self) -> torch.Tensor:
        """The compute weights the main params are installed into after a step."""
        if self.weight_shard is not None:
            return self.weight_shard[self.main_start - self.shard_start : self.main_end - self.shard_start]
        return self.full_weight[self.main_start : self.main_end]

    def _pool_key(self, purpose: str) -> str:
        return f"{purpose}/{self.pool_role}"

    # -- weights ------------------------------------------------------------------------------

    def start_unshard(self, async_op: bool) -> dist.Work | HostWork | None:
        """Fills the pooled bucket and launches the all-gather of the weight shards into it."""
        self.state.gather()
        self.pool.fill(self.full_weight, self._pool_key("weights"))
        if self.host is not None:
            self.host.before_device_reads_weights()
        shard = self.weight_shard
        if self.gathers_from_main and self.dp.size == 1:
            self.full_weight.copy_(self.main_params)  # the main shard is the whole bucket: cast it in place
            return None
        if self.gathers_from_main:
            shard = self._gather_input = self.pool.fetch(
                self.layout.shard_numel, self.dtype, self.device, self._pool_key("gather_input")
            )
            shard.copy_(self.main_params)
        return all_gather_shards(self.full_weight, shard, self.dp.group, async_op=async_op)

    def point_params_at_full_weight(self) -> None:
        """After the gather finished: parameters become views of the gathered bucket."""
        if self._gather_input is not None:
            self.pool.release(self._gather_input)
            self._gather_input = None
        if self.views is None:
            self.views = _ops.param_views(self.full_weight, self.offsets, self.shapes)
        for local, view in zip(self.locals, self.views):
            local.data = view

    def reshard(self) -> None:
        """Gives the gathered weights back (a bucket of the root unit may have done so already,
        once its gradients were in)."""
        if not self.state.release():
            return
        for local in self.locals:
            local.data = self._placeholder
        self.pool.release(self.full_weight)

    # -- gradients ----------------------------------------------------------------------------

    def set_policy(self, policy: MixedPrecisionPolicy) -> None:
        """Switches the communication dtype between steps; the buffers' dtypes are fixed."""
        new = policy.resolve(self.dtype)
        if (new.main_params, new.main_grads) != (self.dtypes.main_params, self.dtypes.main_grads):
            raise ValueError(
                "only grad_comm_dtype can change after fully_shard; main_params_dtype and main_grads_dtype size the buffers"
            )
        self.dtypes = new
        self.geometry = replace(self.geometry, dtypes=new)

    def note_grad(self, index: int) -> bool:
        """Parameter ``index``'s ``.grad`` holds a new gradient (torch adds a second one of the
        same backward into it); True once every parameter of the bucket has delivered one in this
        backward, the moment to :meth:`take_grads`."""
        return self.state.note_grad(index)

    def take_grads(self) -> None:
        """Moves the gradients the parameters' ``.grad`` hold into the un-reduced buffer and
        releases them: a parameter's first gradient is copied in, later ones (micro-batches
        accumulated locally) added, each as one multi-tensor op for the bucket. Per parameter,
        the host's launch would cost more than the GPU's copy of a bucket."""
        held = self.state.held
        if not held:
            return
        targets = _ops.param_views(self._grad_buffer(), self.offsets, self.shapes)
        grads, copy_to, copy_from, add_to, add_from = [], [], [], [], []
        for index in held:
            grad = local_grad(self.params[index])
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
            rows = torch.tensor(held, device=self.device)
            self.nonfinite_flags[rows] = self.nonfinite_flags[rows].logical_or(_ops.find_non_finite(grads))
        for index in held:
            self.params[index].grad = None
        self.state.forget_held()

    def _grad_buffer(self) -> torch.Tensor:
        """The un-reduced buffer the gradients go into, set up by the first take since the last
        reduction."""
        if self.unreduced_grad is not None:
            return self.unreduced_grad
        if self._reduces_in_place():
            # The main gradient is the un-reduced buffer: a fresh one is written, one that holds
            # earlier micro-batches is added to.
            self.unreduced_grad, fresh = self._main_grad_to_write()
            self.grads_written = [not fresh] * len(self.params)
            if not fresh:
                return self.unreduced_grad
        else:
            # Strategies 0/1 accumulate micro-batches locally: in the main-gradient dtype.
            # 2/3 hold one micro-batch: straight in the communication dtype.
            dtype = self.dtypes.comm if self.strategy.shards_grads else self.dtypes.main_grads
            self.unreduced_grad = self.pool.fetch(self.layout.padded_numel, dtype, self.device, self._pool_key("grads"))
            self.grads_written = [False] * len(self.params)
        if self.padding_index is not None:
            self.unreduced_grad.index_fill_(0, self.padding_index, 0)
        return self.unreduced_grad

    def _reduces_in_place(self) -> bool:
        return self.geometry.reduces_in_place(self.grad_divisor)

    def end_backward(self) -> None:
        self.state.end_backward()

    def drop_unreduced_grads(self) -> None:
        """After a backward that raised: forgets the gradients not yet reduced, those the
        parameters' ``.grad`` hold and the un-reduced buffer (with it, micro-batches that
        strategies 0/1 accumulated locally)."""
        with plain_attribute_access():
            for param in self.params:
                param.grad = None
        self.state.forget_held()
        if self.unreduced_grad is not None and self.unreduced_grad is not self.main_grad:
            self.pool.release(self.unreduced_grad)
        self.unreduced_grad = None
        if self.nonfinite_flags is not None:
            self.nonfinite_flags.zero_()

    def start_reduction(self, async_op: bool) -> PendingReduction:
        """Launches the reduction of the un-reduced buffer. Same-precision communication: an
        all-reduce (no_shard) or reduce-scatter. Lower-precision communication: an all-to-all
        of the chunks, summed in the main-gradient dtype by ``promoting_reduce``."""
        unreduced, self.unreduced_grad = self.unreduced_grad, None
        if unreduced is None:
            raise RuntimeError(f"{self.state.name}: a reduction was started with no gradient taken since the last one")
        for index, written in enumerate(self.grads_written):
            if not written:  # no gradient this backward: it contributes zeros
                slot = self.layout.slots[index]
                unreduced[slot.offset : slot.end].zero_()
        if self._reduces_in_place():
            return PendingReduction(self, None, lambda: None)  # already in the main gradient
        comm = self._in_comm_dtype(unreduced)
        group = self.dp.group
        if self.dtypes.promotes_reduction:
            received = self.pool.fetch(self.layout.padded_numel, comm.dtype, self.device, self._pool_key("received_grads"))
            work = all_to_all(received, comm, group, async_op=async_op)
            return PendingReduction(self, work, lambda: self._finish_promoted(comm, received))
        if self.strategy is ShardingStrategy.NO_SHARD or self.dp.size == 1:
            # Every rank keeps the whole sum (over one rank its shard is the whole bucket).
            work = all_reduce_sum(comm, group, async_op=async_op)
            return PendingReduction(self, work, lambda: self._add_to_main_grad(comm, spent=None))
        reduced = self.pool.fetch(self.layout.shard_numel, comm.dtype, self.device, self._pool_key("reduced_grads"))
        work = reduce_scatter_sum(reduced, comm, group, async_op=async_op)
        return PendingReduction(self, work, lambda: self._add_to_main_grad(reduced, spent=comm))

    def _in_comm_dtype(self, unreduced: torch.Tensor) -> torch.Tensor:
        """The un-reduced gradients in the communication dtype: a pooled copy only when the
        dtypes differ, released right after the reduction."""
        if unreduced.dtype == self.dtypes.comm:
            return unreduced
        comm = self.pool.fetch(unreduced.numel(), self.dtypes.comm, self.device, self._pool_key("comm_grads"))
        comm.copy_(unreduced)
        self.pool.release(unreduced)
        return comm

    def _main_grad_to_write(self) -> tuple[torch.Tensor, bool]:
        """The main gradient, and whether it is fresh: created (uninitialised) by the first
        reduction since it was released, which writes it instead of adding to zeros."""
        self.state.grads_changing()
        if self.main_grad is None:
            self.main_grad = torch.empty(self.grad_end - self.grad_start, dtype=self.dtypes.main_grads, device=self.device)
            return self.main_grad, True
        return self.main_grad, False

    def _accumulate(self, reduced: torch.Tensor, scale: float) -> None:
        main_grad, fresh = self._main_grad_to_write()
        if fresh:
            torch.mul(reduced, scale, out=main_grad)
        else:
            main_grad.add_(reduced, alpha=scale)

    def _add_to_main_grad(self, reduced: torch.Tensor, spent: torch.Tensor | None) -> None:
        """Adds the pooled ``reduced`` gradients into the main gradient and releases them.
        ``spent`` (the reduction's input, no longer read) goes back first: a main gradient
        created now can take its memory."""
        if spent is not None:
            self.pool.release(spent)
        # Gradients are averaged over data-parallel ranks: each rank's loss is a mean over its own batch.
        self._accumulate(reduced, 1.0 / self.grad_divisor)
        self.pool.release(reduced)

    def _finish_promoted(self, comm: torch.Tensor, received: torch.Tensor) -> None:
        chunks = received.view(self.dp.size, self.layout.shard_numel)
        if self.strategy is ShardingStrategy.NO_SHARD:
            # This rank sums its shard in high precision, then every rank gathers every shard.
            shard = self.pool.fetch(
                self.layout.shard_numel, self.dtypes.main_grads, self.device, self._pool_key("reduced_grads")
            )
            _ops.promoting_reduce(chunks, shard, scale=1.0 / self.grad_divisor)
            all_gather_shards(comm, shard.to(comm.dtype), self.dp.group)
            self.pool.release(shard)
            self._accumulate(comm, 1.0)
            self.pool.release(comm)
        else:
            self.pool.release(comm)  # sent: a main gradient created now can take its memory
            main_grad, fresh = self._main_grad_to_write()
            _ops.promoting_reduce(chunks, main_grad, scale=1.0 / self.grad_divisor, accumulate=not fresh)
        self.pool.release(received)

    def finish_reduction(self, pending: PendingReduction) -> None:
        if pending.work is not None:
            what = f"the gradient reduction of the {self.state.name} ({len(self.names)} parameters)"
            wait_for(pending.work, self.collective_timeout, what, self.dp.group, self.device)
        pending.finish()
        self.state.reduction_finished(self.outer is not None)

    def sync_outer(self) -> None:
        """HSDP: average the shard-group-reduced gradients over the outer group. Averaging
        again later is harmless: the part already averaged is equal on every outer rank."""
        if not self.state.outer_sync_due:
            return
        self.state.grads_changing()
        if self.splits_shard:
            if self.outer_grad is None:
                self.outer_grad = torch.empty(self.main_end - self.main_start, dtype=self.dtypes.main_grads, device=self.device)
            reduce_scatter_sum(self.outer_grad, self.main_grad, self.outer.group)
        else:
            all_reduce_sum(self.main_grad, self.outer.group)
        if self.outer_divisor != 1:
            self.optimizer_grad_source().div_(self.outer_divisor)
        self.state.outer_synced()

    def optimizer_grad_source(self) -> torch.Tensor | None:
        """The fully reduced gradients of the range the optimizer steps; None when no gradient
        was reduced since they were released."""
        return self.outer_grad if self.splits_shard else self.main_grad

    def zero_main_grad(self, set_to_none: bool = True) -> None:
        """Releases the main gradients (``set_to_none``) or zeroes them in place, and with them
        what the optimizer's pieces and the parameters' faces show."""
        if set_to_none:
            self.main_grad = self.outer_grad = self.optimizer_grads = None
            if self.host is not None:
                self.host.clear_grads()
            with plain_attribute_access():
                for optim_param, face in zip(self.optim_params, self.faces):
                    optim_param.grad = None
                    face.show_grad(None)
            self.state.grads_now_shown()
        else:
            for grad in self._held_grads():
                grad.zero_()

    def zero_main_grads_of(self, params: Collection[nn.Parameter]) -> None:
        """Zeroes in place the main gradients of those of this bucket's faces that are in
        ``params``, in every copy this bucket holds; its other faces' stay (an optimizer over part
        of the model clears its own, optim/grad_release.py). The main gradient covers the
        gradient range; the outer one, the optimizer's copy and the host's the main range (under
        HFSDP a part of it)."""
        indices = [index for index, face in enumerate(self.faces) if face.param in params]
        zeroed: set[int] = set()
        if self.main_grad is not None:
            for lo, hi in (self.geometry.piece(index, self.grad_start, self.grad_end) for index in indices):
                self.main_grad[lo - self.grad_start : hi - self.grad_start].zero_()
            zeroed.add(id(self.main_grad))
        for grad in self._held_grads():
            if id(grad) not in zeroed:
                for lo, hi in (self.optim_ranges[index] for index in indices):
                    grad[lo:hi].zero_()

    def scale_grads(self, factor: float) -> None:
        """Multiplies every gradient this bucket holds by ``factor``: held back un-reduced, the
        main gradient, the outer-reduced one, the optimizer's cast copy and the host's (each
        once)."""
        for grad in self._held_grads(include_unreduced=True):
            grad.mul_(factor)

    def _held_grads(self, include_unreduced: bool = False) -> list[torch.Tensor]:
        """Every distinct gradient tensor this bucket holds; offloaded, the host's complete
        (a copy in flight to them has landed, or it would carry a change twice or not at all)."""
        held = [self.unreduced_grad] if include_unreduced else []
        held += [self.main_grad, self.outer_grad, self.optimizer_grads]
        if self.host is not None:
            held.append(self.host.grads())
        return list({id(g): g for g in held if g is not None}.values())

    def offload_grads(self) -> None:
        """Offloaded: launches the copy of the fully reduced device gradients to the host and
        releases them (the host adds later ones to what it holds); the gradient sync waits for
        the copy. Not while an outer (HSDP) average is due."""
        source = self.optimizer_grad_source()
        # Reduced in place (a shard group of one), the main gradient is also the un-reduced
        # buffer while micro-batches accumulate without sync: not reduced yet, it stays.
        if self.host is None or self.state.outer_sync_due or source is None or source is self.unreduced_grad:
            return
        self.host.send_grads(source)
        self.main_grad = self.outer_grad = None

    # -- optimizer ----------------------------------------------------------------------------

    def read_main_grads_as_they_are(self) -> None:
        """The optimizer steps with kernels that upcast the gradient in registers: show it the
        main gradients in their own dtype (bf16 under fp32 main params) instead of a copy in the
        main-parameter dtype, held from backward to zero_grad. The pieces' and faces' ``.grad``
        may then differ in dtype from the parameter (torch's ``grad_dtype = None``)."""
        self.optimizer_reads_main_grads = True
        self.state.grads_changing()
        with plain_attribute_access():
            for optim_param, face in zip(self.optim_params, self.faces):
                optim_param.grad_dtype = None
                face.param.grad_dtype = None

    def show_grads(self) -> None:
        """Points the optimizer's pieces and the parameters' DTensor faces (``.grad``) at the
        fully reduced gradients, once per change of them: a clip in between scales what the
        optimizer then reads. Without any (nothing reduced since zero_grad) they get None, and
        torch's optimizers skip them, as for any ``.grad``."""
        if self.state.grads_shown:
            return
        if self.host is not None:
            self.offload_grads()
            self.optimizer_grads = self.host.grads()
        else:
            source = self.optimizer_grad_source()
            cast = source is not None and source.dtype != self.main_params.dtype and not self.optimizer_reads_main_grads
            self.optimizer_grads = source.to(self.main_params.dtype) if cast else source
        with plain_attribute_access():
            for optim_param, face, (lo, hi) in zip(self.optim_params, self.faces, self.optim_ranges):
                piece = None if self.optimizer_grads is None else self.optimizer_grads[lo:hi]
                optim_param.grad = piece
                face.show_grad(piece)
        self.state.grads_now_shown()

    def stage_main_params(self) -> StagedWeights | None:
        """Offloaded: host memory for the stepped main params in the compute dtype (``buffer``,
        one element per main param, ``optim_ranges`` holding each piece's), for a host step that
        writes them there as it steps them, instead of a second pass casting them; then give it to
        :meth:`install_main_params`. None when the bucket is not offloaded."""
        if self.host is None:
            return None
        return self.host.stage_weights(self._main_weight_target())

    def install_main_params(self, staged: StagedWeights | None = None) -> None:
        """Writes the stepped main params into the compute weights and, where every rank holds
        full weights but stepped only its shard (strategies 1 and 2), gathers the others'.
        ``staged``: from :meth:`stage_main_params`, filled with every main param cast (sent as it
        is); without it, an offloaded bucket casts the main params now."""
        if self.gathers_from_main:
            return  # the next gather casts the new main params
        if self.host is not None:
            if staged is None:
                self.host.send_weights(self._main_weight_target())
            else:
                self.host.send_staged_weights(staged)
            if self.strategy.shards_weights and not self.splits_shard:
                return  # the unit's next all-gather waits for the copy
            self.host.before_device_reads_weights()
        elif not self.main_params_alias_weights:
            self._main_weight_target().copy_(self.main_params)
        if self.splits_shard:
            # A copy: not every backend (gloo) accepts an input that aliases the output.
            all_gather_shards(self.weight_shard, self._main_weight_target().clone(), self.outer.group)
        if self.strategy in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS):
            # A copy: not every backend (gloo) accepts an input that aliases the output.
            own_shard = self.full_weight[self.shard_start : self.shard_end].clone()
            all_gather_shards(self.full_weight, own_shard, self.dp.group)
