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
        """Gathers each face's main weights and gradient (two collectives per parameter, on every
        rank in the same order) and puts them, with the whole state, in ``optimizer``."""
        self._wholes = {}
        faces_per_group = [group["params"] for group in optimizer.param_groups]
        wholes_per_group = [[self._whole(param, strict) for param in params] for params in faces_per_group]
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

    def _whole(self, param: torch.Tensor, strict: bool) -> torch.Tensor:
        if param not in self._sources:
            if not strict:
                return param
            raise ValueError(
                "an optimizer param group holds a tensor that is not a parameter of the sharded model; add "
                "model.parameters() (after fully_shard) to the optimizer, not other tensors"
            )
        with plain_attribute_access():
            grad = param.grad
        with torch.no_grad():
            whole = nn.Parameter(_gathered(param), requires_grad=False)
            if grad is not None:
                # Main gradients kept below the main weights' dtype are stepped in the weights' dtype.
                whole.grad = _gathered(grad).to(whole.dtype)
        self._wholes[whole] = param
        return whole


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def _whole_value(value: Any) -> Any:
    """A state entry as the whole-tensor step keeps it: plain and whole (a loaded checkpoint may
    hold DTensors)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def whole_state_for_load(state: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """A whole-tensor optimizer's state dict entries as its step keeps them (plain, whole)."""
    return {key: {name: _whole_value(value) for name, value in entries.items()} for key, entries in state.items()}

