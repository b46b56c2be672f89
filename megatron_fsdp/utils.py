"""Upstream megatron-fsdp's ``utils`` module, as far as megatron-core imports it: a face over
megatron_fsdp's own modules (``FSDPDistributedIndex`` lives in :mod:`megatron_fsdp.distributed_index`).

The tensor-parallel helpers read Megatron-Core's marks on a parameter: ``tensor_model_parallel``
with ``partition_dim`` (set by its parallel layers), or ``_tensor_parallel_mode`` (``"column"``:
dim 0, ``"row"``: dim 1, set by megatron-core's FSDP adapter).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_fsdp.distributed_index import FSDPDistributedIndex
from megatron_fsdp.module import MegatronFSDP

__all__ = [
    "FSDPDistributedIndex",
    "find_megatron_fsdp",
    "get_mcore_tensor_parallel_partition_dim",
    "is_mcore_tensor_model_parallel",
    "is_mcore_tensor_parallel_duplicated",
    "using_tensor_parallel",
]

_MODE_DIMS = {"column": 0, "row": 1}


def find_megatron_fsdp(model: nn.Module | None) -> MegatronFSDP | None:
    """The :class:`~megatron_fsdp.MegatronFSDP` in ``model``'s chain of ``.module`` wrappers
    (``model`` itself included), or None."""
    while model is not None:
        if isinstance(model, MegatronFSDP):
            return model
        model = getattr(model, "module", None)
    return None


def get_mcore_tensor_parallel_partition_dim(param: torch.Tensor) -> int | None:
    """The dim Megatron-Core splits ``param`` along across tensor-parallel ranks; None for a
    parameter every tensor-parallel rank holds whole."""
    mode_dim = _MODE_DIMS.get(getattr(param, "_tensor_parallel_mode", None))
    if mode_dim is not None:
        return mode_dim
    if getattr(param, "tensor_model_parallel", False):
        partition_dim = getattr(param, "partition_dim", None)
        if partition_dim is not None and partition_dim >= 0:
            return int(partition_dim)
    return None


def is_mcore_tensor_model_parallel(param: torch.Tensor) -> bool:
    """Whether Megatron-Core splits ``param`` across tensor-parallel ranks."""
    return get_mcore_tensor_parallel_partition_dim(param) is not None


def is_mcore_tensor_parallel_duplicated(param: torch.Tensor) -> bool:
    """Whether every tensor-parallel rank holds ``param`` whole."""
    return get_mcore_tensor_parallel_partition_dim(param) is None


def using_tensor_parallel(dist_index: FSDPDistributedIndex, is_expert_parallel: bool = False) -> bool:
    """Whether ``dist_index`` names a tensor-parallel dim of more than one rank."""
    if dist_index.tp_dim is None:
        return False
    return dist_index.get_submesh(dist_index.tp_dim, is_expert_parallel=is_expert_parallel).size() > 1
