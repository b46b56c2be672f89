"""A bucket: one unit's parameters of one (dtype, requires_grad) group in flat buffers.

A bucket owns two lives, each an object of its own: its compute weights (``bucket.weights``,
bucket_weights.py: gathered, released, installed from the main params) and its gradients
(``bucket.grads``, bucket_grads.py: taken, reduced, synced, zeroed, shown); bucket_state.py
names the states of both. What the bucket itself holds is what both read: where each parameter
sits (its geometry and layout), its group and pool, and, for a trainable bucket, the fp32 main
parameters that the optimizer steps, one tensor per parameter covering this rank's piece of it;
with CPU offloading those and the gradients the optimizer reads live on the host (offload.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from megatron_fsdp.engine.buckets.bucket_checkpoint import BucketCheckpointing
from megatron_fsdp.engine.buckets.bucket_geometry import BucketGeometry
from megatron_fsdp.engine.buckets.bucket_grads import BucketGrads
from megatron_fsdp.engine.buckets.bucket_weights import BucketWeights
from megatron_fsdp.engine.buckets.offload import HostBuffers, OffloadTransfers
from megatron_fsdp.engine.config import FSDPSettings
from megatron_fsdp.engine.groups.mesh import DataParallelGroup
from megatron_fsdp.engine.params.dtensor_params import local_tensor, param_extent
from megatron_fsdp.engine.params.layout import BucketLayout
from megatron_fsdp.engine.params.sharded_params import ShardedParam
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy


class Bucket(BucketCheckpointing):
    # Whether the compute weights are float8 made from the main params (float8_bucket.py), and
    # the class of their life: a bucket kind with weights of its own subclasses both.
    float8_weights = False
    weights_class: type[BucketWeights] = BucketWeights

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
        self.name = f"{self.dtype} bucket of {names[0]} .. {names[-1]}"  # for errors
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

        self.gathers_from_main = self.geometry.gathers_from_main
        self.weights = self.weights_class(self)
        if self.requires_grad:
            self._init_main_state(transfers)
        self.grads = BucketGrads(self, settings.report_nan_in_param_grad)
        self.weights.release_full_params()

    def local_pieces(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
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
        self.main_start, self.main_end = self.geometry.main_range
        self.main_params_alias_weights = self.geometry.main_params_alias_weights
        if self.offloaded:
            self.host = HostBuffers(self.weights.main_target(), self.dtypes.main_params, transfers)
            self.main_params = self.host.main_params
        elif self.gathers_from_main:
            self.main_params = self.local_pieces(self.main_start, self.main_end, self.dtypes.main_params)
        elif self.main_params_alias_weights:
            self.main_params = self.weights.main_target()
        else:
            self.main_params = self._initial_main_params()
        self.optim_params: list[nn.Parameter] = []
        self.optim_ranges: list[tuple[int, int]] = []
        for lo, hi in self.geometry.main_pieces():
            self.optim_ranges.append((lo - self.main_start, hi - self.main_start))
            self.optim_params.append(nn.Parameter(self.main_params[lo - self.main_start : hi - self.main_start]))

    def _initial_main_params(self) -> torch.Tensor:
        """Main params of another dtype than the weights, made from the weights."""
        return self.weights.main_target().to(self.dtypes.main_params)

    def pool_key(self, purpose: str) -> str:
        return f"{purpose}/{self.pool_role}"

    def reduces_in_place(self) -> bool:
        return self.geometry.reduces_in_place(self.grad_divisor)

    def set_policy(self, policy: MixedPrecisionPolicy) -> None:
        """Switches the communication dtype between steps; the buffers' dtypes are fixed."""
        new = policy.resolve(self.dtype)
        if (new.main_params, new.main_grads) != (self.dtypes.main_params, self.dtypes.main_grads):
            raise ValueError(
                "only grad_comm_dtype can change after fully_shard; main_params_dtype and main_grads_dtype size the buffers"
            )
        self.dtypes = new
        self.geometry = replace(self.geometry, dtypes=new)

