"""What ``megatron.core.distributed.fsdp.src.megatron_fsdp`` is once
:func:`megatron_fsdp.integrations.megatron_core.install` has run: megatron_fsdp's public names,
with ``MegatronFSDP`` the flavour megatron-core's ``FullyShardedDataParallel`` adapter needs
(:class:`~megatron_fsdp.integrations.mcore_fsdp.MegatronCoreFSDP`)."""

from megatron_fsdp import (
    DistributedDataParallelConfig,
    FSDPDistributedIndex,
    MixedPrecisionPolicy,
    __version__,
    fully_shard,
    fully_shard_model,
    fully_shard_optimizer,
)
from megatron_fsdp.integrations.mcore_fsdp import MegatronCoreFSDP as MegatronFSDP

__all__ = [
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "__version__",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
]
