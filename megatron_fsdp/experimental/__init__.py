"""Upstream megatron-fsdp's v2 names (Megatron-LM's ``megatron_fsdp.experimental``: in-place,
per-module ``fully_shard(module, mesh, placements, mixed_precision_policy, grad_divisor)``) over
the same implementation as :mod:`megatron_fsdp.fsdp2`: one engine unit per call; and its
``DBuffer`` (with the placements ``Flat``, ``Replicate``, ``Partial``) over the engine's bucket
layout and collectives. What each name does here, and what is not supported: docs/fsdp2.md,
"Upstream's v2 names".
"""

from megatron_fsdp.experimental.checkpoint import load_checkpoint, save_checkpoint
from megatron_fsdp.experimental.dbuffer import DBuffer
from megatron_fsdp.experimental.fully_shard import (
    FullyShardContext,
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    microbatch,
)
from megatron_fsdp.experimental.placement import Flat, Partial, Placement, Replicate

__all__ = [
    "DBuffer",
    "Flat",
    "FullyShardContext",
    "Partial",
    "Placement",
    "Placements",
    "Replicate",
    "fully_shard",
    "fully_shard_context",
    "fully_shard_optimizer",
    "load_checkpoint",
    "microbatch",
    "save_checkpoint",
]
