"""megatron_fsdp: fully sharded data parallelism for PyTorch on flat, per-unit, dtype-aware buffers."""

from megatron_fsdp.api import fully_shard, fully_shard_model, fully_shard_optimizer
from megatron_fsdp.checkpoint_io import (
    export_safetensors,
    full_state_dict,
    latest_checkpoint_step,
    load_checkpoint,
    save_checkpoint,
)
from megatron_fsdp.checkpoint_integrity import CheckpointCorruptError
from megatron_fsdp.config import MixedPrecisionPolicy, ShardingStrategy
from megatron_fsdp.distributed_index import FSDPDistributedIndex
from megatron_fsdp.grad_clip import clip_grad_norm_, total_grad_norm
from megatron_fsdp.megatron_config import DistributedDataParallelConfig, add_megatron_fsdp_args, ddp_config_from_args
from megatron_fsdp.module import MegatronFSDP
from megatron_fsdp.package_info import (
    __contact_emails__,
    __contact_names__,
    __description__,
    __download_url__,
    __homepage__,
    __keywords__,
    __license__,
    __package_name__,
    __repository_url__,
    __shortversion__,
    __version__,
)
from megatron_fsdp.state_dict_broadcast import install as _install_state_dict_broadcast

_install_state_dict_broadcast()

__all__ = [
    "CheckpointCorruptError",
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "ShardingStrategy",
    "add_megatron_fsdp_args",
    "clip_grad_norm_",
    "ddp_config_from_args",
    "export_safetensors",
    "full_state_dict",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "latest_checkpoint_step",
    "load_checkpoint",
    "save_checkpoint",
    "total_grad_norm",
    "__contact_emails__",
    "__contact_names__",
    "__description__",
    "__download_url__",
    "__homepage__",
    "__keywords__",
    "__license__",
    "__package_name__",
    "__repository_url__",
    "__shortversion__",
    "__version__",
]
