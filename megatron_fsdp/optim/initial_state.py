"""What a fresh sharded optimizer's ``state_dict()`` holds, and why loading it back changes nothing.

``dcp.load`` fills tensors in place, so loading a checkpoint into a fresh optimizer through
``optimizer.state_dict()`` needs state tensors there to fill (docs/checkpointing.md). torch's
fresh optimizer has none: its first step creates them. So ``state_dict()`` on an optimizer without
state returns **placeholders**, the state one zero-gradient, zero-learning-rate step creates with
its step counters put back to 0 ("no step taken"), while the optimizer itself keeps no state.
Loading a state dict back drops each parameter's placeholders that nothing wrote into since
(Accelerate's ``load_state_dict(state_dict())`` when it wraps an optimizer): that parameter keeps
no state, and the next step is the very step torch's fresh optimizer takes. Placeholders that
``dcp.load`` filled are state like any other and load as such.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# The key under which torch's optimizers keep their step count (Adam, AdamW; SGD keeps none).
STEP_COUNTER = "step"


def _storage_tensor(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor that ``dcp.load`` writes into: a DTensor's local tensor (its
    ``__get_tensor_shard__`` hands DCP a view of it, and views share the version counter)."""
    return value._local_tensor if isinstance(value, DTensor) else value


def _tensors(entries: dict[str, Any]) -> Iterator[torch.Tensor]:
    return (value for value in entries.values() if isinstance(value, torch.Tensor))


class InitialStatePlaceholders:
    """The placeholders of one optimizer's latest fresh ``state_dict()``, and their tensors'
    version counters then (an in-place write, such as ``dcp.load``'s, bumps them)."""

    def __init__(self) -> None:
        # id -> (weak reference, version when handed out); ids of dead tensors are never matched.
        self._handed_out: dict[int, tuple[weakref.ref, int]] = {}
        self._created_state = False

    def before_state_dict(self, optimizer: torch.optim.Optimizer, create_state: Callable[[], None]) -> None:
        """A state-dict pre-hook: gives an optimizer without state the placeholders to pack."""
        self._created_state = not optimizer.state
        if not self._created_state:
            return
        create_state()
        for entries in optimizer.state.values():
            if STEP_COUNTER in entries:
                step = entries[STEP_COUNTER]
                entries[STEP_COUNTER] = torch.zeros_like(step) if isinstance(step, torch.Tensor) else 0

    def after_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A state-dict post-hook: the optimizer gives the placeholders away and keeps no state,
        as a fresh torch optimizer."""
        if self._created_state:
            self._created_state = False
            self._handed_out = {
                id(tensor): (weakref.ref(tensor), _storage_tensor(tensor)._version)
                for entries in state_dict["state"].values()
                for tensor in _tensors(entries)
            }
            optimizer.state = defaultdict(dict)
        return state_dict

    def drop_unfilled(self, state: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
        """``state`` without the entries whose tensors are placeholders nothing wrote into:
        those parameters had taken no step, and get no state. A step counter need only read 0:
        Accelerate copies it to the device (an unfilled placeholder all the same); and it must,
        as where this rank's piece of a parameter is empty ``dcp.load`` writes only the counter.

        A placeholder this rank holds no element of cannot be written: it counts as filled when
        any placeholder of the same state dict was, so every rank keeps or drops a parameter's
        state alike (a whole-tensor optimizer's owners exchange it, and a rank that dropped it
        would leave the exchange). A rank holding no element of any placeholder keeps them."""
        any_filled = self._any_filled()
        return {key: entries for key, entries in state.items() if not self._unfilled(entries, any_filled)}

    def _any_filled(self) -> bool:
        held = [(tensor, version) for reference, version in self._handed_out.values() if (tensor := reference()) is not None and _storage_tensor(tensor).numel() > 0]
        return not held or any(_storage_tensor(tensor)._version != version for tensor, version in held)

    def _unfilled(self, entries: dict[str, Any], any_filled: bool) -> bool:
        tensors = [(name, value) for name, value in entries.items() if isinstance(value, torch.Tensor)]
        return bool(tensors) and all(
            value.item() == 0 if name == STEP_COUNTER and value.dim() == 0 else self._is_unfilled_placeholder(value, any_filled)
            for name, value in tensors
        )

    def _is_unfilled_placeholder(self, tensor: torch.Tensor, any_filled: bool) -> bool:
        handed_out = self._handed_out.get(id(tensor))
        if handed_out is None or handed_out[0]() is not tensor:
            return False
        if _storage_tensor(tensor).numel() == 0:
            return not any_filled
        return _storage_tensor(tensor)._version == handed_out[1]
