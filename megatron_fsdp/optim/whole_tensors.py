"""Optimizers that need whole tensors (Muon's orthogonalisation, Shampoo- or SOAP-style
preconditioners) step whole parameters and whole gradients, not the flat pieces under the faces.

A rank's piece of a parameter is a contiguous range of its flattened values, which is no matrix.
For an optimizer that needs whole tensors (``torch.optim.Muon``, and any class declared with
:func:`whole_tensor_optimizer`), the swap around its step puts in, in place of each face, a plain
tensor of the parameter's global shape holding the gathered main weights, its ``.grad`` the
gathered reduced gradient; its state is whole too. Every rank of the parameter's mesh gathers and
steps every one of the optimizer's tensors (replicated), then keeps its own piece of the result:
the update is then the one-process update on every rank alike, and so is any error torch raises
(a tensor Muon refuses fails on every rank). docs/whole_matrix_optimizers.md has the cost and
why this placement rather than one owner rank per matrix.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp.engine.buckets.faces import FaceSource, local_piece
from megatron_fsdp.engine.groups.collectives import all_gather_shards
from megatron_fsdp.engine.params.piece_dtensor import plain_attribute_access

_whole_tensor_classes: list[type] = [torch.optim.Muon] if hasattr(torch.optim, "Muon") else []

OptimizerClass = TypeVar("OptimizerClass", bound=type)


def whole_tensor_optimizer(optimizer_class: OptimizerClass) -> OptimizerClass:
    """Declares that ``optimizer_class`` (and its subclasses) must step whole parameters and whole
    gradients; returns the class, so it also serves as a class decorator. ``torch.optim.Muon`` is
    declared already. Declare before the first step; an optimizer declared after it went on
    stepping pieces keeps flat state that no longer fits."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"whole_tensor_optimizer takes a torch.optim.Optimizer subclass, not {optimizer_class!r}")
    if optimizer_class not in _whole_tensor_classes:
        _whole_tensor_classes.append(optimizer_class)
    return optimizer_class


def needs_whole_tensors(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s class was declared to need whole tensors."""
    return isinstance(optimizer, tuple(_whole_tensor_classes))


def note_flat_pieces(error: BaseException, optimizer: torch.optim.Optimizer) -> None:
    """Adds to an error raised by an optimizer stepping flat pieces what it saw and how to declare
    it, keeping the optimizer's own message and type (every rank stepped pieces alike)."""
    error.add_note(
        f"megatron_fsdp stepped {type(optimizer).__name__} on this rank's flat 1-D pieces of the sharded "
        "parameters; if it needs whole tensors, declare its class with "
        "megatron_fsdp.whole_tensor_optimizer(cls) before the first step (docs/whole_matrix_optimizers.md)"
    )


class WholeTensorSwap:
    """The swap for one whole-tensor optimizer's step over the faces ``sources`` knows: whole
    tensors in for the step, this rank's piece of each written back after it."""

    def __init__(self, sources: dict[nn.Parameter, FaceSource]) -> None:
        self._sources = sources
        self._wholes: dict[torch.Tensor, nn.Parameter] = {}  # whole tensor -> its face, during a step

    def swap_in(self, optimizer: torch.optim.Optimizer, strict: bool) -> list[list[torch.Tensor]]:
        """Gathers each face's main weights and gradient (one all-gather for all of them where they
        are flat pieces of one mesh dim, on every rank in the same order) and puts them, with the
        whole state, in ``optimizer``."""
        self._wholes = {}
        faces_per_group = [group["params"] for group in optimizer.param_groups]
        faces = [param for params in faces_per_group for param in params if self._known(param, strict)]
        with plain_attribute_access():
            grads = [param.grad for param in faces]
        gathered = iter(gather_whole([*faces, *(grad for grad in grads if grad is not None)]))
        whole_of: dict[torch.Tensor, torch.Tensor] = {}
        with torch.no_grad():
            for param in faces:
                whole_of[param] = nn.Parameter(next(gathered), requires_grad=False)
                self._wholes[whole_of[param]] = param
            for param, grad in zip(faces, grads):
                if grad is not None:
                    # Main gradients kept below the main weights' dtype are stepped in the weights' dtype.
                    whole_of[param].grad = next(gathered).to(whole_of[param].dtype)
        wholes_per_group = [[whole_of.get(param, param) for param in params] for params in faces_per_group]
        plain_state: defaultdict = defaultdict(dict)
        for key, entries in optimizer.state.items():
            plain_state[key] = entries
        for whole, param in self._wholes.items():
            if param in optimizer.state:
                plain_state[whole] = {name: _whole_value(value) for name, value in plain_state.pop(param).items()}
        for group, wholes in zip(optimizer.param_groups, wholes_per_group):
            group["params"] = wholes
        optimizer.state = plain_state
        return faces_per_group

    def swap_out(self, optimizer: torch.optim.Optimizer, faces_per_group: list[list[torch.Tensor]], raised: bool) -> None:
        """Writes this rank's piece of each stepped whole tensor into the main weights (not after
        a step that raised: every rank raised alike and keeps its weights), and puts the faces
        back with the whole state keyed by them."""
        with torch.no_grad():
            for whole, param in self._wholes.items():
                source = self._sources[param]
                if not raised:
                    source.piece.copy_(local_piece(whole.detach(), source.piece, source.start, source.extent, source.spec))
                if raised and whole.grad is None:
                    with plain_attribute_access():
                        param.grad = None
        shown: defaultdict = defaultdict(dict)
        for key, entries in optimizer.state.items():
            shown[self._wholes.get(key, key)] = entries
        optimizer.state = shown
        for group, faces in zip(optimizer.param_groups, faces_per_group):
            group["params"] = faces
        self._wholes = {}

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


def whole_state_for_load(state: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """A whole-tensor optimizer's state dict entries as its step keeps them (plain, whole)."""
    return {key: {name: _whole_value(value) for name, value in entries.items()} for key, entries in state.items()}

