"""From checked arguments to what a MegatronFSDP is built from (a :class:`ShardingPlan`).

Both ways in meet here: ``fully_shard_model``'s keywords and ``MegatronFSDP``'s upstream
constructor (``dist_index``, ``ddp_config``, ...). Everything is validated before any collective
except the last check, the one collective that makes sure every rank plans the same thing.
Upstream keywords for features megatron_fsdp does not have are settled here too: accepted where
they cannot change what is trained, refused with the reason where they would.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.distributed.tensor import DTensor

from megatron_fsdp.engine.config import FSDPSettings, ShardingStrategy
from megatron_fsdp.engine.groups.distributed_index import FSDPDistributedIndex
from megatron_fsdp.engine.groups.mesh import submesh
from megatron_fsdp.engine.params.dtensor_params import check_parallel_params, is_expert_param, mark_experts_by_name
from megatron_fsdp.engine.planning.consistency import check_same_configuration_on_all_ranks, describe_configuration
from megatron_fsdp.engine.planning.memory_check import check_device_memory
from megatron_fsdp.engine.step.units import resolve_unit_classes
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardingPlan:
    """What :class:`megatron_fsdp.MegatronFSDP` builds: groups, settings, units, the device to
    materialise a meta-device model on (None: the model is already materialised), and the device
    the buffers live on (that one, or where the model is)."""

    dist_index: FSDPDistributedIndex
    settings: FSDPSettings
    unit_classes: tuple[type, ...]
    meta_init_device: torch.device | None
    buffers_device: torch.device


def check_upstream_options(use_decoupled_grad: bool = False, **performance_only: bool) -> None:
    """Settles upstream-only keywords: ``use_decoupled_grad=True`` raises ``ValueError``; the
    ones tuning memory, overlap, NCCL registration, CUDA graphs or Transformer Engine FP8 caches
    (``disable_bucketing``, ``keep_fp8_transpose_cache``, ``fsdp_db_use_persist_buf_on_alloc_fail``,
    ``disable_symmetric_registration``, ``enable_fine_grained_param_gather``, ``cuda_graph_mode``)
    cannot change the values trained and are accepted (logged when set: they do nothing here)."""
    if use_decoupled_grad:
        raise ValueError(
            "use_decoupled_grad=True (megatron_fsdp_use_decoupled_grad, which Megatron-LM sets from "
            "--use-precision-aware-optimizer) puts reduced gradients in param.decoupled_grad for Transformer "
            "Engine's FusedAdam(use_decoupled_grad=True); megatron_fsdp shows them as param.grad (DTensors) for "
            "any torch optimizer: set use_decoupled_grad=False (in Megatron-LM, drop --use-precision-aware-optimizer)"
        )
    for name, value in performance_only.items():
        if value:
            logger.info("megatron_fsdp: %s=True has no effect here (it tunes performance only)", name)


def resolve_policy(
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
        stacklevel=4,
    )
    return MixedPrecisionPolicy(
        main_params_dtype=torch.float32 if preserve_fp32_weights in (None, True) else None,
        main_grads_dtype=torch.float32 if grad_reduce_in_fp32 else None,
    )


def resolve_offload(cpu_offload: bool, offload_policy: OffloadPolicy | None) -> dict[str, bool]:
    """The offload settings from ``cpu_offload`` and/or FSDP2's ``offload_policy``
    (``CPUOffloadPolicy(pin_memory=...)`` offloads, ``OffloadPolicy()`` does not); they may not
    contradict each other."""
    if offload_policy is None:
        return {"cpu_offload": cpu_offload, "offload_pin_memory": True}
    offloads = isinstance(offload_policy, CPUOffloadPolicy)
    if cpu_offload and not offloads:
        raise ValueError(
            f"cpu_offload=True contradicts offload_policy={offload_policy!r} (no offloading): pass only one, "
            "e.g. offload_policy=CPUOffloadPolicy(pin_memory=True)"
        )
    return {"cpu_offload": offloads, "offload_pin_memory": offloads and offload_policy.pin_memory}


def check_outer_strategy(value: int | str, strategy: ShardingStrategy, dp_outer_dim: str | None) -> ShardingStrategy:
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


def check_timeout(collective_timeout: float | None) -> None:
    if collective_timeout is None:
        return
    is_number = isinstance(collective_timeout, (int, float)) and not isinstance(collective_timeout, bool)
    if not is_number or not 0 < collective_timeout < float("inf"):
        raise ValueError(f"collective_timeout must be None or a number of seconds > 0, got {collective_timeout!r}")


def _check_tensor_parallel(module: nn.Module, dist_index: FSDPDistributedIndex, meta_init: bool) -> None:
    tp_mesh = None
    if dist_index.tp_dim is not None:
        tp_mesh = submesh(dist_index.device_mesh, dist_index.tp_dim, "tp_dim")
    expert_mesh_given = dist_index.expt_device_mesh is not None
    if expert_mesh_given:
        mark_experts_by_name(module)
    if meta_init:
        # A named tp dim alone is fine (plain parameters are replicated over it); what meta-device
        # init cannot do yet is materialise a DTensor's or an expert's local piece.
        parallel = [n for n, p in module.named_parameters() if isinstance(p, DTensor) or is_expert_param(p)]
        if parallel or expert_mesh_given:
            raise ValueError(
                "init_model_with_meta_device=True cannot be combined with tensor- or expert-parallel parameters "
                f"yet ({', '.join(parallel[:3]) or 'expt_device_mesh given'}): materialise the model before "
                "parallelising it"
            )
    check_parallel_params(module, tp_mesh, expert_mesh_given)


def _check_not_sharded_in_place(module: nn.Module) -> None:
    """A module already sharded in place (FSDP2's ``fully_shard``, torch's or
    ``megatron_fsdp.fsdp2``'s) holds DTensor pieces, not parameters to shard again."""
    sharded = [name or "the model itself" for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise ValueError(
            f"{', '.join(sharded[:3])} {'is' if len(sharded) == 1 else 'are'} already sharded in place by an FSDP2-style "
            "fully_shard (torch.distributed.fsdp or megatron_fsdp.fsdp2): shard the model with one API, either "
            "fully_shard_model(model, fsdp_unit_modules=[...]) on the plain model, or fully_shard per block and root"
        )


def _check_meta_params(module: nn.Module, meta_init: bool) -> None:
    """Before the model is moved anywhere: meta tensors cannot be copied to a device."""
    devices = {p.device for p in module.parameters()}
    if any(d.type == "meta" for d in devices) and not meta_init:
        raise ValueError("the model has parameters on the meta device: pass init_model_with_meta_device=True")
    if meta_init and not any(d.type == "meta" for d in devices):
        raise ValueError(
            "init_model_with_meta_device=True needs a model built under torch.device('meta'): none of its "
            "parameters is on the meta device"
        )


def _check_one_device(module: nn.Module) -> None:
    # Meta tensors are materialised where meta-device init puts them; the rest must share a device.
    devices = {p.device for p in module.parameters() if not p.is_meta}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters are spread over {sorted(map(str, devices))}; move it to one device first")


def _meta_init_device() -> torch.device:
    """Where a meta-device model is materialised when ``device`` is not given."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def check_strategies(
    zero_dp_strategy: int | str, outer_dp_sharding_strategy: int | str, fsdp_unit_modules: Sequence[type | str] | None,
    dp_outer_dim: str | None,
) -> tuple[ShardingStrategy, ShardingStrategy, tuple[type, ...]]:
    """The inner and outer strategies and the unit classes; raises before anything else."""
    strategy = ShardingStrategy.parse(zero_dp_strategy)
    unit_classes = resolve_unit_classes(fsdp_unit_modules)
    # Without units the whole model is the root unit, as upstream; only sharded weights need
    # units, or the whole model would be gathered at once.
    if strategy.shards_weights and not unit_classes:
        raise ValueError(
            f"zero_dp_strategy={strategy.label!r} needs fsdp_unit_modules: pass the classes of the blocks to "
            "shard as units, e.g. fsdp_unit_modules=[MyTransformerBlock]"
        )
    return strategy, check_outer_strategy(outer_dp_sharding_strategy, strategy, dp_outer_dim), unit_classes


def plan_sharding(
    module: nn.Module,
    dist_index: FSDPDistributedIndex,
    strategy: ShardingStrategy,
    outer: ShardingStrategy,
    unit_classes: tuple[type, ...],
    device: torch.device | str | None,
    init_model_with_meta_device: bool,
    settings: dict[str, Any],
) -> ShardingPlan:
    """Checks ``module`` against the groups, moves it to ``device`` (not for meta-device init),
    and runs the cross-rank consistency check (a collective). ``settings``: the other
    :class:`FSDPSettings` fields."""
    if (outer is ShardingStrategy.OPTIM) != dist_index.data_parallel.outer_shards_optimizer:
        raise ValueError(
            f"outer_dp_sharding_strategy={outer.label!r} but the distributed index was built with "
            f"hsdp_outer_dp_shard={dist_index.hsdp_outer_dp_shard}: pass hsdp_outer_dp_shard="
            f"{outer is ShardingStrategy.OPTIM} to FSDPDistributedIndex"
        )
    if settings.get("calculate_per_token_loss") and dist_index.data_parallel.outer is not None:
        raise ValueError(
            "calculate_per_token_loss=True with dp_outer_dim (HSDP) is not supported: the outer sync sums "
            "gradients that may already hold an earlier sync's sum; use a mean loss and calculate_per_token_loss=False"
        )
    _check_not_sharded_in_place(module)
    _check_tensor_parallel(module, dist_index, init_model_with_meta_device)
    _check_meta_params(module, init_model_with_meta_device)
    if device is not None and not init_model_with_meta_device:
        module.to(device)
    _check_one_device(module)
    full_settings = FSDPSettings(strategy=strategy, **settings)
    dp = dist_index.data_parallel
    meta_device = (torch.device(device) if device is not None else _meta_init_device()) if init_model_with_meta_device else None
    buffers_device = meta_device or next((p.device for p in module.parameters()), torch.device("cpu"))
    shortfall = check_device_memory(module, unit_classes, dp, full_settings, buffers_device)
    if shortfall is not None:
        logger.error("%s", shortfall)
    description = describe_configuration(module, full_settings, unit_classes, dp)
    # Ranks whose devices differ in free memory raise together, through the mismatch.
    description["planned model states fit in the free device memory"] = str(shortfall is None)
    check_same_configuration_on_all_ranks(description, dp, full_settings.collective_timeout)
    if shortfall is not None:
        raise ValueError(shortfall)
    return ShardingPlan(dist_index, full_settings, unit_classes, meta_device, buffers_device)


def _policy_from_ddp_config(ddp_config: Any) -> MixedPrecisionPolicy:
    """The dtype fields of a DistributedDataParallelConfig (ours folds in its deprecated flags)."""
    folded = getattr(ddp_config, "mixed_precision_policy", None)
    if callable(folded):
        return folded()
    return MixedPrecisionPolicy(
        main_params_dtype=getattr(ddp_config, "megatron_fsdp_main_params_dtype", torch.float32),
        main_grads_dtype=getattr(ddp_config, "megatron_fsdp_main_grads_dtype", None),
        grad_comm_dtype=getattr(ddp_config, "megatron_fsdp_grad_comm_dtype", None),
    )


def plan_from_upstream_arguments(
    module: nn.Module,
    dist_index: FSDPDistributedIndex | None,
    ddp_config: Any,
    mixed_precision_policy: MixedPrecisionPolicy | None,
    fsdp_unit_modules: Sequence[type | str] | None,
    device: torch.device | str | None,
    init_model_with_meta_device: bool,
    sync_model_each_microbatch: bool,
    calculate_per_token_loss: bool,
    report_nan_in_param_grad: bool,
    nccl_ub: bool,
    fsdp_double_buffer: bool,
) -> ShardingPlan:
    """The plan for ``MegatronFSDP(module, dist_index, ddp_config, ...)``, upstream's
    constructor. Without ``ddp_config``: ``optim_grads_params`` with overlap, as upstream.
    ``ddp_config`` may be megatron_fsdp's or megatron-core's DistributedDataParallelConfig (its
    fields are read by name). Without ``mixed_precision_policy`` the config's
    ``megatron_fsdp_*_dtype`` fields give the policy (upstream's default policy equals their
    defaults)."""
    if ddp_config is None:
        options = dict(
            strategy="optim_grads_params", outer="no_shard", overlap_grad_reduce=True, overlap_param_gather=True,
            check_for_nan_in_grad=False, nccl_ub=nccl_ub, fsdp_double_buffer=fsdp_double_buffer, maxpool=False,
            cpu_offload=False,
        )
        policy = mixed_precision_policy or MixedPrecisionPolicy()
    else:
        if getattr(ddp_config, "fp8_param_gather", False):
            raise ValueError(
                "ddp_config.fp8_param_gather=True keeps compute weights in FP8 (Transformer Engine), which "
                "megatron_fsdp does not support: set fp8_param_gather=False"
            )
        check_upstream_options(getattr(ddp_config, "megatron_fsdp_use_decoupled_grad", False))
        options = dict(
            strategy=getattr(ddp_config, "data_parallel_sharding_strategy", "no_shard"),
            outer=getattr(ddp_config, "outer_dp_sharding_strategy", "no_shard"),
            overlap_grad_reduce=bool(getattr(ddp_config, "overlap_grad_reduce", False)),
            overlap_param_gather=bool(getattr(ddp_config, "overlap_param_gather", False)),
            check_for_nan_in_grad=bool(getattr(ddp_config, "check_for_nan_in_grad", False)),
            nccl_ub=bool(getattr(ddp_config, "nccl_ub", False)),
            fsdp_double_buffer=bool(getattr(ddp_config, "fsdp_double_buffer", False)),
            maxpool=bool(getattr(ddp_config, "megatron_fsdp_max_pool_double_buffer", False)),
            # megatron_fsdp's own field (megatron-core's config has none): --cpu-offloading.
            cpu_offload=bool(getattr(ddp_config, "cpu_offload", False)),
        )
        policy = mixed_precision_policy or _policy_from_ddp_config(ddp_config)
    if dist_index is None:
        dist_index = FSDPDistributedIndex()
    strategy, outer, unit_classes = check_strategies(
        options["strategy"], options["outer"], fsdp_unit_modules, dist_index.dp_outer_dim
    )
    settings = dict(
        mixed_precision=policy,
        check_for_nan_in_grad=options["check_for_nan_in_grad"],
        report_nan_in_param_grad=report_nan_in_param_grad,
        sync_model_each_microbatch=sync_model_each_microbatch,
        overlap_grad_reduce=options["overlap_grad_reduce"],
        overlap_param_gather=options["overlap_param_gather"],
        fsdp_double_buffer=options["fsdp_double_buffer"] or options["nccl_ub"] or options["maxpool"],
        nccl_ub=options["nccl_ub"],
        calculate_per_token_loss=calculate_per_token_loss,
        cpu_offload=options["cpu_offload"],
    )
    return plan_sharding(module, dist_index, strategy, outer, unit_classes, device, init_model_with_meta_device, settings)
