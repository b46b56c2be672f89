"""Upstream's ``DistributedDataParallelConfig``: the data-parallel fields Megatron-LM users set
for Megatron-FSDP, validated and mapped onto ``fully_shard``; and the config that describes a
model ``fully_shard_model`` built (``MegatronFSDP.ddp_config``). Megatron-LM's command-line flags
for these fields are in :mod:`megatron_fsdp.integrations.megatron_lm`.

    config = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    model, optimizer = fully_shard(model, optimizer, fsdp_unit_modules=[Block],
                                   **config.fully_shard_kwargs(config.device_mesh("cpu")))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_fsdp.engine.config import FSDPSettings, ShardingStrategy
from megatron_fsdp.engine.groups.distributed_index import FSDPDistributedIndex
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy

# Megatron-LM's dtype spellings; "auto" is None: the model's compute dtype (for main grads and
# main params) or the main-gradient dtype (for communication).
DTYPE_NAMES: dict[str, torch.dtype | None] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "auto": None,
}
OUTER_DIM, SHARD_DIM = "dp_outer", "dp_shard"


@dataclass
class DistributedDataParallelConfig:
    """The data-parallel settings of megatron-fsdp's (and Megatron-LM's)
    ``DistributedDataParallelConfig``, with their names and defaults. Validated on
    construction; a plain (mutable) dataclass, as upstream's. ``fully_shard_kwargs`` maps it
    onto ``fully_shard``; ``MegatronFSDP(module, dist_index, ddp_config)`` reads it directly.

    - ``data_parallel_sharding_strategy``: ``no_shard`` (default, as upstream), ``optim``,
      ``optim_grads`` or ``optim_grads_params``.
    - ``outer_dp_sharding_strategy``: ``no_shard`` (default) or ``optim`` (HFSDP; needs
      ``optim_grads_params`` and ``num_distributed_optimizer_instances > 1``).
    - ``num_distributed_optimizer_instances`` (default 1): the size of the outer data-parallel
      group; above 1 the ranks form a (dp_outer, dp_shard) mesh: HSDP, or HFSDP with outer ``optim``.
    - ``overlap_grad_reduce`` / ``overlap_param_gather`` (default False, as in Megatron-LM).
    - ``average_in_collective`` (default False): accepted either way; gradients are summed by
      the collective and scaled by 1/dp_size, which is the same average.
    - ``megatron_fsdp_main_params_dtype`` (default fp32), ``megatron_fsdp_main_grads_dtype``
      and ``megatron_fsdp_grad_comm_dtype`` (default None = "auto"): :class:`MixedPrecisionPolicy`.
    - ``grad_reduce_in_fp32`` (default False) / ``preserve_fp32_weights`` (default True): the
      deprecated spellings of fp32 main grads / fp32 main params; they may not contradict the
      dtype fields.
    - ``check_for_nan_in_grad``, ``fsdp_double_buffer``, ``nccl_ub`` (``fully_shard`` turns on
      ``fsdp_double_buffer`` for it, as Megatron-LM does), ``init_model_with_meta_device``:
      passed on as they are.
    - ``megatron_fsdp_max_pool_double_buffer``: turns on ``fsdp_double_buffer`` (megatron_fsdp's
      double buffer already serves units of different sizes).
    - ``fsdp_all_gather_in_start_param_sync`` (default True): whether ``start_param_sync()``
      prefetches the first unit.
    - ``cpu_offload`` (default False; megatron_fsdp's own field, set by ``--cpu-offloading``):
      ``fully_shard(cpu_offload=True)``, main parameters and optimizer state on the host.
    - ``fp8_param_gather`` and ``megatron_fsdp_use_decoupled_grad`` must stay False (no FP8
      compute weights; gradients are ``param.grad``).
    - ``bucket_size``, ``gradient_reduce_div_fusion``, ``suggested_communication_unit_size``,
      ``keep_fp8_transpose_cache``, ``fsdp_db_use_persist_buf_on_alloc_fail``,
      ``disable_symmetric_registration``, ``fsdp_manual_registration``,
      ``megatron_fsdp_cuda_graph_mode``, ``megatron_fsdp_enable_fine_grained_param_gather``:
      upstream's performance tuning; accepted, no effect (buckets are per unit and dtype).
    """

    data_parallel_sharding_strategy: str = "no_shard"
    outer_dp_sharding_strategy: str = "no_shard"
    num_distributed_optimizer_instances: int = 1
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    average_in_collective: bool = False
    grad_reduce_in_fp32: bool = False
    preserve_fp32_weights: bool = True
    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    check_for_nan_in_grad: bool = False
    fsdp_double_buffer: bool = False
    nccl_ub: bool = False
    init_model_with_meta_device: bool = False
    bucket_size: int | None = None
    fp8_param_gather: bool = False
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int | None = None
    keep_fp8_transpose_cache: bool = False
    fsdp_all_gather_in_start_param_sync: bool = True
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    megatron_fsdp_use_decoupled_grad: bool = False
    megatron_fsdp_cuda_graph_mode: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    megatron_fsdp_max_pool_double_buffer: bool = False
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        inner = ShardingStrategy.parse(self.data_parallel_sharding_strategy, "data_parallel_sharding_strategy")
        outer = ShardingStrategy.parse(self.outer_dp_sharding_strategy, "outer_dp_sharding_strategy")
        if outer not in (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM):
            raise ValueError(
                f"outer_dp_sharding_strategy={outer.label!r} is not supported: use 'no_shard' (replicate across "
                "the outer group, HSDP) or 'optim' (shard the optimizer state across it too, HFSDP)"
            )
        if outer is ShardingStrategy.OPTIM and inner is not ShardingStrategy.OPTIM_GRADS_PARAMS:
            raise ValueError(
                f"outer_dp_sharding_strategy='optim' requires data_parallel_sharding_strategy='optim_grads_params', "
                f"got {inner.label!r}: pass --data-parallel-sharding-strategy optim_grads_params"
            )
        if not isinstance(self.num_distributed_optimizer_instances, int) or self.num_distributed_optimizer_instances < 1:
            raise ValueError(
                f"num_distributed_optimizer_instances must be an integer >= 1, got {self.num_distributed_optimizer_instances!r}"
            )
        if outer is ShardingStrategy.OPTIM and self.num_distributed_optimizer_instances == 1:
            raise ValueError(
                "outer_dp_sharding_strategy='optim' (HFSDP) needs an outer data-parallel group: pass "
                "--num-distributed-optimizer-instances N with N > 1 dividing the world size"
            )
        if self.fp8_param_gather:
            raise ValueError(
                "fp8_param_gather=True keeps compute weights in FP8 (Transformer Engine), which megatron_fsdp does "
                "not support: set fp8_param_gather=False"
            )
        if self.megatron_fsdp_use_decoupled_grad:
            raise ValueError(
                "megatron_fsdp_use_decoupled_grad=True (Megatron-LM's --use-precision-aware-optimizer) is for "
                "Transformer Engine's FusedAdam(use_decoupled_grad=True); megatron_fsdp shows reduced gradients as "
                "param.grad: set it to False"
            )
        if self.megatron_fsdp_max_pool_double_buffer:
            self.fsdp_double_buffer = True  # as upstream: the max pool is a double buffer
        self.mixed_precision_policy()  # raises on contradicting or unknown dtypes

    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The dtype fields, with the deprecated flags folded in."""
        main_params = self.megatron_fsdp_main_params_dtype
        if not self.preserve_fp32_weights:
            if main_params not in (None, torch.float32):
                raise ValueError(
                    f"preserve_fp32_weights=False contradicts megatron_fsdp_main_params_dtype={main_params}: "
                    "set only megatron_fsdp_main_params_dtype (None/'auto' = the compute dtype)"
                )
            main_params = None
        main_grads = self.megatron_fsdp_main_grads_dtype
        if self.grad_reduce_in_fp32:
            if main_grads not in (None, torch.float32):
                raise ValueError(
                    f"grad_reduce_in_fp32=True contradicts megatron_fsdp_main_grads_dtype={main_grads}: "
                    "set only megatron_fsdp_main_grads_dtype"
                )
            main_grads = torch.float32
        return MixedPrecisionPolicy(
            main_params_dtype=main_params, main_grads_dtype=main_grads, grad_comm_dtype=self.megatron_fsdp_grad_comm_dtype
        )

    @property
    def is_hybrid(self) -> bool:
        """Whether the ranks form a (dp_outer, dp_shard) mesh (HSDP or HFSDP)."""
        return self.num_distributed_optimizer_instances > 1

    def device_mesh(self, device_type: str) -> DeviceMesh | None:
        """For ``num_distributed_optimizer_instances > 1``: the (dp_outer, dp_shard) mesh over
        all ranks, ``num_distributed_optimizer_instances`` x the rest; else None (the default
        group). A collective."""
        if not self.is_hybrid:
            return None
        world = dist.get_world_size()
        outer = self.num_distributed_optimizer_instances
        if world % outer:
            raise ValueError(
                f"num_distributed_optimizer_instances={outer} does not divide the world size {world}: pick a divisor"
            )
        return init_device_mesh(device_type, (outer, world // outer), mesh_dim_names=(OUTER_DIM, SHARD_DIM))

    def fully_shard_kwargs(self, device_mesh: DeviceMesh | None = None) -> dict[str, Any]:
        """``fully_shard`` keyword arguments for this config (add ``fsdp_unit_modules``). With
        ``num_distributed_optimizer_instances > 1``, ``device_mesh`` must have dims named
        ``dp_outer`` (of that size) and ``dp_shard``, like :meth:`device_mesh` builds."""
        kwargs: dict[str, Any] = dict(
            zero_dp_strategy=ShardingStrategy.parse(self.data_parallel_sharding_strategy).label,
            overlap_grad_reduce=self.overlap_grad_reduce,
            overlap_param_gather=self.overlap_param_gather,
            mixed_precision_policy=self.mixed_precision_policy(),
            check_for_nan_in_grad=self.check_for_nan_in_grad,
            fsdp_double_buffer=self.fsdp_double_buffer,
            nccl_ub=self.nccl_ub,
            init_model_with_meta_device=self.init_model_with_meta_device,
            cpu_offload=self.cpu_offload,
        )
        if not self.is_hybrid:
            if device_mesh is not None:
                kwargs.update(device_mesh=device_mesh, dp_shard_dim=SHARD_DIM if device_mesh.ndim > 1 else None)
            return kwargs
        names = device_mesh.mesh_dim_names if device_mesh is not None else None
        if not names or OUTER_DIM not in names or SHARD_DIM not in names:
            raise ValueError(
                f"num_distributed_optimizer_instances={self.num_distributed_optimizer_instances} needs a device_mesh with "
                f"dims {OUTER_DIM!r} and {SHARD_DIM!r} (got {names}): pass config.device_mesh(device_type)"
            )
        if device_mesh[OUTER_DIM].size() != self.num_distributed_optimizer_instances:
            raise ValueError(
                f"the mesh's {OUTER_DIM!r} dim has {device_mesh[OUTER_DIM].size()} ranks but "
                f"num_distributed_optimizer_instances is {self.num_distributed_optimizer_instances}"
            )
        kwargs.update(
            device_mesh=device_mesh,
            dp_shard_dim=SHARD_DIM,
            dp_outer_dim=OUTER_DIM,
            outer_dp_sharding_strategy=ShardingStrategy.parse(self.outer_dp_sharding_strategy).label,
        )
        return kwargs


def ddp_config_from_settings(settings: FSDPSettings, dist_index: FSDPDistributedIndex) -> DistributedDataParallelConfig:
    """The config describing a model built by ``fully_shard_model`` (``MegatronFSDP.ddp_config``)."""
    outer = dist_index.data_parallel.outer
    policy = settings.mixed_precision
    return DistributedDataParallelConfig(
        data_parallel_sharding_strategy=settings.strategy.label,
        outer_dp_sharding_strategy="optim" if dist_index.hsdp_outer_dp_shard else "no_shard",
        num_distributed_optimizer_instances=outer.size if outer is not None else 1,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        overlap_param_gather=settings.overlap_param_gather,
        megatron_fsdp_main_params_dtype=policy.main_params_dtype,
        megatron_fsdp_main_grads_dtype=policy.main_grads_dtype,
        megatron_fsdp_grad_comm_dtype=policy.grad_comm_dtype,
        check_for_nan_in_grad=settings.check_for_nan_in_grad,
        fsdp_double_buffer=settings.fsdp_double_buffer,
        nccl_ub=settings.nccl_ub,
        cpu_offload=settings.cpu_offload,
    )
