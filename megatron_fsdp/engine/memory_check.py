"""At wrap time: this rank's memory plan, logged, and checked against the CUDA device's free
memory before anything is allocated, so a model that cannot fit fails with the options that
would, instead of with an out-of-memory error in the middle of the first step."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from megatron_fsdp.engine.config import FSDPSettings, ShardingStrategy
from megatron_fsdp.engine.memory_plan import OptimizerSpec, PlanOptions, RankMemory, biggest, describe, gib, plan_rank, plan_buckets
from megatron_fsdp.engine.mesh import DataParallelGroup

logger = logging.getLogger(__name__)


def wrap_options(dp: DataParallelGroup, settings: FSDPSettings, device: torch.device) -> tuple[PlanOptions, int]:
    """The plan options of this wrap (no optimizer: it is not known yet) and this rank's place
    in the (dp_outer, dp_shard) mesh."""
    outer_size = dp.outer.size if dp.outer is not None else 1
    options = PlanOptions(
        world_size=dp.size * outer_size, strategy=settings.strategy,
        outer_strategy=ShardingStrategy.OPTIM if dp.outer_shards_optimizer else ShardingStrategy.NO_SHARD,
        outer_size=outer_size, policy=settings.mixed_precision, optimizer=OptimizerSpec.parse(None),
        overlap_param_gather=settings.overlap_param_gather, fsdp_double_buffer=settings.fsdp_double_buffer,
        cpu_offload=settings.cpu_offload, offload_pin_memory=settings.offload_pin_memory,
        report_nan_in_param_grad=settings.report_nan_in_param_grad, device_type=device.type,
        alignment_bytes=settings.alignment_bytes,
    )
    rank = (dp.outer.rank if dp.outer is not None else 0) * dp.size + dp.rank
    return options, rank


def plan_this_rank(module: nn.Module, unit_classes: tuple[type, ...], options: PlanOptions, rank: int) -> RankMemory:
    memory = plan_rank(plan_buckets(module, unit_classes, options.strategy), module, options, rank)
    logger.debug("megatron_fsdp: planned memory (optimizer state not included)\n%s", describe(memory))
    return memory


def _held_on(module: nn.Module, device: torch.device) -> int:
    """Bytes the model's tensors already hold on ``device`` (given back as the buffers are built)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.device == device)


def device_memory_shortfall(
    module: nn.Module, unit_classes: tuple[type, ...], options: PlanOptions, rank: int, memory: RankMemory,
    device: torch.device,
) -> str | None:
    """None when the planned model states fit in ``device``'s free memory (or it is no CUDA
    device); else the error: what is short, the biggest item, and the options that would fit."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    available = free + _held_on(module, device)
    if memory.allocator_bytes <= available:
        return None
    name, nbytes = biggest(memory)
    alternatives = []
    for strategy in ShardingStrategy:
        for offload in (False, True):
            if (strategy, offload) == (options.strategy, options.cpu_offload) or strategy < options.strategy:
                continue
            other = dataclasses.replace(options, strategy=strategy, cpu_offload=offload)
            if other.outer_strategy is ShardingStrategy.OPTIM and strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
                continue
            planned = plan_rank(plan_buckets(module, unit_classes, strategy), module, other, rank).allocator_bytes
            if planned <= available:
                alternatives.append(f"zero_dp_strategy={strategy.label!r}{', cpu_offload=True' if offload else ''} "
                                    f"({gib(planned):.2f} GiB)")
    fits = ("; these would fit: " + ", ".join(alternatives)) if alternatives else (
        "; no strategy fits at this world size: use more GPUs, or a smaller model")
    return (
        f"fully_shard: this rank's model states need {gib(memory.allocator_bytes):.2f} GiB on {device} (optimizer state "
        f"not yet counted), but {gib(available):.2f} GiB is free; the biggest item is {name} ({gib(nbytes):.2f} GiB)"
        f"{fits}. megatron_fsdp.plan_memory(model, world_size, ...) plans any choice before launching"
    )
