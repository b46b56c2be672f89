"""Sharding strategies and the validated settings of one MegatronFSDP instance."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from megatron_fsdp.mixed_precision import MixedPrecisionPolicy

_STRATEGY_NAMES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class ShardingStrategy(enum.IntEnum):
    """What is sharded across the data-parallel group (the ZeRO stages).

    ``NO_SHARD`` (0): nothing, like DDP. ``OPTIM`` (1): main params and optimizer state.
    ``OPTIM_GRADS`` (2): also the reduced gradients. ``OPTIM_GRADS_PARAMS`` (3): also the
    compute weights, gathered per unit when used (the default).
    """

    NO_SHARD = 0
    OPTIM = 1
    OPTIM_GRADS = 2
    OPTIM_GRADS_PARAMS = 3

    @classmethod
    def parse(cls, value: int | str | ShardingStrategy, argument: str = "zero_dp_strategy") -> ShardingStrategy:
        """Accepts 0..3, the names ``no_shard``/``optim``/``optim_grads``/``optim_grads_params``
        (any case) or a member."""
        if isinstance(value, ShardingStrategy):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 3:
            return cls(value)
        if isinstance(value, str) and value.lower() in _STRATEGY_NAMES:
            return cls(_STRATEGY_NAMES.index(value.lower()))
        raise ValueError(
            f"unknown {argument} {value!r}: use 0, 1, 2, 3 or one of {', '.join(_STRATEGY_NAMES)}"
        )

    @property
    def label(self) -> str:
        return _STRATEGY_NAMES[self.value]

    @property
    def shards_weights(self) -> bool:
        return self is ShardingStrategy.OPTIM_GRADS_PARAMS

    @property
    def shards_grads(self) -> bool:
        return self >= ShardingStrategy.OPTIM_GRADS

    @property
    def shards_optimizer(self) -> bool:
        return self >= ShardingStrategy.OPTIM


@dataclass(frozen=True)
class FSDPSettings:
    """The behaviour switches of one MegatronFSDP instance, validated by the API layer."""

    strategy: ShardingStrategy = ShardingStrategy.OPTIM_GRADS_PARAMS
    mixed_precision: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    check_for_nan_in_grad: bool = False
    report_nan_in_param_grad: bool = False
    preproc_state_dict_for_dcp_ckpt: bool = True
    sync_model_each_microbatch: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    fsdp_double_buffer: bool = False
    nccl_ub: bool = False
    # Upstream's per-token loss: gradients are summed over data-parallel ranks, not averaged (the
    # loss is already divided by the global token count, or scale_gradients() divides later).
    calculate_per_token_loss: bool = False
    # Elements each parameter's offset, and each shard, is a multiple of (in bytes: 128, a
    # cache line pair on CPUs and a full NCCL/DMA-friendly alignment on GPUs).
    alignment_bytes: int = 128
    # Reductions in flight before the oldest is finished; bounds the memory of un-reduced grads.
    max_reductions_in_flight: int = 2
    # Seconds a wait for an asynchronous gather or reduction may take before it raises naming the
    # unit and bucket; None leaves it to the process group's own timeout.
    collective_timeout: float | None = None
    # CPU offloading (docs/offloading.md): main parameters, the gradients the optimizer reads and
    # the optimizer state live on the host, which runs the step; the buffers that the copy engine
    # reads or writes are pinned when ``offload_pin_memory`` (and a GPU is used).
    cpu_offload: bool = False
    offload_pin_memory: bool = True
