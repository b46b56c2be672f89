"""The public entry points: fully_shard, fully_shard_model and fully_shard_optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp.argument_types import check_argument_types
from megatron_fsdp.config import FSDPSettings, MixedPrecisionPolicy, ShardingStrategy
from megatron_fsdp.consistency import check_same_configuration_on_all_ranks, describe_configuration
from megatron_fsdp.dtensor_params import check_parallel_params
from megatron_fsdp.mesh import resolve_dp_shard_group, resolve_expert_group, resolve_outer_group, submesh
from megatron_fsdp.module import MegatronFSDP
from megatron_fsdp.optimizer import distribute_optimizer
from megatron_fsdp.units import resolve_unit_classes

def _check_meta_params(module: nn.Module, meta_init: bool) -> None:
    """Before the model is moved anywhere: meta tensors cannot be copied to a device."""
    devices = {p.device for p in module.parameters()}
    if any(d.type == "meta" for d in devices) and not meta_init:
        raise ValueError("the model has parameters on the meta device: pass init_model_with_meta_device=True")
    if meta_init and devices - {torch.device("meta")}:
        raise ValueError("init_model_with_meta_device=True needs every parameter on the meta device")


def _module_device(module: nn.Module, meta_init: bool) -> torch.device:
    devices = {p.device for p in module.parameters()}
    if meta_init:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are spread over {sorted(map(str, devices))}; move it to one device first")
    return next(iter(devices), torch.device("cpu"))


def _resolve_policy(
    policy: MixedPrecisionPolicy | None, grad_reduce_in_fp32: bool | None, preserve_fp32_weights: bool | None
) -> MixedPrecisionPolicy:
    """The policy, or one built from the deprecated flags (with a DeprecationWarning)."""
    legacy = {"grad_reduce_in_fp32": grad_reduce_in_fp32, "preserve_fp32_weights": preserve_fp32_weights}
    given = [name for name, value in legacy.items() if value is not None]
    if not given:
        return policy or MixedPrecisionPolicy()
    if policy is not None:
        raise ValueError(f"pass either mixed_precision_policy or {' / '.join(given)}, not both")
    warnings.warn(
        f"{' and '.join(given)} are deprecated: use mixed_precision_policy=MixedPrecisionPolicy("
        "main_params_dtype=..., main_grads_dtype=..., grad_comm_dtype=...)",
        DeprecationWarning,
        stacklevel=3,
    )
    return MixedPrecisionPolicy(
        main_params_dtype=torch.float32 if preserve_fp32_weights in (None, True) else None,
        main_grads_dtype=torch.float32 if grad_reduce_in_fp32 else None,
    )


def fully_shard_model(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None,
    fsdp_unit_modules: Sequence[type | str] | None = None,
    zero_dp_strategy: int | str = "optim_grads_params",
    outer_dp_sharding_strategy: int | str = "no_shard",
    device: torch.device | str | None = None,
    init_model_with_meta_device: bool = False,
    grad_reduce_in_fp32: bool | None = None,
    preserve_fp32_weights: bool | None = None,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    check_for_nan_in_grad: bool = False,
    report_nan_in_param_grad: bool = False,
    fsdp_double_buffer: bool = False,
    nccl_ub: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    collective_timeout: float | None = None,
) -> MegatronFSDP:
    """Shards ``module`` over the data-parallel group and returns the :class:`MegatronFSDP`
    wrapper. See docs/api.md for every argument; the essentials:

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
      ``hybrid_fsdp_group``: optional, the flattened (dp_outer, dp_shard) group, checked for size.
    - ``tp_dim``: the mesh dim a tensor-parallel model was parallelised on; its DTensor
      parameters' local tensors are sharded over dp_shard (docs/parallelism.md).
    - ``expt_device_mesh``: expert parameters (``param.allreduce = False``) get their own buckets,
      sharded over ``expt_device_mesh[dp_shard_dim]``; their gradients are divided by the dense
      data-parallel size.
    - ``sync_model_each_microbatch`` (default True): finish every gradient reduction at the end
      of each backward; False leaves that to ``finish_grad_sync()`` / the optimizer step.
    - ``init_model_with_meta_device``: the model was built under ``torch.device("meta")``; each
      module is materialised on the current CUDA device (else the CPU) and initialised with its
      ``reset_parameters()``, and each unit is sharded as soon as it is initialised.
    - ``mixed_precision_policy``: see :class:`MixedPrecisionPolicy`; ``grad_reduce_in_fp32`` and
      ``preserve_fp32_weights`` are its deprecated predecessors.
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

    Before any collective, the ranks check that they shard the same model the same way and
    all raise the same ``ValueError`` if not (megatron_fsdp/consistency.py).
    """
    check_argument_types(locals())
    _check_timeout(collective_timeout)
    strategy = ShardingStrategy.parse(zero_dp_strategy)
    unit_classes = resolve_unit_classes(fsdp_unit_modules)
    if strategy is not ShardingStrategy.NO_SHARD and not unit_classes:
        raise ValueError(
            f"zero_dp_strategy={strategy.label!r} needs fsdp_unit_modules: pass the classes of the blocks to "
            "shard as units, e.g. fsdp_unit_modules=[MyTransformerBlock]"
        )
    outer_strategy = _check_outer_strategy(outer_dp_sharding_strategy, strategy, dp_outer_dim)
    if isinstance(module, MegatronFSDP):
        raise ValueError("this model is already sharded by megatron_fsdp")
    dp = resolve_dp_shard_group(device_mesh, dp_shard_dim)
    if dp_outer_dim is not None:
        shards_optimizer = outer_strategy is ShardingStrategy.OPTIM
        dp = resolve_outer_group(dp, device_mesh, dp_outer_dim, hybrid_fsdp_group, shards_optimizer)
    if expt_device_mesh is not None:
        dp = resolve_expert_group(dp, expt_device_mesh, dp_shard_dim)
    _check_tensor_parallel(module, device_mesh, tp_dim, expt_device_mesh, init_model_with_meta_device)
    if tp_dim is not None:
        # Plain parameters of a tensor-parallel model are replicated over its tp dims.
        dp = dataclasses.replace(dp, model_parallel_dims=tuple(submesh(device_mesh, tp_dim, "tp_dim").mesh_dim_names))
    _check_meta_params(module, init_model_with_meta_device)
    if device is not None and not init_model_with_meta_device:
        module.to(device)
    compute_device = _module_device(module, init_model_with_meta_device)
    policy = _resolve_policy(mixed_precision_policy, grad_reduce_in_fp32, preserve_fp32_weights)
    settings = FSDPSettings(
        strategy=strategy,
        mixed_precision=policy,
        check_for_nan_in_grad=check_for_nan_in_grad,
        report_nan_in_param_grad=report_nan_in_param_grad,
        preproc_state_dict_for_dcp_ckpt=preproc_state_dict_for_dcp_ckpt,
        sync_model_each_microbatch=sync_model_each_microbatch,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        fsdp_double_buffer=fsdp_double_buffer or nccl_ub,  # user buffers must stay put
        nccl_ub=nccl_ub,
        collective_timeout=None if collective_timeout is None else float(collective_timeout),
    )
    description = describe_configuration(module, settings, unit_classes, dp)
    check_same_configuration_on_all_ranks(description, dp, settings.collective_timeout)
    return MegatronFSDP(module, dp, settings, unit_classes, compute_device if init_model_with_meta_device else None)


def _check_timeout(collective_timeout: float | None) -> None:
    if collective_timeout is None:
        return
    is_number = isinstance(collective_timeout, (int, float)) and not isinstance(collective_timeout, bool)
    if not is_number or not 0 < collective_timeout < float("inf"):
        raise ValueError(f"collective_timeout must be None or a number of seconds > 0, got {collective_timeout!r}")


def _check_tensor_parallel(
    module: nn.Module,
    device_mesh: DeviceMesh | None,
    tp_dim: str | None,
    expt_device_mesh: DeviceMesh | None,
    meta_init: bool,
) -> None:
    tp_mesh = None
    if tp_dim is not None:
        if device_mesh is None:
            raise ValueError(f"tp_dim={tp_dim!r} needs a device_mesh holding that dim")
        tp_mesh = submesh(device_mesh, tp_dim, "tp_dim")
    if meta_init and (tp_mesh is not None or expt_device_mesh is not None):
        raise ValueError(
            "init_model_with_meta_device=True cannot be combined with tensor- or expert-parallel DTensor "
            "parameters yet: materialise the model before tensor-parallelising it"
        )
    check_parallel_params(module, tp_mesh, expt_device_mesh is not None)


def _check_outer_strategy(value: int | str, strategy: ShardingStrategy, dp_outer_dim: str | None) -> ShardingStrategy:
    outer = ShardingStrategy.parse(value, "outer_dp_sharding_strategy")
    if outer not in (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM):
        raise ValueError(
            f"outer_dp_sharding_strategy={outer.label!r} is not supported: use no_shard (replicate across "
            "dp_outer, HSDP) or optim (also shard the optimizer state across it, HFSDP)"
        )
    if outer is ShardingStrategy.OPTIM:
        if dp_outer_dim is None:
            raise ValueError("outer_dp_sharding_strategy='optim' needs dp_outer_dim (and a device_mesh holding it)")
        if strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
            raise ValueError(
                f"outer_dp_sharding_strategy='optim' requires zero_dp_strategy='optim_grads_params', got {strategy.label!r}"
            )
    return outer


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, model: MegatronFSDP | None = None) -> torch.optim.Optimizer:
    """Makes ``optimizer`` step only this rank's main-parameter shard (see
    :func:`megatron_fsdp.optimizer.distribute_optimizer`). ``model`` defaults to the
    MegatronFSDP that owns the optimizer's parameters."""
    if model is None:
        model = _owning_model(optimizer)
    return distribute_optimizer(optimizer, model)


def _owning_model(optimizer: torch.optim.Optimizer) -> MegatronFSDP:
    owners = {
        id(owner): owner
        for group in optimizer.param_groups
        for param in group["params"]
        if (owner := _owner_of(param)) is not None
    }
    if len(owners) != 1:
        raise ValueError(
            "cannot tell which sharded model this optimizer belongs to; pass it: fully_shard_optimizer(optimizer, model)"
        )
    return next(iter(owners.values()))


def _owner_of(param: torch.Tensor) -> MegatronFSDP | None:
    owner_ref = getattr(param, "_megatron_fsdp_owner", None)
    return owner_ref() if owner_ref is not None else None


def fully_shard(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    **kwargs: Any,
) -> tuple[MegatronFSDP, torch.optim.Optimizer | None]:
    """``fully_shard_model(module, **kwargs)`` then, when given, ``fully_shard_optimizer``:
    returns ``(model, optimizer)``."""
    model = fully_shard_model(module, **kwargs)
    if optimizer is not None:
        optimizer = distribute_optimizer(optimizer, model)
    return model, optimizer
