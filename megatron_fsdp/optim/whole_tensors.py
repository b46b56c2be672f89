"""Optimizers that need whole tensors (Muon's orthogonalisation, Shampoo- or SOAP-style
preconditioners) step whole parameters and whole gradients, not the flat pieces under the faces.

A rank's piece of a parameter is a contiguous range of its flattened values, which is no matrix.
For an optimizer that needs whole tensors (``torch.optim.Muon``, and any class declared with
:func:`whole_tensor_optimizer`), the swap around its step puts in, in place of the faces, plain
tensors of the parameters' global shapes holding the main weights, their ``.grad`` the reduced
gradients. Each tensor has one *owner* rank of its shard group (owner_placement.py): only the
owner receives it whole, steps it with the optimizer's own step and keeps its state (whole), and
every rank gets its piece of the new weights back. ``optimizer.state_dict()`` shows that state as
the same flat-piece DTensors as Adam's (owner_state.py). A face split over several mesh dims (tensor
or expert parallel, HFSDP's split pieces) has its owner among all their ranks; a face replicated
over a dim (HSDP) has one owner in each replica, and so has a tensor-parallel block that data
parallelism leaves whole (``no_shard``, HSDP over a dp_shard of one rank, strided splits too),
among its tp ranks; a face whole on every rank (``no_shard``) has one owner among them all.
Faces the exchanges do not cover (host pieces of a GPU mesh), and every face of an optimizer
declared with ``placement="replicated"``, are gathered and stepped on every rank instead.
docs/whole_matrix_optimizers.md has the costs.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megatron_fsdp.engine.buckets.faces import FaceSource, local_piece
from megatron_fsdp.engine.groups.collectives import all_gather_shards
from megatron_fsdp.engine.params.piece_dtensor import plain_attribute_access
from megatron_fsdp.engine.params.owner_assignment import assign_owners
from megatron_fsdp.optim.owner_placement import Route, any_rank_failed, gather_to_owners, routes_of, scatter_from_owners
from megatron_fsdp.optim.owner_state import show_owner_state, state_to_owners

Placement = Literal["owner", "replicated"]
# A declaration lives on the class it declares, as this attribute (its placement); a subclass takes
# its nearest declared base's. torch's Muon is declared without writing on torch's class.
_DECLARATION = "_megatron_fsdp_whole_tensors"
_DECLARED_BY_DEFAULT: dict[type, Placement] = {torch.optim.Muon: "owner"} if hasattr(torch.optim, "Muon") else {}

OptimizerClass = TypeVar("OptimizerClass", bound=type)


def whole_tensor_optimizer(optimizer_class: OptimizerClass, placement: Placement = "owner") -> OptimizerClass:
    """Declares that ``optimizer_class`` (and its subclasses) must step whole parameters and whole
    gradients; returns the class, so it also serves as a class decorator. ``torch.optim.Muon`` is
    declared already. Declare before the first step; an optimizer declared after it went on
    stepping pieces keeps flat state that no longer fits.

    ``placement``: ``"owner"`` (default) steps each tensor on one rank of its shard group, for a
    step that treats each tensor on its own (Muon, Shampoo); ``"replicated"`` gathers every tensor
    on every rank and steps them all there, for a step that couples tensors (a norm over all of
    them, say), which an owner seeing only its own tensors would compute wrongly."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"whole_tensor_optimizer takes a torch.optim.Optimizer subclass, not {optimizer_class!r}")
    if placement not in ("owner", "replicated"):
        raise ValueError(f"whole_tensor_optimizer's placement is 'owner' or 'replicated', not {placement!r}")
    setattr(optimizer_class, _DECLARATION, placement)
    return optimizer_class


