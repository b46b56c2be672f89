"""What ``megatron.core.distributed.fsdp.src.megatron_fsdp`` is once
:func:`megatron_fsdp.integrations.megatron_core.install` has run: megatron_fsdp's public names,
with ``MegatronFSDP`` the flavour megatron-core's ``FullyShardedDataParallel`` adapter needs
(:class:`~megatron_fsdp.integrations.mcore_fsdp.MegatronCoreFSDP`)."""

from megatron_fsdp.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_fsdp.engine.groups.distributed_index import FSDPDistributedIndex
from megatron_fsdp.fully_shard import fully_shard, fully_shard_model, fully_shard_optimizer
from megatron_fsdp.integrations.mcore_fsdp import MegatronCoreFSDP as MegatronFSDP
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.package_info import __version__

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
