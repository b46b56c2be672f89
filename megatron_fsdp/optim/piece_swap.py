"""A torch optimizer over DTensor faces, stepping the plain pieces under them.

Outside ``step`` an optimizer holds what users and torch's tools expect of FSDP: the DTensor faces
in its param groups, their ``.grad``, and DTensor state keyed by them, so ``state_dict()`` and
torch's ``get/set_optimizer_state_dict`` map them to FQNs. Inside ``step`` it holds the plain 1-D
pieces under the faces (the same storage) with plain gradients and state, so no DTensor dispatch
lands in the step and torch's foreach kernels take them. :class:`PieceSwap` makes that swap over
the buckets of any units, the whole-model wrapper's or ``megatron_fsdp.fsdp2``'s: the wrapper's
optimizer (optimizer.py) swaps inside its own ``step``; a plain torch optimizer is swapped by
torch's global step hooks (global_step_hooks.py).

What goes in for the step depends on the optimizer's kind, asked in one place
(:meth:`PieceSwap.kind_of`): an elementwise optimizer (Adam, SGD, ...) steps the pieces
(:class:`ElementwiseSwap`, here); one that needs whole tensors (Muon) steps whole matrices on
their owners (:class:`~megatron_fsdp.optim.whole_tensors.WholeTensorSwap`). A new kind is one more
class with the :class:`KindSwap` methods, chosen there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.buckets.faces import FaceSource, bucket_face_sources, holds_this_piece, to_face_layout
from megatron_fsdp.engine.groups.collectives import holds_values
from megatron_fsdp.engine.params.piece_dtensor import plain_attribute_access
from megatron_fsdp.engine.params.sharded_params import ShardedParam, sharded_dtensor
from megatron_fsdp.optim.whole_tensors import WholeTensorSwap, needs_whole_tensors, note_flat_pieces


@dataclass(frozen=True)
class _Face:
    """One face and what its swap needs: the plain tensor stepped in its place (the main-parameter
    piece; for a frozen parameter, its weight piece), where its values sit, and its name."""

    sharded: ShardedParam
    piece: nn.Parameter
    source: FaceSource
    name: str


class KindSwap(Protocol):
    """What the swap does for one kind of optimizer, over the faces :class:`PieceSwap` knows."""

    def swap_in(self, optimizer: torch.optim.Optimizer, strict: bool) -> list[list[torch.Tensor]]:
        """Puts what the step steps in ``optimizer``; returns the faces per group (for swap_out).
        Everything that can raise comes first: the optimizer is then left as it was."""

    def swap_out(self, optimizer: torch.optim.Optimizer, faces_per_group: list[list[torch.Tensor]], raised: bool) -> None:
        """Puts the faces and their DTensor state back; ``raised``: the step raised."""

    def shown_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A state-dict post-hook: the state as users see it, every rank's piece of each entry."""

    def face_layouts(self, state: dict[Any, dict[str, Any]], keys: list[Any], faces: list[torch.Tensor]) -> dict:
        """Loaded ``state`` (keyed as the state dict keys the optimizer's ``faces``) as it is kept
        between steps."""

    def note_step_error(self, error: BaseException, optimizer: torch.optim.Optimizer) -> None:
        """Adds to an error the optimizer's own step raised what this kind gave it to step."""


