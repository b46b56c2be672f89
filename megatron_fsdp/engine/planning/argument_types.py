"""Type checks of ``fully_shard_model``'s arguments, before anything else looks at them.

A wrong type must fail here with a message naming the argument, not deep inside torch (a
binding's "incompatible function arguments"), and never be accepted silently (a string "no" is
truthy, so ``overlap_grad_reduce="no"`` would switch overlap on).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import OffloadPolicy

from megatron_fsdp.mixed_precision import MixedPrecisionPolicy

_FLAGS = (
    "init_model_with_meta_device",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "sync_model_each_microbatch",
    "preproc_state_dict_for_dcp_ckpt",
    "check_for_nan_in_grad",
    "report_nan_in_param_grad",
    "fsdp_double_buffer",
    "nccl_ub",
    "average_in_collective",
    "disable_bucketing",
    "calculate_per_token_loss",
    "keep_fp8_transpose_cache",
    "fsdp_db_use_persist_buf_on_alloc_fail",
    "disable_symmetric_registration",
    "enable_fine_grained_param_gather",
    "enable_fine_grained_param_gather_hook",
    "enable_fine_grained_param_gather_backward_hook",
    "use_decoupled_grad",
    "cuda_graph_mode",
    "maxpool_double_buffer",
    "cpu_offload",
)
_OPTIONAL_FLAGS = ("grad_reduce_in_fp32", "preserve_fp32_weights")
_OPTIONAL_MESHES = ("device_mesh", "expt_device_mesh")
_OPTIONAL_NAMES = ("dp_shard_dim", "dp_outer_dim", "tp_dim")
_OPTIONAL_GROUPS = ("hybrid_fsdp_group", "hybrid_fsdp_expt_group", "fsdp_group_ag", "expt_fsdp_group_ag")


def check_argument_types(arguments: dict[str, Any]) -> None:
    """Raises ``TypeError`` naming the first argument of the wrong type, ``ValueError`` for a
    device string torch does not know. Checks the arguments of ``fully_shard_model`` and of
    ``MegatronFSDP``'s constructor that ``arguments`` holds."""
    for name in _FLAGS:
        if name in arguments and not isinstance(arguments[name], bool):
            raise TypeError(f"{name} must be True or False, got {arguments[name]!r}")
    for name in _OPTIONAL_FLAGS:
        if arguments.get(name) is not None and not isinstance(arguments[name], bool):
            raise TypeError(f"{name} must be None, True or False, got {arguments[name]!r}")
    for name in _OPTIONAL_MESHES:
        if arguments.get(name) is not None and not isinstance(arguments[name], DeviceMesh):
            raise TypeError(f"{name} must be a torch.distributed.device_mesh.DeviceMesh or None, got {arguments[name]!r}")
    for name in _OPTIONAL_NAMES:
        if arguments.get(name) is not None and not isinstance(arguments[name], str):
            raise TypeError(f"{name} must be the name of a mesh dim (a str) or None, got {arguments[name]!r}")
    for name in _OPTIONAL_GROUPS:
        if arguments.get(name) is not None and not isinstance(arguments[name], dist.ProcessGroup):
            raise TypeError(f"{name} must be a torch.distributed.ProcessGroup or None, got {arguments[name]!r}")
    policy = arguments.get("mixed_precision_policy")
    if policy is not None and not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"mixed_precision_policy must be a megatron_fsdp.MixedPrecisionPolicy or None, got {policy!r}")
    offload_policy = arguments.get("offload_policy")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "offload_policy must be torch.distributed.fsdp's CPUOffloadPolicy(pin_memory=...) or OffloadPolicy() "
            f"(no offloading) or None, got {offload_policy!r}; or pass cpu_offload=True"
        )
    units = arguments.get("fsdp_unit_modules")
    if units is not None and (isinstance(units, (str, type)) or not isinstance(units, Sequence)):
        raise TypeError(
            f"fsdp_unit_modules must be a list of classes or import paths, got {units!r}; e.g. fsdp_unit_modules=[Block]"
        )
    _check_device(arguments.get("device"))


def _check_device(device: Any) -> None:
    if device is None or isinstance(device, torch.device):
        return
    if not isinstance(device, str):
        raise TypeError(f"device must be a torch.device, a device string like 'cuda:0', or None, got {device!r}")
    try:
        torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device={device!r} is not a device torch knows: {error}") from error
