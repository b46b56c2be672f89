"""A plain torch optimizer over DTensor faces steps the plain pieces under them.

torch's optimizers take their per-tensor loop for a DTensor subclass (their foreach kernels want
an exact tensor type), with Python dispatch on every op: a step over a small model's faces took
several times the same step on plain tensors. Around each optimizer step, torch's public global
step hooks (registered once, by the first front door that asks) swap the faces the step holds for
the pieces under them (:class:`~megatron_fsdp.optim.piece_swap.PieceSwap`) and put the faces back
after it. What is a face is told by *owner resolvers*: each front door registers one that maps a
face to its :class:`PieceOwner` (``megatron_fsdp.fsdp2``'s modules sharded in place; the
whole-model wrapper's faces where ``megatron_fsdp.integrations.megatron_core.install()`` asked).
An optimizer's parameters that no resolver knows stay in the step as they are; an optimizer
sharded by ``fully_shard_optimizer`` (``_megatron_fsdp_model``) swaps by itself and is left alone.

A step that raised leaves the pieces in its optimizer (torch runs no post-hook then) until the
first of: that optimizer's next step, its ``state_dict()`` or ``load_state_dict()``, or a call to
:func:`end_unfinished_steps` (the next forward of a module sharded in place makes one, and so does
the exception's end of the program). Until then its ``param_groups`` list the pieces. Ending it
matters beyond this rank: where a whole-tensor optimizer's owner raised and the others' steps
passed, the others wait to agree on it (whole_tensors.py) and raise once this rank joins, so an
error that ends the program joins first (:func:`sys.excepthook`) instead of leaving them to
their collective timeout.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.optim.piece_swap import PieceSwap

logger = logging.getLogger(__name__)


class PieceOwner(Protocol):
    """What owns a set of faces: the buckets of its units, and what follows a step of them."""

    def piece_buckets(self) -> list[Bucket]:
        """The buckets whose faces it owns."""

    def after_piece_step(self) -> None:
        """After an optimizer stepped (some of) its pieces (offloaded: send them to the device)."""


OwnerResolver = Callable[[torch.Tensor], "PieceOwner | None"]


@dataclass
class _OptimizerSwap:
    """The swap made for one optimizer, valid while its param groups list ``params`` and the
    same resolvers are registered."""

    resolvers: tuple[int, ...]
    params: list[torch.Tensor]
    owners: list[weakref.ref]
    swap: PieceSwap | None


@dataclass
class _PieceSteps:
    """What the hooks keep of one optimizer, held by the optimizer (gone with it): its swap, the
    faces per group while the pieces are in it, and whether its state dict hooks are in place."""

    entry: _OptimizerSwap | None = None
    faces_in_step: list | None = None
    hooks_added: bool = False


# The optimizer attribute that holds its _PieceSteps.
_ATTRIBUTE = "_megatron_fsdp_piece_steps"

# Process-wide, as torch's global step hooks and sys.excepthook are: the front doors' resolvers
# (handle id -> resolver; an OrderedDict: a RemovableHandle refers to it weakly), the hooks, and
# the optimizers holding pieces after a step that raised, for the exception's end of the program.
_resolvers: OrderedDict[int, OwnerResolver] = OrderedDict()
_hooks: list[RemovableHandle] = []
_optimizers_mid_step: weakref.WeakSet = weakref.WeakSet()


def _piece_steps(optimizer: torch.optim.Optimizer) -> _PieceSteps:
    steps = vars(optimizer).get(_ATTRIBUTE)
    if steps is None:
        steps = _PieceSteps()
        setattr(optimizer, _ATTRIBUTE, steps)
    return steps


def step_faces_as_pieces(resolver: OwnerResolver) -> RemovableHandle:
    """From now on, optimizer steps over faces ``resolver`` knows run on their pieces. The first
    call registers torch's global step hooks; ``.remove()`` on the returned handle withdraws the
    resolver (the hooks stay, passing every optimizer when no resolver is left)."""
    handle = RemovableHandle(_resolvers)
    _resolvers[handle.id] = resolver
    if not _hooks:
        _hooks.append(register_optimizer_step_pre_hook(_before_step))
        _hooks.append(register_optimizer_step_post_hook(_after_step))
        sys.excepthook = _ending_unfinished_steps(sys.excepthook)
    return handle


def _ending_unfinished_steps(previous: Callable[..., Any]) -> Callable[..., Any]:
    """``previous`` (an uncaught exception's hook), after ending the steps the exception left."""

    def excepthook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        if _optimizers_mid_step:
            try:
                end_unfinished_steps()
            except Exception as failure:  # the error that ends the program is the one to show
                logger.warning("ending the optimizer step that raised failed too: %s", failure)
        previous(kind, error, traceback)

    return excepthook


def end_unfinished_steps() -> None:
    """Puts the faces back in every optimizer whose step raised with the pieces in it."""
    for optimizer in list(_optimizers_mid_step):
        _end_step(optimizer, raised=True)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _end_step(optimizer, raised=True)  # the last step raised
    if not _resolvers or getattr(optimizer, "_megatron_fsdp_model", None) is not None:
        return
    entry = _swap_for(optimizer)
    if entry.swap is not None:
        _piece_steps(optimizer).faces_in_step = entry.swap.swap_in(optimizer)
        _optimizers_mid_step.add(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _end_step(optimizer, raised=False)


def _end_step(optimizer: torch.optim.Optimizer, raised: bool) -> None:
    steps = vars(optimizer).get(_ATTRIBUTE)
    if steps is None or steps.faces_in_step is None:
        return
    entry, faces_per_group = steps.entry, steps.faces_in_step
    steps.faces_in_step = None
    _optimizers_mid_step.discard(optimizer)
    entry.swap.swap_out(optimizer, faces_per_group, raised=raised)
    for owner_ref in entry.owners:
        owner = owner_ref()
        if owner is not None:
            owner.after_piece_step()


def _swap_for(optimizer: torch.optim.Optimizer) -> _OptimizerSwap:
    """The optimizer's swap, made again when its parameters changed (``add_param_group``) or a
    resolver came or went."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    resolvers = tuple(_resolvers)
    steps = _piece_steps(optimizer)
    entry = steps.entry
    if (
        entry is not None
        and entry.resolvers == resolvers
        and len(entry.params) == len(params)
        and all(a is b for a, b in zip(entry.params, params))
    ):
        return entry
    owners: dict[int, PieceOwner] = {}
    for param in params:
        for resolver in _resolvers.values():
            owner = resolver(param)
            if owner is not None:
                owners.setdefault(id(owner), owner)
                break
    swap = None
    if owners:
        swap = PieceSwap([bucket for owner in owners.values() for bucket in owner.piece_buckets()], strict=False)
        if not any(swap.covers(param) for param in params):
            swap = None
    entry = steps.entry = _OptimizerSwap(resolvers, params, [weakref.ref(owner) for owner in owners.values()], swap)
    if swap is not None and not steps.hooks_added:
        steps.hooks_added = True
        optimizer.register_state_dict_pre_hook(_end_raised_step, prepend=True)
        optimizer.register_state_dict_post_hook(_shown_state_dict)
        optimizer.register_load_state_dict_pre_hook(_end_raised_step_before_load, prepend=True)
    return entry


def _end_raised_step(optimizer: torch.optim.Optimizer) -> None:
    _end_step(optimizer, raised=True)


def _shown_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    entry = _piece_steps(optimizer).entry
    return state_dict if entry is None or entry.swap is None else entry.swap.shown_state_dict(optimizer, state_dict)


def _end_raised_step_before_load(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    _end_step(optimizer, raised=True)
