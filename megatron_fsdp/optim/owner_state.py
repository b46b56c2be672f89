"""A whole-tensor optimizer's owner-held state, shown in its state dict as the same flat-piece
DTensors as Adam's state, and brought back to the owners after a load.

Between steps the state of each routed tensor (owner_placement.py) lives whole on its owner only
(*owner form*; the other ranks hold an empty entry once it exists). ``state_dict()`` sends each
rank its piece of every per-element entry (an entry of the tensor's shape, as Muon's momentum
buffer), so every rank's state dict holds a DTensor of the global shape laid out like the
parameter's face: ``torch.distributed.checkpoint`` writes it as it writes Adam's moments and loads
it at any world size. Other entries (a step count, a preconditioner of another shape) are sent
whole to every rank and saved as replicated. A loaded state dict leaves such DTensors (or whole
plain tensors) on every rank (*loaded form*); the next step first gathers them to their owners.
Both forms are told apart from the entries' types alone, which a load makes the same on every
rank, so every rank takes the same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp.engine.buckets.faces import FaceSource, holds_this_piece
from megatron_fsdp.engine.params.sharded_params import sharded_dtensor
from megatron_fsdp.optim.owner_placement import Route, gather_to_owners, scatter_from_owners


@dataclass(frozen=True)
class _PerElement:
    """Stands for a per-element entry in what an owner tells the other ranks it holds."""

    dtype: torch.dtype


def _loaded(entries: dict[str, Any]) -> bool:
    return any(isinstance(value, DTensor) for value in entries.values())


def state_to_owners(state: dict[Any, dict[str, Any]], routes: dict[nn.Parameter, Route | None], sources: dict[nn.Parameter, FaceSource]) -> None:
    """Brings the routed faces' state in ``state`` (keyed by face) to owner form, in place: each
    per-element DTensor's pieces gathered whole to the owner (one all-to-all per mesh and dtype),
    a DTensor of another layout gathered on every rank; the other ranks keep an empty entry."""
    batches: dict[tuple[Any, torch.dtype], list[tuple[nn.Parameter, str, torch.Tensor]]] = {}
    for face, route in routes.items():
        if route is None or not state.get(face):
            continue
        owned = route.mesh.get_local_rank(0) == route.owner
        entries = state[face]
        if not _loaded(entries):
            # Owner form already, or a state dict of plain whole tensors: the owner keeps it.
            state[face] = entries if owned else {}
            continue
        kept = {}
        for name, value in entries.items():
            if isinstance(value, DTensor) and value.dim() > 0 and holds_this_piece(value, sources[face].spec):
                batches.setdefault((route.mesh, value.dtype), []).append((face, name, value._local_tensor.reshape(-1)))
            else:
                kept[name] = value.full_tensor() if isinstance(value, DTensor) else value
        state[face] = kept if owned else {}
    for members in batches.values():
        wholes = gather_to_owners([routes[face] for face, _, _ in members], [piece for _, _, piece in members])
        for (face, name, _), whole in zip(members, wholes):
            if whole is not None:
                state[face][name] = whole.view(routes[face].shape)


def show_owner_state(
    state: dict[Any, dict[str, Any]],
    known: list[tuple[Any, nn.Parameter]],
    routes: dict[nn.Parameter, Route | None],
    sources: dict[nn.Parameter, FaceSource],
) -> None:
    """Puts in a packed state dict's ``state`` (keyed as ``known`` pairs keys with faces), in
    place of each owner-held entry, every rank's view of it: per-element entries as this rank's
    piece (a DTensor laid out like the face), other entries whole. One object all-gather per mesh
    tells every rank what the owners hold, then one all-to-all per mesh and dtype sends the pieces."""
    per_mesh: dict[Any, list[tuple[Any, nn.Parameter]]] = {}
    for key, face in known:
        route = routes[face]
        if route is not None and not _loaded(state.get(key, {})):
            per_mesh.setdefault(route.mesh, []).append((key, face))
    for mesh, members in per_mesh.items():
        me = mesh.get_local_rank(0)
        mine = {key: _describe(state.get(key, {}), routes[face].shape) for key, face in members if routes[face].owner == me}
        told: list[dict] = [{} for _ in range(mesh.size(0))]
        dist.all_gather_object(told, mine, group=mesh.get_group(0))
        held = {key: entries for described in told for key, entries in described.items()}
        per_dtype: dict[torch.dtype, list[tuple[Any, nn.Parameter, str]]] = {}
        shown: dict[Any, dict[str, Any]] = {}
        for key, face in members:
            shown[key] = {}
            for name, value in held.get(key, {}).items():
                if isinstance(value, _PerElement):
                    per_dtype.setdefault(value.dtype, []).append((key, face, name))
                else:
                    shown[key][name] = state[key][name] if routes[face].owner == me else value
        for dtype, entries in per_dtype.items():
            like = torch.empty(0, dtype=dtype, device=sources[entries[0][1]].piece.device)
            wholes = [state[key][name].detach() if routes[face].owner == me else None for key, face, name in entries]
            entry_routes = [routes[face] for _, face, _ in entries]
            pieces = [like.new_empty(route.piece_length(me)) for route in entry_routes]
            scatter_from_owners(entry_routes, wholes, into=pieces)
            for (key, face, name), piece in zip(entries, pieces):
                source = sources[face]
                shown[key][name] = sharded_dtensor(piece.view(source.piece.shape), source.spec)
        for key, entries in shown.items():
            if entries:
                state[key] = entries
            else:
                state.pop(key, None)


def _describe(entries: dict[str, Any], shape: torch.Size) -> dict[str, Any]:
    """An owner's entries as the other ranks learn them: per-element tensors by their dtype
    (their pieces follow), everything else as it is."""
    return {
        name: _PerElement(value.dtype) if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape else value
        for name, value in entries.items()
    }
