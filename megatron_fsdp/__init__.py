"""megatron_fsdp: fully sharded data parallelism for PyTorch on flat, per-unit, dtype-aware buffers."""

from megatron_fsdp.checkpoint.integrity import CheckpointCorruptError
from megatron_fsdp.checkpoint.pretrained import save_pretrained
from megatron_fsdp.checkpoint.pretrained_load import load_pretrained
from megatron_fsdp.checkpoint.io import (
    export_safetensors,
    full_state_dict,
    latest_checkpoint_step,
    load_checkpoint,
    save_checkpoint,
)
from megatron_fsdp.checkpoint.safe_reader import SafeFileSystemReader, UnsafeCheckpointError
from megatron_fsdp.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_fsdp.engine.config import ShardingStrategy
from megatron_fsdp.engine.groups.distributed_index import FSDPDistributedIndex
from megatron_fsdp.engine.params.piece_dtensor import ShardedSaveError
from megatron_fsdp.fully_shard import fully_shard, fully_shard_model, fully_shard_optimizer
from megatron_fsdp.integrations.megatron_lm import add_megatron_fsdp_args, ddp_config_from_args
from megatron_fsdp.megatron_fsdp import MegatronFSDP
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.optim.grad_clip import clip_grad_norm_, total_grad_norm
from megatron_fsdp.optim.whole_tensors import whole_tensor_optimizer
# The function: the package megatron_fsdp.plan_memory holds it and the command (python -m);
# OptimizerSpec describes to it an optimizer it does not know by name.
from megatron_fsdp.plan_memory import OptimizerSpec, plan_memory
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

__all__ = [
    "CheckpointCorruptError",
    "DistributedDataParallelConfig",
    "FSDPDistributedIndex",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "OptimizerSpec",
    "SafeFileSystemReader",
    "ShardedSaveError",
    "ShardingStrategy",
    "UnsafeCheckpointError",
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
    "load_pretrained",
    "plan_memory",
    "save_checkpoint",
    "save_pretrained",
    "total_grad_norm",
    "whole_tensor_optimizer",
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

