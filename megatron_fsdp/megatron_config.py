"""Megatron-LM's way in: the ``DistributedDataParallelConfig`` fields and command-line flags
that Megatron-LM users set for Megatron-FSDP, validated and mapped onto ``fully_shard``.

    parser = argparse.ArgumentParser()
    add_megatron_fsdp_args(parser)
    config = ddp_config_from_args(parser.parse_args())
    model, optimizer = fully_shard(model, optimizer, fsdp_unit_modules=[Block],
                                   **config.fully_shard_kwargs(config.device_mesh("cpu")))
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_fsdp.config import FSDPSettings, MixedPrecisionPolicy, ShardingStrategy
from megatron_fsdp.distributed_index import FSDPDistributedIndex

# Megatron-LM's dtype spellings; "auto" is None: the model's compute dtype (for main grads and
# main params) or the main-gradient dtype (for communication).
DTYPE_NAMES: dict[str, torch.dtype | None] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "auto": None,
}
OUTER_DIM, SHARD_DIM = "dp_outer", "dp_shard"
CKPT_FORMATS = ("torch", "torch_dist", "zarr", "fsdp_dtensor")


def _dtype_name(dtype: torch.dtype | None) -> str:
    for name, value in DTYPE_NAMES.items():
        if value == dtype:
            return name
    raise ValueError(f"{dtype} has no Megatron-LM flag spelling (choices: {', '.join(DTYPE_NAMES)})")


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
                "megatron_fsdp_use_decoupled_grad=True is for Transformer Engine's FusedAdam(use_decoupled_grad=True); "
                "megatron_fsdp shows reduced gradients as param.grad: set it to False"
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


def add_megatron_fsdp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds Megatron-LM's Megatron-FSDP flags (their names, choices and meanings) to
    ``parser`` in a group of their own; returns the parser. Defaults follow
    :class:`DistributedDataParallelConfig`, except ``--ckpt-format`` (``fsdp_dtensor``, the only
    format a Megatron-FSDP model saves) and ``--check-for-nan-in-loss-and-grad`` (on, as in
    Megatron-LM; ``--no-check-for-nan-in-loss-and-grad`` turns it off)."""
    group = parser.add_argument_group("megatron-fsdp")
    strategies = ("no_shard", "optim", "optim_grads", "optim_grads_params")
    group.add_argument("--use-megatron-fsdp", action="store_true", help="shard data parallelism with megatron_fsdp")
    group.add_argument("--use-torch-fsdp2", action="store_true", help="torch FSDP2 instead (mutually exclusive with --use-megatron-fsdp)")
    group.add_argument("--data-parallel-sharding-strategy", choices=strategies, default="optim_grads_params",
                       help="what is sharded across the data-parallel group (ZeRO 0..3)")
    group.add_argument("--outer-dp-sharding-strategy", choices=("no_shard", "optim"), default="no_shard",
                       help="across the outer group: replicate (HSDP) or shard the optimizer state too (HFSDP)")
    group.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                       help="outer data-parallel size; > 1 forms a (dp_outer, dp_shard) mesh")
    dtypes = tuple(DTYPE_NAMES)
    group.add_argument("--megatron-fsdp-main-params-dtype", choices=dtypes, default="fp32",
                       help="dtype of the main weights the optimizer steps; auto = the compute dtype")
    group.add_argument("--megatron-fsdp-main-grads-dtype", choices=dtypes, default="auto",
                       help="dtype gradients accumulate in; auto = the compute dtype")
    group.add_argument("--megatron-fsdp-grad-comm-dtype", choices=dtypes, default="auto",
                       help="dtype gradients travel in; auto = the main-gradient dtype")
    group.add_argument("--overlap-grad-reduce", action="store_true", help="reduce gradients asynchronously during backward")
    group.add_argument("--overlap-param-gather", action="store_true", help="prefetch the next unit's weights during compute")
    group.add_argument("--fsdp-double-buffer", action="store_true", help="two persistent pool blocks per bucket shape")
    group.add_argument("--use-nccl-ub", action="store_true", help="NCCL user-buffer registration (implies --fsdp-double-buffer)")
    group.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                       help="raise naming the step when reduced gradients hold NaN/Inf")
    group.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="fsdp_dtensor",
                       help="checkpoint format; Megatron-FSDP saves fsdp_dtensor (DTensor state dicts through DCP)")
    group.add_argument("--init-model-with-meta-device", action="store_true",
                       help="the model is built on the meta device and initialised unit by unit while sharding")
    group.add_argument("--cpu-offloading", action="store_true",
                       help="main params, optimizer state and the step on the host (fully_shard(cpu_offload=True)); "
                       "Megatron Bridge's rules: pipeline-parallel size 1, no recomputation")
    if "--clip-grad" not in parser._option_string_actions:  # Megatron-LM's own parser already has it
        group.add_argument("--clip-grad", type=float, default=1.0,
                           help="clip the global gradient norm to this with megatron_fsdp.clip_grad_norm_; 0 turns it off")
    # Present for the validity checks Megatron-LM makes together with Megatron-FSDP.
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                       help="activation recomputation")
    return parser


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The config from flags parsed by a parser given :func:`add_megatron_fsdp_args`; raises
    ``ValueError`` naming the offending flags and how to fix them."""
    if args.use_megatron_fsdp and args.use_torch_fsdp2:
        raise ValueError("--use-megatron-fsdp and --use-torch-fsdp2 are mutually exclusive: pass only one")
    if not args.use_megatron_fsdp:
        raise ValueError("these flags configure Megatron-FSDP: pass --use-megatron-fsdp")
    if args.ckpt_format != "fsdp_dtensor":
        raise ValueError(
            f"--ckpt-format {args.ckpt_format} cannot save a Megatron-FSDP model: pass --ckpt-format fsdp_dtensor "
            "(DTensor state dicts written with torch.distributed.checkpoint)"
        )
    if args.cpu_offloading and args.pipeline_model_parallel_size != 1:
        raise ValueError(
            f"--cpu-offloading works only without pipeline parallelism, got --pipeline-model-parallel-size "
            f"{args.pipeline_model_parallel_size}: drop one of them"
        )
    if args.cpu_offloading and args.recompute_granularity is not None:
        raise ValueError(
            f"--cpu-offloading works only without activation recomputation, got --recompute-granularity "
            f"{args.recompute_granularity}: drop one of them"
        )
    if args.pipeline_model_parallel_size != 1:
        raise NotImplementedError(
            "megatron_fsdp shards data parallelism only; pipeline parallelism needs Megatron-LM: "
            "use --pipeline-model-parallel-size 1"
        )
    return DistributedDataParallelConfig(
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        megatron_fsdp_main_params_dtype=DTYPE_NAMES[args.megatron_fsdp_main_params_dtype],
        megatron_fsdp_main_grads_dtype=DTYPE_NAMES[args.megatron_fsdp_main_grads_dtype],
        megatron_fsdp_grad_comm_dtype=DTYPE_NAMES[args.megatron_fsdp_grad_comm_dtype],
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        fsdp_double_buffer=args.fsdp_double_buffer,
        nccl_ub=args.use_nccl_ub,
        init_model_with_meta_device=args.init_model_with_meta_device,
        cpu_offload=args.cpu_offloading,
    )


def args_from_ddp_config(config: DistributedDataParallelConfig) -> list[str]:
    """The command-line flags that :func:`ddp_config_from_args` turns back into ``config``
    (for launch scripts and logs). Deprecated fields are written as the dtype flags."""
    policy = config.mixed_precision_policy()
    flags = [
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy", ShardingStrategy.parse(config.data_parallel_sharding_strategy).label,
        "--outer-dp-sharding-strategy", ShardingStrategy.parse(config.outer_dp_sharding_strategy).label,
        "--num-distributed-optimizer-instances", str(config.num_distributed_optimizer_instances),
        "--megatron-fsdp-main-params-dtype", _dtype_name(policy.main_params_dtype),
        "--megatron-fsdp-main-grads-dtype", _dtype_name(policy.main_grads_dtype),
        "--megatron-fsdp-grad-comm-dtype", _dtype_name(policy.grad_comm_dtype),
        "--check-for-nan-in-loss-and-grad" if config.check_for_nan_in_grad else "--no-check-for-nan-in-loss-and-grad",
    ]
    switches = {
        "--overlap-grad-reduce": config.overlap_grad_reduce,
        "--overlap-param-gather": config.overlap_param_gather,
        "--fsdp-double-buffer": config.fsdp_double_buffer,
        "--use-nccl-ub": config.nccl_ub,
        "--init-model-with-meta-device": config.init_model_with_meta_device,
        "--cpu-offloading": config.cpu_offload,
    }
    return flags + [flag for flag, on in switches.items() if on]


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