def needs_whole_tensors(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s class was declared to need whole tensors."""
    return _declared_placement(type(optimizer)) is not None


def _declared_placement(optimizer_class: type) -> Placement | None:
    for cls in optimizer_class.__mro__:
        placement = vars(cls).get(_DECLARATION, _DECLARED_BY_DEFAULT.get(cls))
        if placement is not None:
            return placement
    return None


def _placement(optimizer: torch.optim.Optimizer) -> Placement:
    placement = _declared_placement(type(optimizer))
    if placement is None:
        raise AssertionError(f"{type(optimizer).__name__} was not declared to need whole tensors")
    return placement


def note_flat_pieces(error: BaseException, optimizer: torch.optim.Optimizer) -> None:
    """Adds to an error raised by an optimizer stepping flat pieces what it saw and how to declare
    it, keeping the optimizer's own message and type (every rank stepped pieces alike)."""
    error.add_note(
        f"megatron_fsdp stepped {type(optimizer).__name__} on this rank's flat 1-D pieces of the sharded "
        "parameters; if it needs whole tensors, declare its class with "
        "megatron_fsdp.whole_tensor_optimizer(cls) before the first step (docs/whole_matrix_optimizers.md)"
    )


def _refuse_before_exchange(optimizer: torch.optim.Optimizer, faces: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """torch's Muon checks each gradient's shape inside its step, which runs on the owner only:
    the same check, with torch's message, on every rank before any collective."""
    if isinstance(optimizer, getattr(torch.optim, "Muon", ())):
        if any(grad is not None and face.dim() != 2 for face, grad in zip(faces, grads)):
            raise ValueError("Param gradient must be a 2D matrix")  # torch.optim._muon's text


@dataclasses.dataclass
class _Held:
    """What one step's swap put in: each face's route (None: gathered on every rank), the whole
    tensor stepped for each face this rank steps, and the faces another rank stepped."""

    routes: dict[nn.Parameter, Route | None]
    whole_of: dict[nn.Parameter, nn.Parameter]
    stepped_elsewhere: list[nn.Parameter]


class WholeTensorSwap:
    """The swap for one whole-tensor optimizer's step over the faces ``sources`` knows: whole
    tensors in for the step (on their owners), this rank's piece of each written back after it."""

    def __init__(self, sources: dict[nn.Parameter, FaceSource]) -> None:
        self._sources = sources
        self._held: _Held | None = None
        self._routes_cache: tuple[tuple, dict[nn.Parameter, Route | None]] | None = None

    def routes(self, optimizer: torch.optim.Optimizer, faces: list[nn.Parameter]) -> dict[nn.Parameter, Route | None]:
        """Each face's route with its owner, from metadata alone (the same on every rank); the
        owners are balanced over all of ``optimizer``'s faces of one mesh, so they stay put."""
        key = (_placement(optimizer), tuple(id(face) for face in faces))
        if self._routes_cache is not None and self._routes_cache[0] == key:
            return self._routes_cache[1]
        if key[0] == "owner":
            sources = [self._sources[face] for face in faces]
            found = routes_of([source.spec for source in sources], [source.piece for source in sources])
        else:
            found = [None] * len(faces)
        routes: dict[nn.Parameter, Route | None] = dict(zip(faces, found))
        per_mesh: dict[DeviceMesh, list[nn.Parameter]] = {}
        for face, route in routes.items():
            if route is not None:
                per_mesh.setdefault(route.mesh, []).append(face)
        for mesh, members in per_mesh.items():
            owners = assign_owners([routes[face].shape for face in members], mesh.size(0))
            for face, owner in zip(members, owners):
                routes[face] = dataclasses.replace(routes[face], owner=owner)
        self._routes_cache = (key, routes)
        return routes

    def swap_in(self, optimizer: torch.optim.Optimizer, strict: bool) -> list[list[torch.Tensor]]:
        """Brings each face's main weights and gradient whole to its owner (one all-to-all per mesh
        and dtype) or, without a route, to every rank (gather_whole), and puts the tensors this
        rank steps, with their whole state, in ``optimizer``. Shapes torch would refuse raise
        first, on every rank."""
        faces_per_group = [group["params"] for group in optimizer.param_groups]
        faces = [param for params in faces_per_group for param in params if self._known(param, strict)]
        with plain_attribute_access():
            grads = [param.grad for param in faces]
        _refuse_before_exchange(optimizer, faces, grads)
        routes = self.routes(optimizer, faces)
        state_to_owners(optimizer.state, routes, self._sources)
        whole_of: dict[nn.Parameter, nn.Parameter] = {}
        with torch.no_grad():
            self._gather_routed(faces, grads, routes, whole_of)
            self._gather_everywhere(faces, grads, routes, whole_of)
        stepped_elsewhere = [face for face in faces if routes[face] is not None and face not in whole_of]
        # A set: ``in`` on a list of tensors would compare them elementwise.
        elsewhere = set(stepped_elsewhere)
        wholes_per_group = [[whole_of.get(param, param) for param in params if param not in elsewhere] for params in faces_per_group]
        plain_state: defaultdict = defaultdict(dict)
        for key, entries in optimizer.state.items():
            if key in whole_of:
                plain_state[whole_of[key]] = {name: _whole_value(value) for name, value in entries.items()}
            elif key not in routes:
                plain_state[key] = entries
        for group, wholes in zip(optimizer.param_groups, wholes_per_group):
            group["params"] = wholes
        optimizer.state = plain_state
        self._held = _Held(routes, whole_of, stepped_elsewhere)
        return faces_per_group

    def _gather_routed(
        self, faces: list[nn.Parameter], grads: list[torch.Tensor | None], routes: dict, whole_of: dict[nn.Parameter, nn.Parameter]
    ) -> None:
        """Weights and gradients of the routed faces to their owners, one exchange per mesh and
        weight dtype (gradients kept below the weights' dtype are stepped in the weights' dtype)."""
        batches: dict[tuple[DeviceMesh, torch.dtype], list[tuple[nn.Parameter, torch.Tensor | None]]] = {}
        for face, grad in zip(faces, grads):
            if routes[face] is not None:
                batches.setdefault((routes[face].mesh, self._sources[face].piece.dtype), []).append((face, grad))
        for members in batches.values():
            with_grad = [(face, grad) for face, grad in members if grad is not None]
            exchanged = gather_to_owners(
                [routes[face] for face, _ in members] + [routes[face] for face, _ in with_grad],
                [self._sources[face].piece for face, _ in members] + [self._grad_piece(face, grad) for face, grad in with_grad],
            )
            grad_wholes = dict(zip((face for face, _ in with_grad), exchanged[len(members) :]))
            for (face, _), weight in zip(members, exchanged):
                if weight is None:
                    continue
                whole_of[face] = nn.Parameter(weight.view(routes[face].shape), requires_grad=False)
                if face in grad_wholes:
                    whole_of[face].grad = grad_wholes[face].view(routes[face].shape)

    def _grad_piece(self, face: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        source = self._sources[face]
        return local_piece(grad, source.piece, source.start, source.extent, source.spec).to(source.piece.dtype)

    def _gather_everywhere(
        self, faces: list[nn.Parameter], grads: list[torch.Tensor | None], routes: dict, whole_of: dict[nn.Parameter, nn.Parameter]
    ) -> None:
        """The faces without a route, whole on every rank."""
        others = [(face, grad) for face, grad in zip(faces, grads) if routes[face] is None]
        gathered = iter(gather_whole([face for face, _ in others] + [grad for _, grad in others if grad is not None]))
        for face, _ in others:
            whole_of[face] = nn.Parameter(next(gathered), requires_grad=False)
        for face, grad in others:
            if grad is not None:
                whole_of[face].grad = next(gathered).to(whole_of[face].dtype)

    def swap_out(self, optimizer: torch.optim.Optimizer, faces_per_group: list[list[torch.Tensor]], raised: bool) -> None:
        """Sends each rank its piece of every stepped tensor and writes it into the main weights,
        unless the step raised on any rank (then every rank keeps its weights, and a rank whose
        own step passed raises too), and puts the faces back with the state keyed by them."""
        held, self._held = self._held, None
        meshes = list(dict.fromkeys(route.mesh for route in held.routes.values() if route is not None))
        # An owner's step may raise where the others' did not: all agree before the exchange back.
        failed = any_rank_failed(meshes, raised) if meshes else raised
        with torch.no_grad():
            for face, whole in held.whole_of.items():
                if raised and whole.grad is None:
                    with plain_attribute_access():
                        face.grad = None
                whole.grad = None  # done with: its memory is free for the exchange back
            if not failed:
                self._scatter_back(held)
        face_of = {whole: face for face, whole in held.whole_of.items()}
        by_key = {face_of.get(key, key): entries for key, entries in optimizer.state.items()}
        with plain_attribute_access():
            # Its owner made state for it: every rank then holds state (torch's distributed
            # state-dict helpers take a step on a rank whose state is empty).
            for face in held.stepped_elsewhere:
                if face.grad is not None:
                    by_key[face] = {}
        # In the faces' order on every rank: state_dict() packs it in this order, and every rank
        # must meet the entries' collectives (a full_tensor(), a load) in the same order.
        shown: defaultdict = defaultdict(dict)
        for face in held.routes:
            if face in by_key:
                shown[face] = by_key.pop(face)
        shown.update(by_key)
        optimizer.state = shown
        for group, faces in zip(optimizer.param_groups, faces_per_group):
            group["params"] = faces
        if failed and not raised:
            raise RuntimeError(
                f"{type(optimizer).__name__}'s step raised on another rank, which steps some of its whole tensors "
                "(see that rank's error); no rank changed its weights"
            )

    def _scatter_back(self, held: _Held) -> None:
        batches: dict[tuple[DeviceMesh, torch.dtype], list[nn.Parameter]] = {}
        for face, route in held.routes.items():
            if route is not None:
                batches.setdefault((route.mesh, self._sources[face].piece.dtype), []).append(face)
            elif face in held.whole_of:
                source = self._sources[face]
                whole = held.whole_of[face].detach()
                source.piece.copy_(local_piece(whole, source.piece, source.start, source.extent, source.spec))
        for members in batches.values():
            wholes = [held.whole_of[face].detach() if face in held.whole_of else None for face in members]
            into = [self._sources[face].piece.view(-1) for face in members]
            scatter_from_owners([held.routes[face] for face in members], wholes, into)

    def shown_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A state-dict post-hook: each owner-held state entry as every rank's piece of it
        (owner_state.py), so the state dict holds global shapes on every rank."""
        faces = [param for group in optimizer.param_groups for param in group["params"]]
        keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        known = [(key, face) for key, face in zip(keys, faces) if face in self._sources]
        routes = self.routes(optimizer, [face for _, face in known])
        show_owner_state(state_dict["state"], known, routes, self._sources)
        return state_dict

    def face_layouts(self, state: dict[Any, dict[str, Any]], keys: list[Any], faces: list[torch.Tensor]) -> dict:
        """Loaded as it is; the next step brings it to the tensors' owners (owner_state.py)."""
        return state

    def note_step_error(self, error: BaseException, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to add: the step saw whole tensors, as it asked."""

    def _known(self, param: torch.Tensor, strict: bool) -> bool:
        """Whether ``param`` is a face to gather; another tensor stays in the step as it is, or
        raises when ``strict``."""
        if param in self._sources:
            return True
        if strict:
            raise ValueError(
                "an optimizer param group holds a tensor that is not a parameter of the sharded model; add "
                "model.parameters() (after fully_shard) to the optimizer, not other tensors"
            )
        return False


def gather_whole(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor whole, as plain tensors. Flat-sharded pieces over one data-parallel mesh dim
    go in one all-gather per (mesh, dtype), every rank sending all its pieces at once; other
    DTensors (tensor-parallel, HFSDP's split pieces, host pieces) gather one by one
    (``full_tensor()``). Every rank must pass the same tensors in the same order."""
    wholes: list[torch.Tensor | None] = [None] * len(tensors)
    batches: dict[tuple[Any, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        layout = getattr(tensor, "_flat_layout", None)
        batchable = (
            layout is not None
            and layout.dp_dims == 1
            and len(tensor.placements) == 1
            and tensor._local_tensor.device.type == tensor.device_mesh.device_type
        )
        if batchable:
            batches.setdefault((tensor.device_mesh, tensor.dtype), []).append(index)
        elif isinstance(tensor, DTensor):
            wholes[index] = tensor.full_tensor()
        else:
            wholes[index] = tensor.detach().clone()
    for (mesh, _), indices in batches.items():
        for index, whole in zip(indices, _gather_flat_pieces([tensors[i] for i in indices], mesh)):
            wholes[index] = whole
    return wholes


def _gather_flat_pieces(tensors: list[DTensor], mesh: Any) -> list[torch.Tensor]:
    """The whole of each flat-sharded DTensor of ``mesh`` (one dim) by a single all-gather: rank i
    sends its pieces back to back, padded to the longest rank's total."""
    world = mesh.size(0)
    lengths = [[tensor._flat_layout.pieces[rank][1] for tensor in tensors] for rank in range(world)]
    longest = max(sum(row) for row in lengths)
    local = torch.cat([tensor._local_tensor.detach().reshape(-1) for tensor in tensors])
    padded = local.new_zeros(longest)
    padded[: local.numel()].copy_(local)
    gathered = local.new_empty(world * longest)
    all_gather_shards(gathered, padded, mesh.get_group(0))
    rows = gathered.view(world, longest)
    per_rank = [row.split([*lengths[rank], longest - sum(lengths[rank])]) for rank, row in enumerate(rows)]
    return [
        torch.cat([per_rank[rank][k] for rank in range(world)]).view(tensor._flat_layout.local_shape)
        for k, tensor in enumerate(tensors)
    ]


def _whole_value(value: Any) -> Any:
    """A state entry as the whole-tensor step keeps it: plain and whole (a loaded checkpoint may
    hold DTensors)."""
    return value.full_tensor() if isinstance(value, DTensor) else value
