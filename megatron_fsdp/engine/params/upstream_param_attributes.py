"""The attributes upstream megatron-fsdp sets on its distributed parameters, set here on ours:
the DTensor faces ``MegatronFSDP.parameters()`` gives. Clients use them with upstream's meaning:
megatron-core's DTensor checkpointing (``megatron_fsdp_slice``, ``megatron_fsdp_dist_index``), its
gradient clipping (``__fsdp_param__``), upstream's ``fully_shard_optimizer`` and NeMo Automodel,
which stamps ``_megatron_fsdp_model`` on ``model.parameters()`` before calling it.

On each face:

- ``_megatron_fsdp_model``: the owning ``MegatronFSDP`` (how ``fully_shard_optimizer`` finds the
  model from an optimizer's parameters).
- ``__fsdp_param__``: True, the parameter is managed by megatron_fsdp.
- ``orig_param``: the model parameter the face stands for (the compute weight forward uses).
- ``megatron_fsdp_dist_index``: the ``FSDPDistributedIndex`` the model is sharded over.
- ``megatron_fsdp_slice``: this rank's range of the flattened (local) parameter.
- ``reset_attribute()``: copies Megatron-Core's marks (``tensor_model_parallel``,
  ``partition_dim``, ...) from ``orig_param`` onto the face; called once here.
- ``_is_shared``: True on a parameter the model holds under more than one name (a tied weight);
  absent on the others, as upstream's.

On each model parameter, as upstream: ``__fsdp_param__ = True`` and
``grad_added_to_main_grad = False`` (read by Transformer Engine's fused weight-gradient paths).

Each attribute is set only where missing, so calling :func:`mark_distributed_params` again
re-applies what was lost and keeps what a client set (upstream's
``_replace_param_with_distributed_if_needed`` stamps the same way). The faces are never held by
C++ (no autograd graph holds them), so their back-references to the model form ordinary cycles
that the garbage collector frees with the model.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from megatron_fsdp.engine.params.sharded_params import ShardedParam

# What upstream's reset_attribute copies from the model parameter, less ``requires_grad``: a
# face's is fixed when the model is sharded (buckets are grouped by it).
MEGATRON_CORE_ATTRIBUTES = (
    "sequence_parallel",
    "shared",
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "is_embedding_or_output_parameter",
    "is_embedding_parameter",
    "_tensor_parallel_mode",
)


def copy_megatron_core_attributes(face: nn.Parameter, orig_param: nn.Parameter) -> None:
    """Upstream's ``reset_attribute``: the Megatron-Core marks of ``orig_param`` onto ``face``."""
    for name in MEGATRON_CORE_ATTRIBUTES:
        if hasattr(orig_param, name):
            setattr(face, name, getattr(orig_param, name))


def _set_missing(target: Any, name: str, value: Any) -> bool:
    if hasattr(target, name):
        return False
    setattr(target, name, value)
    return True


def mark_distributed_params(
    owner: nn.Module, module: nn.Module, faces: Mapping[nn.Parameter, ShardedParam], dist_index: Any
) -> None:
    """Sets upstream's attributes (see the module docstring) where missing: on the face of each
    parameter of ``module`` (``faces``: model parameter -> its face) and on the parameter."""
    # By object: the model may register either the parameters or (megatron-core's view, between
    # steps) their faces; a tied weight is one object under several names either way.
    places = Counter(id(param) for _, param in module.named_parameters(remove_duplicate=False))
    for param, sharded in faces.items():
        face = sharded.param
        _set_missing(param, "__fsdp_param__", True)
        _set_missing(param, "grad_added_to_main_grad", False)
        _set_missing(face, "_megatron_fsdp_model", owner)
        _set_missing(face, "__fsdp_param__", True)
        _set_missing(face, "orig_param", param)
        _set_missing(face, "megatron_fsdp_dist_index", dist_index)
        _set_missing(face, "megatron_fsdp_slice", sharded.flat_range())
        if _set_missing(face, "reset_attribute", functools.partial(copy_megatron_core_attributes, face, param)):
            face.reset_attribute()
        if max(places[id(param)], places[id(face)]) > 1:
            _set_missing(face, "_is_shared", True)
