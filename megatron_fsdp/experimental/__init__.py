"""Upstream megatron-fsdp's v2 names (Megatron-LM's ``megatron_fsdp.experimental``: in-place,
per-module ``fully_shard(module, mesh, placements, mixed_precision_policy, grad_divisor)``) over
the same implementation as :mod:`megatron_fsdp.fsdp2`: one engine unit per call. What each name
does here, and what is not supported: docs/fsdp2.md, "Upstream's v2 names".
"""

from megatron_fsdp.experimental.checkpoint import load_checkpoint, save_checkpoint
from megatron_fsdp.experimental.fully_shard import (
    FullyShardContext,
    Placements,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    microbatch,
)

__all__ = [
    "FullyShardContext",
    "Placements",
    "fully_shard",
    "fully_shard_context",
    "fully_shard_optimizer",
    "load_checkpoint",
    "microbatch",
    "save_checkpoint",
]