class PieceSwap:
    """Swaps an optimizer between the faces of ``buckets`` and what its kind steps in their place
    (see the module docstring).

    ``names``: what errors call each face (default: the bucket's parameter names). ``strict``:
    a parameter of the optimizer that is no face of these buckets raises; otherwise it stays in
    the step as it is (a parameter of no sharded module, say)."""

    def __init__(self, buckets: Iterable[Bucket], names: dict[nn.Parameter, str] | None = None, strict: bool = True) -> None:
        self.strict = strict
        faces: dict[nn.Parameter, _Face] = {}
        for bucket in buckets:
            sources = bucket_face_sources(bucket)
            for index, (sharded, source) in enumerate(zip(bucket.faces, sources)):
                # A frozen bucket has no main parameters: its face's own piece stands in.
                piece = bucket.optim_params[index] if bucket.requires_grad else nn.Parameter(sharded.piece, requires_grad=False)
                name = (names or {}).get(sharded.param, bucket.names[index])
                faces[sharded.param] = _Face(sharded, piece, source, name)
        self._faces = faces
        self._elementwise = ElementwiseSwap(faces)
        self._whole = WholeTensorSwap({param: face.source for param, face in faces.items()})

    def kind_of(self, optimizer: torch.optim.Optimizer) -> KindSwap:
        """The one place that asks what kind of optimizer ``optimizer`` is: the swap of its kind."""
        return self._whole if needs_whole_tensors(optimizer) else self._elementwise

    def covers(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the faces this swap steps as pieces."""
        return param in self._faces

    @contextmanager
    def pieces(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """The pieces in ``optimizer`` for the block; the faces back after it, also if it raised."""
        faces_per_group = self.swap_in(optimizer)
        try:
            yield
        except BaseException:
            self.swap_out(optimizer, faces_per_group, raised=True)
            raise
        self.swap_out(optimizer, faces_per_group)

    def swap_in(self, optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
        """Puts what ``optimizer``'s kind steps in it; returns what :meth:`swap_out` takes."""
        return self.kind_of(optimizer).swap_in(optimizer, self.strict)

    def swap_out(self, optimizer: torch.optim.Optimizer, faces_per_group: list[list[torch.Tensor]], raised: bool = False) -> None:
        """Puts the faces and their DTensor state back. ``raised``: the step raised and what it
        stepped stayed in."""
        self.kind_of(optimizer).swap_out(optimizer, faces_per_group, raised)

    def shown_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A state-dict post-hook: the state dict as the optimizer's kind shows it."""
        return self.kind_of(optimizer).shown_state_dict(optimizer, state_dict)

    def take_zero_step(self, optimizer: torch.optim.Optimizer, unwrapped_step: Any) -> None:
        """One step of zero gradients at zero learning rate on the pieces, as torch's distributed
        state-dict helpers take: it creates the optimizer's state and moves no weight."""
        saved_lrs = []
        for group in optimizer.param_groups:
            saved_lrs.append(group.get("lr"))
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        with self.pieces(optimizer):
            saved_grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
            for piece, _ in saved_grads:
                piece.grad = torch.zeros_like(piece)
            unwrapped_step()
            for piece, grad in saved_grads:
                piece.grad = grad
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            if lr is not None:
                group["lr"] = lr

    def to_face_layouts(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A state dict about to be loaded, its per-element entries laid out like the faces (torch
        matches saved entries to parameters by position, keyed by index or by FQN)."""
        faces = [face for group in optimizer.param_groups for face in group["params"]]
        keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        if len(keys) != len(faces):
            raise ValueError(
                f"the optimizer state dict holds {len(keys)} parameters, this optimizer {len(faces)}: "
                "load it into an optimizer built over the same parameters"
            )
        unexpected = [str(key) for key in state_dict["state"] if key not in set(keys)]
        if unexpected:
            raise RuntimeError(
                f"the optimizer state dict does not fit this model; unexpected: {', '.join(unexpected)} (state for "
                "parameters its param groups do not list)"
            )
        state = self.kind_of(optimizer).face_layouts(dict(state_dict["state"]), keys, faces)
        return {**state_dict, "state": state}


class ElementwiseSwap:
    """The swap for an elementwise optimizer: the plain 1-D pieces under the faces, with plain
    gradients and state over the same storage. Either side's wrappers are reused while the other
    side still holds the same tensors, so a swap costs a few dict look-ups per parameter."""

    def __init__(self, faces: dict[nn.Parameter, _Face]) -> None:
        self._faces = faces
        self._face_of_piece = {face.piece: param for param, face in faces.items()}
        # face -> state name -> (the DTensor shown, the plain tensor stepped): what a swap reuses.
        self._pairs: dict[nn.Parameter, dict[str, tuple[DTensor, torch.Tensor]]] = {}

    def swap_in(self, optimizer: torch.optim.Optimizer, strict: bool) -> list[list[torch.Tensor]]:
        """Puts the pieces, their gradients and plain state in ``optimizer``."""
        faces_per_group = [group["params"] for group in optimizer.param_groups]
        with plain_attribute_access():
            pieces_per_group = [[self._piece_with_grad(param, strict) for param in params] for params in faces_per_group]
        plain_state = self._plain_state(optimizer.state)
        for group, pieces in zip(optimizer.param_groups, pieces_per_group):
            group["params"] = pieces
        optimizer.state = plain_state
        return faces_per_group

    def swap_out(self, optimizer: torch.optim.Optimizer, faces_per_group: list[list[torch.Tensor]], raised: bool) -> None:
        """Anything that cleared the pieces' ``.grad`` since a step that raised (``zero_grad()``)
        clears the faces' too."""
        if raised:
            with plain_attribute_access():
                for pieces, faces in zip((group["params"] for group in optimizer.param_groups), faces_per_group):
                    for piece, face in zip(pieces, faces):
                        if piece is not face and piece.grad is None and face.grad is not None:
                            face.grad = None
        optimizer.state = self._shown_state(optimizer.state)
        for group, faces in zip(optimizer.param_groups, faces_per_group):
            group["params"] = faces

    def shown_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict  # its state is the faces' DTensor state already

    def note_step_error(self, error: BaseException, optimizer: torch.optim.Optimizer) -> None:
        note_flat_pieces(error, optimizer)

    def face_layouts(self, state: dict[Any, dict[str, Any]], keys: list[Any], faces: list[torch.Tensor]) -> dict:
        for key, param in zip(keys, faces):
            if key in state:
                face = self._faces[param]
                state[key] = {
                    name: to_face_layout(value, face.source, f"{name!r} of {face.name!r}")
                    for name, value in state[key].items()
                }
        return state

    def _piece_with_grad(self, param: torch.Tensor, strict: bool) -> torch.Tensor:
        """The face's piece, its ``.grad`` the face's: the reduced gradient shown (the piece's
        view of it), one a user or a tool assigned, or None."""
        face = self._faces.get(param)
        if face is None:
            if not strict:
                return param
            raise ValueError(
                "an optimizer param group holds a tensor that is not a parameter of the sharded model; add "
                "model.parameters() (after fully_shard) to the optimizer, not other tensors"
            )
        piece, grad = face.piece, param.grad
        if grad is None:
            piece.grad = None
        elif grad is face.sharded.shown_grad:
            # The bucket showed the piece this gradient too, unless the piece's was cleared since.
            local = grad._local_tensor
            # A fake tensor (a simulated rank) has no address to compare: point it again.
            if piece.grad is None or not holds_values(local) or piece.grad.data_ptr() != local.data_ptr():
                piece.grad = local.view(piece.shape)
        else:
            piece.grad = self._assigned_grad(face, grad)
        return piece

    def _assigned_grad(self, face: _Face, grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor) or not holds_this_piece(grad, face.source.spec):
            raise ValueError(
                f"the .grad of parameter {face.name!r} is not a DTensor laid out like the parameter; "
                "assign gradients made from the parameter or its .grad (torch.zeros_like(p), p.grad * 2), "
                "not full tensors"
            )
        return grad._local_tensor.reshape(face.piece.shape)

    def _plain_state(self, shown_state: dict[Any, dict[str, Any]]) -> defaultdict:
        """The state keyed by the pieces, over the same storage. An entry laid out otherwise (a
        full optimizer state dict loads row-sharded DTensors) becomes this rank's piece first (a
        gather on every rank: the decision reads metadata only)."""
        plain: defaultdict = defaultdict(dict)
        for param, entries in shown_state.items():
            face = self._faces.get(param)
            if face is None:
                plain[param] = entries
                continue
            pairs = self._pairs.get(param, {})
            plain_entries = {}
            for name, value in entries.items():
                pair = pairs.get(name)
                if pair is not None and pair[0] is value:
                    plain_entries[name] = pair[1]
                elif isinstance(value, DTensor) and value.dim() > 0:
                    if not holds_this_piece(value, face.source.spec):
                        value = to_face_layout(value, face.source, f"optimizer state {name!r} of {face.name!r}")
                    plain_entries[name] = value._local_tensor.view(face.piece.shape)
                else:
                    plain_entries[name] = value
            plain[face.piece] = plain_entries
        return plain

    def _shown_state(self, plain_state: dict[Any, dict[str, Any]]) -> defaultdict:
        shown: defaultdict = defaultdict(dict)
        pairs_now: dict[nn.Parameter, dict[str, tuple[DTensor, torch.Tensor]]] = {}
        for key, entries in plain_state.items():
            param = self._face_of_piece.get(key)
            if param is None:
                shown[key] = entries
                continue
            face = self._faces[param]
            pairs = self._pairs.get(param, {})
            face_pairs = pairs_now[param] = {}
            shown_entries = {}
            for name, value in entries.items():
                per_element = isinstance(value, torch.Tensor) and value.shape == face.piece.shape
                if not per_element:
                    shown_entries[name] = value
                    continue
                pair = pairs.get(name)
                if pair is None or pair[1] is not value:
                    pair = (sharded_dtensor(value, face.source.spec), value)
                face_pairs[name] = pair
                shown_entries[name] = pair[0]
            shown[param] = shown_entries
        self._pairs = pairs_now
        return shown
