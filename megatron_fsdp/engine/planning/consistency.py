"""The cross-rank check of ``fully_shard``: every rank must shard the same model the same way.

Ranks that disagree (another strategy, unit list, mixed-precision policy, parameter name, shape
or dtype) would issue different collectives and hang in the first one. So before any other
collective, each rank hashes a description of its configuration and the ranks all-gather the
hashes (one 8-byte collective). Only when they differ are the descriptions gathered, and every
rank raises the same error naming what differs on which ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp.engine.config import FSDPSettings
from megatron_fsdp.engine.groups.collectives import all_gather_shards, holds_values, wait_for
from megatron_fsdp.engine.groups.mesh import DataParallelGroup

# Differences listed in the error before the rest are only counted.
_MAX_LISTED = 8


def describe_configuration(
    module: nn.Module, settings: FSDPSettings, unit_classes: tuple[type, ...], dp: DataParallelGroup
) -> dict[str, str]:
    """What must be equal on every rank, as name -> value strings."""
    description = {
        f"setting {field.name}": repr(getattr(settings, field.name)) for field in dataclasses.fields(settings)
    }
    description["fsdp_unit_modules"] = repr([f"{c.__module__}.{c.__qualname__}" for c in unit_classes])
    # Found without raising: a rank missing a unit class must fail this check with the others.
    units = [name for name, m in module.named_modules() if m is not module and isinstance(m, unit_classes)]
    description["unit modules"] = repr(units)
    description["group sizes"] = repr(
        {"dp_shard": dp.size}
        | ({"dp_outer": dp.outer.size} if dp.outer is not None else {})
        | ({"expert": dp.expert.size} if dp.expert is not None else {})
    )
    for name, param in module.named_parameters():
        # A DTensor's shape is its global one: equal on every rank even where local pieces differ.
        description[f"parameter {name}"] = f"{tuple(param.shape)} {param.dtype} requires_grad={param.requires_grad}"
    return description


def check_same_configuration_on_all_ranks(description: dict[str, str], dp: DataParallelGroup, timeout: float | None) -> None:
    """Raises the same ``ValueError`` on every rank of each of ``dp``'s groups when their
    descriptions differ. A collective over each group (dp_shard, dp_outer, expert)."""
    groups = [dp.group] + [g.group for g in (dp.outer, dp.expert) if g is not None]
    for group in groups:
        _check_group(description, group, timeout)


def _digest(description: dict[str, str]) -> int:
    encoded = json.dumps(description, sort_keys=True).encode()
    return int.from_bytes(hashlib.sha256(encoded).digest()[:8], "little", signed=True)


def _check_group(description: dict[str, str], group: dist.ProcessGroup, timeout: float | None) -> None:
    size = dist.get_world_size(group)
    if size == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    local = torch.tensor([_digest(description)], dtype=torch.int64, device=device)
    gathered = torch.empty(size, dtype=torch.int64, device=device)
    work = all_gather_shards(gathered, local, group, async_op=True)
    wait_for(work, timeout, "fully_shard's check that every rank has the same configuration", group, device)
    # A simulated rank's gather brings no other rank's digest: its world agrees by construction.
    if not holds_values(gathered) or len(set(gathered.tolist())) == 1:
        return
    descriptions: list[dict[str, str] | None] = [None] * size
    dist.all_gather_object(descriptions, description, group=group)
    raise ValueError(_mismatch_message(descriptions, dist.get_process_group_ranks(group)))


def _mismatch_message(descriptions: list[dict[str, str]], ranks: list[int]) -> str:
    """The same text on every rank: each differing entry with its values and the (global) ranks
    holding each value."""
    keys = list(dict.fromkeys(key for d in descriptions for key in d))
    differences = []
    for key in keys:
        holders: dict[str, list[int]] = {}
        for rank, description in zip(ranks, descriptions):
            holders.setdefault(description.get(key, "<absent>"), []).append(rank)
        if len(holders) > 1:
            differences.append(f"{key}: " + "; ".join(f"{value} on ranks {r}" for value, r in holders.items()))
    listed = differences[:_MAX_LISTED]
    if len(differences) > _MAX_LISTED:
        listed.append(f"... and {len(differences) - _MAX_LISTED} more differences")
    return (
        "fully_shard: the ranks shard different models or configurations, so their collectives would not match "
        "(a hang). Pass the same arguments and build the same model on every rank. Differences:\n  "
        + "\n  ".join(listed)
    )
