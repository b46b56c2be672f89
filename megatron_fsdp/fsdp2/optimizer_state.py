"""A plain torch optimizer over DTensor parameters sharded in place: its state laid out like the
pieces, and the stepped pieces reaching the compute weights where a gather does not read them.

A torch optimizer built over parameters sharded in place makes its state with ``zeros_like``
of each parameter: flat pieces laid out like the parameter. A state dict loaded into it from
full tensors (``set_optimizer_state_dict(..., full_state_dict=True)``) arrives instead as
row-sharded DTensors (torch cuts ``torch.chunk`` rows), which a flat piece cannot be stepped
with. The optimizer belongs to the user, so megatron_fsdp cannot hook its ``load_state_dict``:
a global optimizer step pre-hook, registered by the first ``fully_shard`` call, turns such
entries into this rank's pieces before the step (one gather per entry, once). For state already
laid out so it costs an identity check per entry.

With CPU offloading the pieces live on the host and the device keeps a weight shard; a global
step post-hook sends the stepped pieces of each unit the optimizer stepped to the device.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from megatron_fsdp.checkpoint.state_dicts import FaceSource, to_face_layout

# The attribute on a DTensor parameter sharded in place: (its state, weakly; its compute parameter).
OWNER_ATTRIBUTE = "_megatron_fsdp2_owner"

_hooks: list[RemovableHandle] = []


def track(face: torch.nn.Parameter, state: Any, compute: torch.nn.Parameter) -> None:
    """``face`` (stepped by optimizers) is ``compute``'s piece in ``state``'s unit."""
    setattr(face, OWNER_ATTRIBUTE, (weakref.ref(state), compute))
    if not _hooks:
        _hooks.append(register_optimizer_step_pre_hook(_state_to_piece_layout))
        _hooks.append(register_optimizer_step_post_hook(_install_stepped_pieces))


def _state_to_piece_layout(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = getattr(param, OWNER_ATTRIBUTE, None)
            entries = optimizer.state.get(param) if owner is not None else None
            if not entries:
                continue
            layout = getattr(param, "_flat_layout", None)
            stale = [
                key for key, value in entries.items()
                if isinstance(value, DTensor) and value.dim() > 0 and getattr(value, "_flat_layout", None) is not layout
            ]
            if not stale:
                continue
            state, compute = owner[0](), owner[1]
            if state is None:
                continue
            source: FaceSource = state.face_source(compute)
            for key in stale:
                entries[key] = to_face_layout(entries[key], source, f"optimizer state {key!r}")


def _install_stepped_pieces(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stepped = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = getattr(param, OWNER_ATTRIBUTE, None)
            state = owner[0]() if owner is not None else None
            if state is not None:
                stepped[id(state)] = state
    for state in stepped.values():
        state.install_stepped_main_params()
