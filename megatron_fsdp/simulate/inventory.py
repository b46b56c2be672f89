"""What a simulated rank's live storages are, named from the wrapped model that holds them: the
model-state categories plan_memory plans (engine/planning/memory_plan.py's DEVICE_CATEGORIES),
and each bucket's layout and padding."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.params.dtensor_params import local_tensor
from megatron_fsdp.engine.step.units import FSDPUnit
from megatron_fsdp.simulate.memory import Allocation

OTHER = "bookkeeping"


@dataclass(frozen=True)
class BucketRow:
    """One bucket on the simulated rank: its unit, dtype, parameters, elements (``numel``: the
    parameters'; ``padded_numel``: the bucket's, alignment gaps and tail included) and this
    rank's shard (``shard_numel`` elements)."""

    unit: str
    dtype: str
    params: int
    numel: int
    padded_numel: int
    shard_numel: int
    group_size: int

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


def _storage(tensor: torch.Tensor | None) -> int | None:
    if tensor is None:
        return None
    return local_tensor(tensor).untyped_storage()._cdata


def _bucket_storages(bucket: Bucket) -> Iterable[tuple[str, torch.Tensor | None]]:
    yield "compute weights", bucket.weights.shard
    if not bucket.strategy.shards_weights:
        yield "compute weights", bucket.weights.full
    if bucket.requires_grad:
        yield "main weights", bucket.main_params
        yield "main grads", bucket.grads.main_grad
        yield "main grads", bucket.grads.outer_grad
        yield "main grads", bucket.grads.optimizer_grads


def categories(units: list[FSDPUnit], module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[int, str]:
    """Storage (``_cdata``) -> model-state category, for what the engine's ``units``, the user's
    ``module`` and ``optimizer`` hold. The first category found wins: main weights that are the
    compute weights count as compute weights, as the plan counts them; a parameter or gradient
    no bucket holds (torch's FSDP2) counts as ``parameters`` or ``gradients``."""
    found: dict[int, str] = {}

    def add(category: str, tensor: torch.Tensor | None) -> None:
        key = _storage(tensor)
        if key is not None:
            found.setdefault(key, category)

    for unit in units:
        for bucket in unit.buckets:
            for category, tensor in _bucket_storages(bucket):
                add(category, tensor)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add("optimizer state", value)
    for buffer in module.buffers():
        add("module buffers", buffer)
    return found


def model_states(live: dict[int, Allocation], named: dict[int, str]) -> dict[str, int]:
    """The bytes of the live storages by category (``bookkeeping``: live but named by none)."""
    total: Counter[str] = Counter()
    for key, allocation in live.items():
        total[named.get(key, OTHER)] += allocation.nbytes
    return dict(total)


def bucket_rows(units: list[FSDPUnit]) -> list[BucketRow]:
    return [
        BucketRow(
            unit=unit.name, dtype=str(bucket.dtype).removeprefix("torch."), params=len(bucket.params),
            numel=sum(slot.numel for slot in bucket.layout.slots), padded_numel=bucket.layout.padded_numel,
            shard_numel=bucket.layout.shard_numel, group_size=bucket.dp.size,
        )
        for unit in units for bucket in unit.buckets
    ]
