"""A plain torch optimizer over DTensor parameters sharded in place: it steps the plain pieces
under them, its state laid out like the pieces, and the stepped pieces reach the compute weights
where a gather does not read them.

The first ``fully_shard`` call registers this front door's owner resolver with torch's global
optimizer step hooks (``megatron_fsdp/optim/global_step_hooks.py``, shared with the whole-model
wrapper): inside each step of an optimizer over faces of modules sharded in place, its param
groups hold the plain 1-D pieces under them with plain gradients and state, so no DTensor dispatch
lands in the step; outside it, the faces and DTensor state keyed by them, as torch's own FSDP2.

A torch optimizer built over parameters sharded in place makes its state with ``zeros_like`` of
each piece: flat pieces laid out like the parameter. A state dict loaded into it from full tensors
(``set_optimizer_state_dict(..., full_state_dict=True)``) arrives instead as row-sharded DTensors
(torch cuts ``torch.chunk`` rows); the swap before the next step turns such entries into this
rank's pieces (one gather per entry, once). For state already laid out so it costs an identity
check per entry.

With CPU offloading the pieces live on the host and the device keeps a weight shard; after each
step the pieces of each unit the optimizer stepped go to the device (``after_piece_step``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from megatron_fsdp.optim.global_step_hooks import step_faces_as_pieces

# The attribute on a DTensor parameter sharded in place: its state, weakly.
OWNER_ATTRIBUTE = "_megatron_fsdp2_owner"

_resolver: list[RemovableHandle] = []


def track(face: torch.nn.Parameter, state: Any) -> None:
    """``face`` (stepped by optimizers) is a parameter of ``state``'s unit."""
    setattr(face, OWNER_ATTRIBUTE, weakref.ref(state))
    if not _resolver:
        _resolver.append(step_faces_as_pieces(_owner))


def _owner(param: torch.Tensor) -> Any:
    """The state whose unit ``param`` is a face of, or None."""
    owner = getattr(param, OWNER_ATTRIBUTE, None)
    return owner() if owner is not None else None
