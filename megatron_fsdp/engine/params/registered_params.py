"""Which tensor a module's attribute holds for each parameter of an in-place unit (FSDP2's
contract): the DTensor face while the unit is sharded, so optimizers, clipping and state dicts
see this rank's piece, and the compute parameter (views into the gathered bucket) while it is
unsharded, so forward and backward compute on plain full tensors.

The whole-model wrapper does not use this: its modules keep the compute parameters and the
wrapper shows the faces through its own ``named_parameters``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import nn


class Registration(NamedTuple):
    """One registration of a parameter an in-place call shards: ``owner._parameters[attribute]``,
    under ``key`` relative to the module sharded (a tied weight has one per module holding it)."""

    key: str
    owner: nn.Module
    attribute: str
    param: nn.Parameter


@dataclass(frozen=True)
class SwappedRegistration:
    """One registration of a parameter, ``module._parameters[name]`` (a tied weight has one per
    module holding it), with the two parameters it is swapped between: the compute parameter
    and the DTensor face."""

    module: nn.Module
    name: str
    compute: nn.Parameter
    face: nn.Parameter


class RegisteredParams:
    """Swaps a unit's registrations between faces and compute parameters, as the unit reshards
    and unshards (the way FSDP2 registers its sharded and unsharded parameters)."""

    def __init__(self, slots: list[SwappedRegistration]) -> None:
        self.slots = slots

    def show_sharded(self) -> None:
        for slot in self.slots:
            slot.module._parameters[slot.name] = slot.face

    def show_unsharded(self) -> None:
        for slot in self.slots:
            slot.module._parameters[slot.name] = slot.compute
