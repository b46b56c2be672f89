"""Megatron-LM's command-line flags for Megatron-FSDP: added to a parser, turned into a
:class:`~megatron_fsdp.distributed_data_parallel_config.DistributedDataParallelConfig`, and back.

    parser = argparse.ArgumentParser()
    add_megatron_fsdp_args(parser)
    config = ddp_config_from_args(parser.parse_args())
    model, optimizer = fully_shard(model, optimizer, fsdp_unit_modules=[Block],
                                   **config.fully_shard_kwargs(config.device_mesh("cpu")))
"""

from __future__ import annotations

import argparse

import torch

from megatron_fsdp.distributed_data_parallel_config import DTYPE_NAMES, DistributedDataParallelConfig
from megatron_fsdp.engine.config import ShardingStrategy

CKPT_FORMATS = ("torch", "torch_dist", "zarr", "fsdp_dtensor")


def _dtype_name(dtype: torch.dtype | None) -> str:
    for name, value in DTYPE_NAMES.items():
        if value == dtype:
            return name
    raise ValueError(f"{dtype} has no Megatron-LM flag spelling (choices: {', '.join(DTYPE_NAMES)})")


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
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                       help="1 here; pipeline parallelism runs through megatron-core's install() (docs/megatron_lm.md)")
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
        # The config's mesh and fully_shard_kwargs span every rank as one data-parallel group: a
        # pipeline stage's group is a part of it, which only megatron-core's own groups give.
        raise ValueError(
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: ddp_config_from_args configures "
            "fully_shard over every rank as one data-parallel group, so it has no pipeline stages. Run pipeline "
            "parallelism through megatron-core on megatron_fsdp (megatron_fsdp.integrations.megatron_core.install(), "
            "or python -m megatron_fsdp.integrations.launch pretrain_gpt.py ...: docs/megatron_lm.md), or through "
            "torch.distributed.pipelining over stages sharded with megatron_fsdp.fsdp2.fully_shard (docs/fsdp2.md); "
            "here pass --pipeline-model-parallel-size 1"
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
