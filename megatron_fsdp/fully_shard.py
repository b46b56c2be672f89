"""The public entry points: fully_shard, fully_shard_model and fully_shard_optimizer."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import OffloadPolicy

from megatron_fsdp.engine.config import ShardingStrategy
from megatron_fsdp.engine.groups.distributed_index import FSDPDistributedIndex
from megatron_fsdp.engine.planning.argument_types import check_argument_types
from megatron_fsdp.engine.planning.plan import (
    check_strategies,
    check_timeout,
    check_upstream_options,
    plan_sharding,
    resolve_offload,
    resolve_policy,
)
from megatron_fsdp.engine.planning.transformer_engine_refusal import refuse_transformer_engine
from megatron_fsdp.megatron_fsdp import MegatronFSDP
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.optim.optimizer import distribute_optimizer


def fully_shard_model(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None,
    fsdp_group_ag: dist.ProcessGroup | None = None,
    expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    fsdp_unit_modules: Sequence[type | str] | None = None,
    zero_dp_strategy: int | str = "optim_grads_params",
    outer_dp_sharding_strategy: int | str = "no_shard",
    device: torch.device | str | None = None,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    report_nan_in_param_grad: bool = False,
    average_in_collective: bool = False,
    disable_bucketing: bool = False,
    calculate_per_token_loss: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    disable_symmetric_registration: bool = False,
    enable_fine_grained_param_gather: bool = False,
    use_decoupled_grad: bool = False,
    cuda_graph_mode: bool = False,
    maxpool_double_buffer: bool = False,
    grad_reduce_in_fp32: bool | None = None,
    preserve_fp32_weights: bool | None = None,
    check_for_nan_in_grad: bool = False,
    collective_timeout: float | None = None,
    cpu_offload: bool = False,
    offload_policy: OffloadPolicy | None = None,
) -> MegatronFSDP:
    """Shards ``module`` over the data-parallel group and returns the :class:`MegatronFSDP`
    wrapper. The keywords are upstream megatron-fsdp 0.6's, in its order, then megatron_fsdp's
    own; docs/api.md describes each and docs/migration.md what differs from upstream. The
    essentials:

    - ``fsdp_unit_modules``: classes (or import paths) whose instances are gathered and
      resharded as one unit; required for strategies 1..3.
    - ``zero_dp_strategy``: 0/``no_shard``, 1/``optim``, 2/``optim_grads`` or
      3/``optim_grads_params`` (default).
    - ``device_mesh`` + ``dp_shard_dim``: the mesh dim to shard over; without a mesh, the
      default process group.
    - ``dp_outer_dim`` (HSDP): a mesh dim that replicates the shards; gradients are reduced
      over dp_shard each micro-batch and averaged over dp_outer when synced.
      ``outer_dp_sharding_strategy``: ``no_shard`` (default) or ``optim`` (HFSDP: the optimizer
      state is sharded across dp_outer too; needs ``optim_grads_params``).
      ``hybrid_fsdp_group`` (optional): the flattened (dp_outer, dp_shard) group, checked for size.
    - ``tp_dim``: the mesh dim a tensor-parallel model was parallelised on; its DTensor
      parameters' local tensors are sharded over dp_shard (docs/parallelism.md).
    - ``expt_device_mesh``: expert parameters (``param.allreduce = False``) get their own buckets,
      sharded over ``expt_device_mesh[dp_shard_dim]``; their gradients are divided by the dense
      data-parallel size.
    - ``sync_model_each_microbatch`` (default True): each backward finishes its gradient
      reductions and shows the gradients as ``param.grad``; False (or
      ``model.set_model_auto_sync(False)``) leaves both to the synchronising micro-batch,
      ``finish_grad_sync()`` or the optimizer step, and strategies 0/1 accumulate locally until then.
    - ``init_model_with_meta_device``: the model was built under ``torch.device("meta")``; each
      module is materialised on ``device`` (default: the current CUDA device, else the CPU) and initialised with its
      ``reset_parameters()``, and each unit is sharded as soon as it is initialised.
    - ``mixed_precision_policy``: see :class:`MixedPrecisionPolicy`; ``grad_reduce_in_fp32`` and
      ``preserve_fp32_weights`` are its deprecated predecessors.
    - ``calculate_per_token_loss``: gradients are summed over data-parallel ranks instead of
      averaged (the loss is divided by the global token count, or ``scale_gradients`` scales).
    - ``average_in_collective``: accepted; gradients are averaged either way.
    - ``use_decoupled_grad=True`` is refused (gradients are ``param.grad``);
      ``maxpool_double_buffer`` turns on ``fsdp_double_buffer``; ``disable_bucketing``,
      ``keep_fp8_transpose_cache``, ``fsdp_db_use_persist_buf_on_alloc_fail``,
      ``disable_symmetric_registration``, ``enable_fine_grained_param_gather`` and
      ``cuda_graph_mode`` tune performance only and have no effect.
    - ``hybrid_fsdp_expt_group``, ``fsdp_group_ag``, ``expt_fsdp_group_ag``: see
      :class:`FSDPDistributedIndex`.
    - ``check_for_nan_in_grad``: raise, naming the step, when reduced gradients hold NaN/Inf.
    - ``report_nan_in_param_grad``: raise at the end of backward, naming every parameter whose
      local gradient holds NaN/Inf and the ranks where it does (one device check per gradient).
    - ``fsdp_double_buffer``: temporary buckets live in persistent blocks, two per bucket role,
      whose addresses never change after the first step.
    - ``nccl_ub``: also moves those blocks into NCCL memory after the first optimizer step and
      registers them with the data-parallel communicators (implies ``fsdp_double_buffer``);
      without CUDA/NCCL support it logs why and runs unregistered.
    - ``collective_timeout``: seconds (> 0) a wait for a unit's all-gather or a bucket's
      reduction may take before it raises naming the unit and bucket; None (default): the
      process group's timeout (``init_process_group(timeout=...)``) does, and its error is
      re-raised with the same names. Bounds CPU (gloo) waits; on CUDA a wait only orders
      streams, and NCCL's watchdog with the process group's timeout catches a hang.
    - ``cpu_offload`` (default False), or FSDP2's ``offload_policy=CPUOffloadPolicy(pin_memory=True)``
      (``torch.distributed.fsdp``; ``OffloadPolicy()`` means no offloading): each rank's main
      parameters, the gradients the optimizer reads and the optimizer state live in host memory
      and the optimizer steps there (torch.optim.Adam/AdamW/SGD through megatron_fsdp's host
      op, any other optimizer through its own step); compute weights and gathered buckets stay
      on the device. ``pin_memory=False`` leaves the transfer buffers pageable. See
      docs/offloading.md.

    Before any collective, the ranks check that they shard the same model the same way and
    all raise the same ``ValueError`` if not (megatron_fsdp/engine/planning/consistency.py).
    """
    check_argument_types(locals())
    _check_not_wrapped(module)
    check_timeout(collective_timeout)
    check_upstream_options(
        use_decoupled_grad, disable_bucketing=disable_bucketing,
        keep_fp8_transpose_cache=keep_fp8_transpose_cache,
        fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
        disable_symmetric_registration=disable_symmetric_registration,
        enable_fine_grained_param_gather=enable_fine_grained_param_gather, cuda_graph_mode=cuda_graph_mode,
    )
    strategy, outer, unit_classes = check_strategies(
        zero_dp_strategy, outer_dp_sharding_strategy, fsdp_unit_modules, dp_outer_dim
    )
    dist_index = FSDPDistributedIndex(
        device_mesh=device_mesh, dp_shard_dim=dp_shard_dim, dp_outer_dim=dp_outer_dim, tp_dim=tp_dim,
        hybrid_fsdp_group=hybrid_fsdp_group, hybrid_fsdp_expt_group=hybrid_fsdp_expt_group,
        hsdp_outer_dp_shard=outer is ShardingStrategy.OPTIM, expt_device_mesh=expt_device_mesh,
        fsdp_group_ag=fsdp_group_ag, expt_fsdp_group_ag=expt_fsdp_group_ag,
    )
    settings = dict(
        mixed_precision=resolve_policy(mixed_precision_policy, grad_reduce_in_fp32, preserve_fp32_weights),
        check_for_nan_in_grad=check_for_nan_in_grad,
        report_nan_in_param_grad=report_nan_in_param_grad,
        preproc_state_dict_for_dcp_ckpt=preproc_state_dict_for_dcp_ckpt,
        sync_model_each_microbatch=sync_model_each_microbatch,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        fsdp_double_buffer=fsdp_double_buffer or nccl_ub or maxpool_double_buffer,  # user buffers must stay put
        nccl_ub=nccl_ub,
        calculate_per_token_loss=calculate_per_token_loss,
        collective_timeout=None if collective_timeout is None else float(collective_timeout),
        **resolve_offload(cpu_offload, offload_policy),
    )
    plan = plan_sharding(module, dist_index, strategy, outer, unit_classes, device, init_model_with_meta_device, settings)
    return MegatronFSDP.from_plan(module, plan)


def _check_not_wrapped(module: nn.Module) -> None:
    """Refuses, before any collective, a model that something already distributes, or that
    holds Transformer Engine modules."""
    refuse_transformer_engine(module)
    if isinstance(module, MegatronFSDP):
        raise ValueError(
            "this model is already sharded by megatron_fsdp: shard a model once, and train the model fully_shard returned"
        )
    if isinstance(module, nn.parallel.DistributedDataParallel) or getattr(module, "_is_accelerate_prepared", False):
        raise ValueError(
            f"this {type(module).__name__} went through accelerator.prepare (or DistributedDataParallel) before "
            "fully_shard: shard the plain model first, then prepare the sharded one, e.g. "
            "model, optimizer = fully_shard(model, optimizer, ...); model, optimizer, dataloader = "
            "accelerator.prepare(model, optimizer, dataloader)"
        )


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    model: MegatronFSDP | None = None,
) -> torch.optim.Optimizer:
    """Makes ``optimizer`` step only this rank's main-parameter shard (see
    :func:`megatron_fsdp.optim.optimizer.distribute_optimizer`), in place, and returns it.

    - ``preproc_state_dict_for_dcp_ckpt`` (upstream's keyword, default True): accepted; the
      optimizer's state dict is ready for ``torch.distributed.checkpoint`` either way (it
      follows the model's own ``preproc_state_dict_for_dcp_ckpt``).
    - ``model``: the MegatronFSDP owning the optimizer's parameters; found from them when
      omitted. megatron_fsdp 0.1's positional form ``fully_shard_optimizer(optimizer, model)``
      still works.
    - ``optimizer`` may be a wrapper holding the optimizer as ``.optimizer`` (Accelerate's
      ``AcceleratedOptimizer``): that optimizer is sharded and the wrapper returned.
    """
    if isinstance(preproc_state_dict_for_dcp_ckpt, MegatronFSDP) and model is None:
        model, preproc_state_dict_for_dcp_ckpt = preproc_state_dict_for_dcp_ckpt, True
    if not isinstance(preproc_state_dict_for_dcp_ckpt, bool):
        raise TypeError(f"preproc_state_dict_for_dcp_ckpt must be True or False, got {preproc_state_dict_for_dcp_ckpt!r}")
    # A wrapper that steps an optimizer it holds as ``.optimizer`` (Accelerate's
    # AcceleratedOptimizer, after accelerator.prepare) is returned as it is, its optimizer sharded.
    inner = getattr(optimizer, "optimizer", None)
    sharded = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
    if model is None:
        model = _owning_model(sharded)
    distribute_optimizer(sharded, model)
    return optimizer


def _owning_model(optimizer: torch.optim.Optimizer) -> MegatronFSDP:
    owners = {
        id(owner): owner
        for group in optimizer.param_groups
        for param in group["params"]
        if (owner := _owner_of(param)) is not None
    }
    if len(owners) != 1:
        raise ValueError(
            "cannot tell which sharded model this optimizer belongs to; pass it: fully_shard_optimizer(optimizer, model=model)"
        )
    return next(iter(owners.values()))


def _owner_of(param: torch.Tensor) -> MegatronFSDP | None:
    # A face carries upstream's back-reference (clients such as NeMo Automodel also set it); a
    # model parameter, megatron_fsdp's weak one.
    owner = getattr(param, "_megatron_fsdp_model", None)
    if isinstance(owner, MegatronFSDP):
        return owner
    owner_ref = getattr(param, "_megatron_fsdp_owner", None)
    return owner_ref() if owner_ref is not None else None


def fully_shard(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *args: Any,
    **kwargs: Any,
) -> tuple[MegatronFSDP, torch.optim.Optimizer | None]:
    """``fully_shard_model(module, *args, **kwargs)`` then, when given, ``fully_shard_optimizer``:
    returns ``(model, optimizer)``. The optimizer
    keeps its param groups and hyper-parameters (upstream 0.6.1 replaces them with one group of
    every parameter)."""
    # Meta-device init replaces the parameter objects an optimizer built before was given: its
    # groups are pointed, by name, at the materialised parameters' faces.
    names = {id(p): name for name, p in module.named_parameters()}
    model = fully_shard_model(module, *args, **kwargs)
    if optimizer is not None:
        if model.meta_init_peak_bytes is not None:
            faces = dict(model.named_parameters())
            for group in optimizer.param_groups:
                group["params"] = [faces[names[id(p)]] if id(p) in names else p for p in group["params"]]
        optimizer = fully_shard_optimizer(optimizer, model=model)
    return model, optimizer


# What introspection (help(), IDEs, inspect.signature) shows: every keyword of fully_shard_model.
fully_shard.__signature__ = inspect.Signature(
    [
        *list(inspect.signature(fully_shard_model).parameters.values())[:1],
        inspect.Parameter("optimizer", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        *list(inspect.signature(fully_shard_model).parameters.values())[1:],
    ],
    return_annotation=inspect.signature(fully_shard).return_annotation,
)
