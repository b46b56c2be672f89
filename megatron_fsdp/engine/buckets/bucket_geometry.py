"""What one bucket holds on one rank, as numbers: which ranges of the bucket its persistent
buffers cover and which of them exist at all. A :class:`~megatron_fsdp.engine.buckets.buffer.Bucket`
allocates by it, and the memory planner (memory_plan.py) counts by it, so the plan is the
engine's own arithmetic rather than a second formula.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_fsdp.engine.config import ShardingStrategy
from megatron_fsdp.engine.params.layout import BucketLayout, alignment_in_elements, build_bucket_layout
from megatron_fsdp.mixed_precision import ResolvedDtypes


@dataclass(frozen=True)
class BucketGeometry:
    """``layout``: the bucket over its shard group of ``layout.world_size`` ranks, this rank being
    ``rank``; ``outer_size``/``outer_rank``: the outer (HSDP) group, 1/0 without one."""

    layout: BucketLayout
    rank: int
    strategy: ShardingStrategy
    dtypes: ResolvedDtypes
    requires_grad: bool
    offloaded: bool
    outer_size: int = 1
    outer_rank: int = 0
    outer_shards_optimizer: bool = False
    # Float8 compute weights, cast from the main params at each install (float8_bucket.py).
    float8_weights: bool = False

    @classmethod
    def build(
        cls,
        numels: Sequence[int],
        element_size: int,
        alignment_bytes: int,
        rank: int,
        world_size: int,
        strategy: ShardingStrategy,
        dtypes: ResolvedDtypes,
        requires_grad: bool,
        offloaded: bool,
        outer_size: int = 1,
        outer_rank: int = 0,
        outer_shards_optimizer: bool = False,
        float8_weights: bool = False,
    ) -> BucketGeometry:
        splits_shard = outer_size > 1 and outer_shards_optimizer
        alignment = alignment_in_elements(alignment_bytes, element_size)
        layout = build_bucket_layout(numels, world_size, alignment, outer_size if splits_shard else 1)
        return cls(layout, rank, strategy, dtypes, requires_grad, offloaded and requires_grad,
                   outer_size, outer_rank, outer_shards_optimizer, float8_weights)

    @property
    def splits_shard(self) -> bool:
        """HFSDP: the optimizer steps 1/outer of this rank's shard; the outer group gathers the rest."""
        return self.outer_size > 1 and self.outer_shards_optimizer

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.layout.shard_range(self.rank)

    @property
    def gathers_from_main(self) -> bool:
        """Under optim_grads_params with main params of another dtype, the compute-weight shard
        would only copy the main shard: each gather casts the main shard instead (as FSDP2 casts
        its shard); so does every float8 bucket, whose compute dtype is never the main one.
        HFSDP keeps the shard, which its outer all-gather fills; so does offloading, whose main
        shard is on the host (float8 gathers fall back to ordinary ones under both)."""
        return (
            self.strategy.shards_weights
            and self.requires_grad
            and (self.float8_weights or self.dtypes.main_params != self.dtypes.compute)
            and not self.splits_shard
            and not self.offloaded
        )

    @property
    def weight_range(self) -> tuple[int, int] | None:
        """The bucket range the persistent compute weights cover: the shard under
        optim_grads_params (none when gathers cast the main shard), else the whole bucket."""
        if not self.strategy.shards_weights:
            return 0, self.layout.padded_numel
        return None if self.gathers_from_main else self.shard_range

    @property
    def grad_range(self) -> tuple[int, int]:
        """The range the main gradient covers: the whole bucket under no_shard (every rank steps
        all of it), else this rank's shard."""
        if self.strategy is ShardingStrategy.NO_SHARD:
            return 0, self.layout.padded_numel
        return self.shard_range

    @property
    def main_range(self) -> tuple[int, int]:
        """The range the optimizer steps: the gradient range, or under HFSDP this outer rank's
        1/outer of it."""
        if not self.splits_shard:
            return self.grad_range
        start, _ = self.shard_range
        piece = self.layout.shard_numel // self.outer_size
        return start + self.outer_rank * piece, start + (self.outer_rank + 1) * piece

    @property
    def main_params_alias_weights(self) -> bool:
        """Main params in the compute dtype are the compute weights themselves: nothing to copy."""
        return self.dtypes.main_params == self.dtypes.compute and not self.offloaded and not self.float8_weights

    def reduces_in_place(self, grad_divisor: int) -> bool:
        """Whether the reduction leaves each gradient as it is, so gradients go straight into
        the main gradient: a group of one rank, nothing to divide by, no change of dtype, and a
        buffer that lives one backward (strategies 2/3; 0/1 may hold theirs back past a
        ``zero_grad``). Saves a bucket-sized buffer and a pass over it per micro-batch."""
        return (
            self.layout.world_size == 1
            and grad_divisor == 1
            and self.strategy.shards_grads
            and self.dtypes.comm == self.dtypes.main_grads
        )

    def piece(self, index: int, start: int, end: int) -> tuple[int, int]:
        """The part of parameter ``index`` inside bucket range ``[start, end)``, as bucket offsets
        (empty, start == end, when it holds none of it)."""
        slot = self.layout.slots[index]
        lo = min(max(slot.offset, start), end)
        return lo, max(min(slot.end, end), lo)

    def main_pieces(self) -> list[tuple[int, int]]:
        """Each parameter's part of the main range: what the optimizer steps of it."""
        start, end = self.main_range
        return [self.piece(index, start, end) for index in range(len(self.layout.slots))]

    def padding_numel(self, start: int, end: int) -> int:
        """Elements of ``[start, end)`` no parameter occupies."""
        return sum(max(0, min(hi, end) - max(lo, start)) for lo, hi in self.layout.padding_ranges())
