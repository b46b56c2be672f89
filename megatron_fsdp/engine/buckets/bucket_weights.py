"""A bucket's weights through a step: gathered into a pooled bucket before a unit computes,
given back after (``gather`` -> ``GATHERED`` -> ``release`` -> ``SHARDED``, bucket_state.py),
and written from the stepped main params after each optimizer step (``install``).

The compute weights live in one flat buffer: this rank's shard, gathered into a pooled bucket
when used (``optim_grads_params``), or the whole bucket, which the parameters then view. The
bucket (buffer.py) owns this object and the main params it installs from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_fsdp import _ops
from megatron_fsdp.engine.buckets.bucket_state import WeightsState
from megatron_fsdp.engine.buckets.offload import StagedWeights
from megatron_fsdp.engine.config import ShardingStrategy
from megatron_fsdp.engine.groups.collectives import HostWork, all_gather_shards

if TYPE_CHECKING:
    from megatron_fsdp.engine.buckets.buffer import Bucket


class BucketWeights:
    """The compute weights of ``bucket``: ``shard`` (this rank's, when kept between gathers) and
    ``full`` (the pooled gathered bucket, or the whole bucket where weights are not sharded)."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.state = WeightsState(bucket.name)
        self.shard: torch.Tensor | None = None
        self.views: list[torch.Tensor] | None = None
        self._gather_input: torch.Tensor | None = None
        self._allocate()

    def _allocate(self) -> None:
        """This rank's shard and a pooled bucket to gather into (optim_grads_params), else the
        whole bucket, which the parameters then view."""
        bucket = self.bucket
        if bucket.strategy.shards_weights:
            if not bucket.gathers_from_main:
                self.shard = bucket.local_pieces(bucket.shard_start, bucket.shard_end, bucket.dtype)
            self.full = bucket.pool.placeholder(bucket.layout.padded_numel, bucket.dtype, bucket.device)
        else:
            self.full = torch.zeros(bucket.layout.padded_numel, dtype=bucket.dtype, device=bucket.device)
            _ops.flatten_copy([t.detach() for t in bucket.locals], bucket.offsets, self.full)
            self.views = _ops.param_views(self.full, bucket.offsets, bucket.shapes)
            for local, view in zip(bucket.locals, self.views):
                local.data = view

    def release_full_params(self) -> None:
        """Once everything needed was copied out of the parameters' full values: lets them go."""
        bucket = self.bucket
        if bucket.strategy.shards_weights:
            # A sharded parameter's .data is an empty tensor, so stray reads fail loudly; one
            # serves every reshard (no allocation per parameter and step).
            self._placeholder = torch.empty(0, dtype=bucket.dtype, device=bucket.device)
            for local in bucket.locals:
                local.data = self._placeholder

    def main_target(self) -> torch.Tensor:
        """The compute weights the main params are installed into after a step."""
        bucket = self.bucket
        if self.shard is not None:
            return self.shard[bucket.main_start - bucket.shard_start : bucket.main_end - bucket.shard_start]
        return self.full[bucket.main_start : bucket.main_end]

    # -- gather and release -------------------------------------------------------------------

    def gather(self, async_op: bool) -> dist.Work | HostWork | None:
        """Fills the pooled bucket and launches the all-gather of the weight shards into it."""
        bucket = self.bucket
        self.state.gather()
        bucket.pool.fill(self.full, bucket.pool_key("weights"))
        if bucket.host is not None:
            bucket.host.before_device_reads_weights()
        shard = self.shard
        if bucket.gathers_from_main and bucket.dp.size == 1:
            self.full.copy_(bucket.main_params)  # the main shard is the whole bucket: cast it in place
            return None
        if bucket.gathers_from_main:
            shard = self._gather_input = bucket.pool.fetch(
                bucket.layout.shard_numel, bucket.dtype, bucket.device, bucket.pool_key("gather_input")
            )
            shard.copy_(bucket.main_params)
        return all_gather_shards(self.full, shard, bucket.dp.group, async_op=async_op)

    def point_params_at_full(self) -> None:
        """After the gather finished: parameters become views of the gathered bucket."""
        bucket = self.bucket
        self._release_gather_input()
        if self.views is None:
            self.views = _ops.param_views(self.full, bucket.offsets, bucket.shapes)
        for local, view in zip(bucket.locals, self.views):
            local.data = view

    def _release_gather_input(self) -> None:
        if self._gather_input is not None:
            self.bucket.pool.release(self._gather_input)
            self._gather_input = None

    def release(self) -> None:
        """Gives the gathered weights back (a bucket of the root unit may have done so already,
        once its gradients were in)."""
        if not self.state.release():
            return
        for local in self.bucket.locals:
            local.data = self._placeholder
        self.bucket.pool.release(self.full)

    # -- install ------------------------------------------------------------------------------

    def stage(self) -> StagedWeights | None:
        """Offloaded: host memory for the stepped main params in the compute dtype (``buffer``,
        one element per main param, ``optim_ranges`` holding each piece's), for a host step that
        writes them there as it steps them, instead of a second pass casting them; then give it to
        :meth:`install`. None when the bucket is not offloaded."""
        if self.bucket.host is None:
            return None
        return self.bucket.host.stage_weights(self.main_target())

    def install(self, staged: StagedWeights | None = None) -> None:
        """Writes the stepped main params into the compute weights and, where every rank holds
        full weights but stepped only its shard (strategies 1 and 2), gathers the others'.
        ``staged``: from :meth:`stage`, filled with every main param cast (sent as it is);
        without it, an offloaded bucket casts the main params now."""
        bucket = self.bucket
        if bucket.gathers_from_main:
            return  # the next gather casts the new main params
        if bucket.host is not None:
            if staged is None:
                bucket.host.send_weights(self.main_target())
            else:
                bucket.host.send_staged_weights(staged)
            if bucket.strategy.shards_weights and not bucket.splits_shard:
                return  # the unit's next all-gather waits for the copy
            bucket.host.before_device_reads_weights()
        elif not bucket.main_params_alias_weights:
            self.main_target().copy_(bucket.main_params)
        if bucket.splits_shard:
            # A copy: not every backend (gloo) accepts an input that aliases the output.
            all_gather_shards(self.shard, self.main_target().clone(), bucket.outer.group)
        self._gather_full_from_own_shards()

    def _gather_full_from_own_shards(self) -> None:
        """Strategies 1 and 2: every rank holds the full weights but stepped only its shard."""
        bucket = self.bucket
        if bucket.strategy in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS):
            # A copy: not every backend (gloo) accepts an input that aliases the output.
            own_shard = self.full[bucket.shard_start : bucket.shard_end].clone()
            all_gather_shards(self.full, own_shard, bucket.dp.group)
