"""At wrap time: this rank's memory plan, logged, and checked against the CUDA device's free
memory before anything is allocated, so a model that cannot fit fails with the options that
would, instead of with an out-of-memory error in the middle of the first step."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from megatron_fsdp.engine.config import FSDPSettings, ShardingStrategy
from megatron_fsdp.engine.groups.mesh import DataParallelGroup
from megatron_fsdp.engine.planning.memory_plan import OptimizerSpec, PlanOptions, biggest, describe, gib, plan_buckets, plan_rank

logger = logging.getLogger(__name__)


def check_device_memory(
    module: nn.Module, unit_classes: tuple[type, ...], dp: DataParallelGroup, settings: FSDPSettings,
    device: torch.device,
) -> str | None:
    """Plans this rank's model states (no optimizer state: the optimizer is not known yet) and
    logs them at debug level. Returns None when they fit in ``device``'s free memory (or it is
    no CUDA device); else the error: what is short, the biggest item, and the options that
    would fit."""
    outer_size = dp.outer.size if dp.outer is not None else 1
    options = PlanOptions(
        world_size=dp.size * outer_size, settings=settings, outer_size=outer_size,
        outer_strategy=ShardingStrategy.OPTIM if dp.outer_shards_optimizer else ShardingStrategy.NO_SHARD,
        optimizer=OptimizerSpec.parse(None), device_type=device.type,
    )
    rank = (dp.outer.rank if dp.outer is not None else 0) * dp.size + dp.rank
    # The buckets do not depend on the strategy once the units are found: planned once for all.
    buckets = plan_buckets(module, unit_classes, settings.strategy)
    memory = plan_rank(buckets, module, options, rank)
    logger.debug("megatron_fsdp: planned memory (optimizer state not included)\n%s", describe(memory))
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    available = free + _held_on(module, device)
    if memory.allocator_bytes <= available:
        return None
    alternatives = []
    for strategy in ShardingStrategy:
        for offload in (False, True):
            if (strategy, offload) == (settings.strategy, settings.cpu_offload) or strategy < settings.strategy:
                continue
            if options.outer_strategy is ShardingStrategy.OPTIM and strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
                continue
            other = dataclasses.replace(options, settings=dataclasses.replace(settings, strategy=strategy, cpu_offload=offload))
            planned = plan_rank(buckets, module, other, rank).allocator_bytes
            if planned <= available:
                alternatives.append(f"zero_dp_strategy={strategy.label!r}{', cpu_offload=True' if offload else ''} "
                                    f"({gib(planned):.2f} GiB)")
    fits = ("; these would fit: " + ", ".join(alternatives)) if alternatives else (
        "; no strategy fits at this world size: use more GPUs, or a smaller model")
    name, nbytes = biggest(memory)
    return (
        f"fully_shard: this rank's model states need {gib(memory.allocator_bytes):.2f} GiB on {device} (optimizer state "
        f"not yet counted), but {gib(available):.2f} GiB is free; the biggest item is {name} ({gib(nbytes):.2f} GiB)"
        f"{fits}. megatron_fsdp.plan_memory(model, world_size, ...) plans any choice before launching"
    )


def _held_on(module: nn.Module, device: torch.device) -> int:
    """Bytes the model's tensors already hold on ``device`` (given back as the buffers are built)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.device == device)
