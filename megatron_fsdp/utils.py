"""Upstream megatron-fsdp's ``utils`` module, as far as megatron-core imports it: a face over
megatron_fsdp's own modules (``FSDPDistributedIndex`` lives in :mod:`megatron_fsdp.engine.groups.distributed_index`).

The tensor-parallel helpers read Megatron-Core's marks on a parameter: ``tensor_model_parallel``
with ``partition_dim`` (set by its parallel layers), or ``_tensor_parallel_mode`` (``"column"``:
dim 0, ``"row"``: dim 1, set by megatron-core's FSDP adapter).
"""

from __future__ import annotations

from torch import nn

from megatron_fsdp.engine.groups.distributed_index import FSDPDistributedIndex
from megatron_fsdp.engine.params.dtensor_params import (
    get_mcore_tensor_parallel_partition_dim,
    is_mcore_tensor_model_parallel,
    is_mcore_tensor_parallel_duplicated,
    using_tensor_parallel,
)
from megatron_fsdp.megatron_fsdp import MegatronFSDP

__all__ = [
    "FSDPDistributedIndex",
    "find_megatron_fsdp",
    "get_mcore_tensor_parallel_partition_dim",
    "is_mcore_tensor_model_parallel",
    "is_mcore_tensor_parallel_duplicated",
    "using_tensor_parallel",
]


def find_megatron_fsdp(model: nn.Module | None) -> MegatronFSDP | None:
    """The :class:`~megatron_fsdp.MegatronFSDP` in ``model``'s chain of ``.module`` wrappers
    (``model`` itself included), or None."""
    while model is not None:
        if isinstance(model, MegatronFSDP):
            return model
        model = getattr(model, "module", None)
    return None
