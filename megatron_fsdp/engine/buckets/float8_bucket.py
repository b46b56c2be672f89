"""A bucket of torchao ``Float8Linear`` weights whose compute copy is float8 (float8_weights.py).

Its compute weights are float8 bytes laid out as the bucket's elements (one byte each). Where
the optimizer step installs the main params, each weight gets its scale: the amax of this
rank's piece (``segment_amax``), one MAX all-reduce of the bucket's amaxes over the shard group,
torchao's tensorwise scale. Under optim_grads_params each gather casts the main shard with those
scales (``float8_cast_segments``), as bf16 gathers cast it, so no float8 shard is kept between
steps; the other strategies cast the whole bucket at the step. The all-gather carries one byte
per element, and every rank already holds every scale.
Forward reads each weight as a float8 view of the gathered bucket with its scale; the
parameters themselves hold a one-element expanded stand-in of their shape and dtype, so
their gradients arrive as usual and the rest of the bucket (gradients, main params, optimizer,
checkpoints) is an ordinary bucket's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_fsdp import _ops
from megatron_fsdp.engine.buckets.bucket_weights import BucketWeights
from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.buckets.float8_weights import float8_scales, float8_spec
from megatron_fsdp.engine.config import ShardingStrategy
from megatron_fsdp.engine.groups.collectives import HostWork, all_gather_shards, all_reduce_max


class Float8Weights(BucketWeights):
    """The float8 compute weights of a :class:`Float8Bucket`, with one scale per weight."""

    def __init__(self, bucket: Float8Bucket) -> None:
        super().__init__(bucket)
        self.scales = torch.ones(len(bucket.params), dtype=torch.float32, device=bucket.device)
        # Made before any forward reads them (a compiled block traces forward): sharded, at the
        # first gather, as the pool lends memory to the same storage at every gather, so these
        # views (and those autograd saved) stay valid.
        self.float8_views = None if bucket.strategy.shards_weights else self._views_of_full()

    def _allocate(self) -> None:
        bucket = self.bucket
        if bucket.strategy.shards_weights:
            # No float8 shard is kept: each gather casts the main shard (gathers_from_main), as
            # FSDP2 casts its fp32 shard, so float8 costs no memory beyond the gathers.
            self.full = bucket.pool.placeholder(bucket.layout.padded_numel, bucket.float8_dtype, bucket.device)
        else:
            self.full = torch.zeros(bucket.layout.padded_numel, dtype=bucket.float8_dtype, device=bucket.device)

    def release_full_params(self) -> None:
        # One element of the parameters' dtype, expanded to each shape: what autograd checks a
        # gradient against, without memory. Forward reads the float8 copy instead.
        stand_in = torch.zeros((), dtype=self.bucket.dtype, device=self.bucket.device)
        for local in self.bucket.locals:
            local.data = stand_in.expand(local.shape)

    def _views_of_full(self) -> list[torch.Tensor]:
        return [
            _view_with_own_version(self.full, slot.offset, shape)
            for slot, shape in zip(self.bucket.layout.slots, self.bucket.shapes)
        ]

    def source(self, index: int):
        """What forward reads of weight ``index``: its float8 view and its scale."""

        def source() -> tuple[torch.Tensor, torch.Tensor]:
            if self.bucket.strategy.shards_weights and not self.state.gathered:
                raise RuntimeError(f"the float8 weight {self.bucket.names[index]} was read while its unit is sharded")
            return self.float8_views[index], self.scales[index]

        return source

    # -- gather and release -------------------------------------------------------------------

    def gather(self, async_op: bool) -> dist.Work | HostWork | None:
        """Casts the main shard to float8 with the step's scales and launches the all-gather of
        the float8 shards (as bytes: collectives.py)."""
        bucket = self.bucket
        self.state.gather()
        bucket.pool.fill(self.full, bucket.pool_key("weights"))
        if self.float8_views is None:
            self.float8_views = self._views_of_full()
        if bucket.dp.size == 1:
            self._cast_main_params(self.full[bucket.main_start : bucket.main_end])
            return None
        shard = self._gather_input = bucket.pool.fetch(
            bucket.layout.shard_numel, bucket.float8_dtype, bucket.device, bucket.pool_key("gather_input")
        )
        self._cast_main_params(shard)
        return all_gather_shards(self.full, shard, bucket.dp.group, async_op=async_op)

    def point_params_at_full(self) -> None:
        """The parameters keep their stand-ins: forward reads the float8 views."""
        self._release_gather_input()

    def release(self) -> None:
        if self.state.release():
            self.bucket.pool.release(self.full)

    # -- install ------------------------------------------------------------------------------

    def stage(self) -> None:
        return None

    @torch.no_grad()
    def install(self, staged: object = None) -> None:
        """The float8 scales of the stepped main params: amax per weight over this rank's
        pieces, the maximum over the shard group, torchao's scales. Sharded, each gather casts
        with them; otherwise the cast into the full bucket is now, and strategies 1/2 then
        gather the full float8 bucket."""
        bucket = self.bucket
        amax = _ops.segment_amax(bucket.main_params, self._main_bounds())
        if bucket.strategy is not ShardingStrategy.NO_SHARD:
            all_reduce_max(amax, bucket.dp.group)
        self.scales.copy_(float8_scales(amax, bucket.float8_dtype, bucket.round_scales))
        if bucket.strategy.shards_weights:
            return
        self._cast_main_params(self.full[bucket.main_start : bucket.main_end])
        self._gather_full_from_own_shards()

    def _main_bounds(self) -> list[int]:
        return [end for pair in self.bucket.optim_ranges for end in pair]

    @torch.no_grad()
    def _cast_main_params(self, target: torch.Tensor) -> None:
        """Each weight's piece of the main params, scaled and cast to float8, into ``target``
        (laid out as the main params)."""
        _ops.float8_cast_segments(self.bucket.main_params, self._main_bounds(), self.scales, target)


class Float8Bucket(Bucket):
    float8_weights = True
    weights_class = Float8Weights

    def __init__(self, names, params, dp, settings, pool, pool_role, **kwargs) -> None:
        specs = [float8_spec(p) for p in params]
        self.float8_dtype = specs[0].float8_dtype
        self.round_scales = specs[0].round_scales_to_power_of_2
        super().__init__(names, params, dp, settings, pool, pool_role, **kwargs)
        for index, spec in enumerate(specs):
            spec.source = self.weights.source(index)
        self.weights.install()

    def _initial_main_params(self) -> torch.Tensor:
        return self.local_pieces(self.main_start, self.main_end, self.dtypes.main_params)

    def pool_key(self, purpose: str) -> str:
        return f"{purpose}/{self.pool_role}:float8"


def _view_with_own_version(base: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """A contiguous view of ``base``'s storage from element ``offset``, with a version counter of
    its own. A compiled block saves the float8 bytes themselves for backward (a saved
    ``Float8TrainingTensor`` is flattened into its data and scale), and the gather before
    backward writes ``base`` in place: a shared counter would fail autograd's saved-tensor check,
    though the bytes written are the ones forward read (FSDP2 writes its gathered parameters
    under ``torch.autograd._unsafe_preserve_version_counter`` for the same reason)."""
    view = torch.empty(0, dtype=base.dtype, device=base.device)
    return view.set_(base.untyped_storage(), base.storage_offset() + offset, shape)
