"""What an optimizer's ``zero_grad()`` clears when several optimizers share one sharded model
(Muon on the blocks' matrices and AdamW on the rest, say).

torch's ``zero_grad`` clears its own parameters' gradients only, and a loop that steps and zeroes
each optimizer in turn relies on that: the second optimizer still steps on its gradients. Here the
main gradients live per bucket, and a bucket holds parameters of several optimizers. So an
optimizer's ``zero_grad`` zeroes its own parameters' ranges in place, and the buffers are released
(``zero_grad_buffer``) once every optimizer sharded over the model has cleared its parameters
since the gradients last changed. An optimizer alone over the model releases at once.

That bookkeeping belongs to the model: it hangs off it (:func:`grad_release_of`), so two models
sharded in one process (a teacher and a student) never see each other's, and it goes with the
model.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from megatron_fsdp.engine.step.sharded_model import ShardedModel


class SharedGradRelease:
    """The optimizers sharded over one model, and which of their parameters' gradients were
    cleared since the gradients last changed. Held by the model, which it does not hold: the
    model is given to each call."""

    def __init__(self) -> None:
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._cleared: set[nn.Parameter] = set()
        self._cleared_at_change = -1

    def add(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.add(optimizer)

    def zero_grad(self, model: ShardedModel, optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
        """``optimizer``'s gradients cleared: all of them released or zeroed when that leaves none
        of ``model``'s optimizers with gradients, else its own zeroed in place."""
        # Zeroing changes no gradient count, so the count now is also the count after.
        changes = sum(bucket.grads.state.grad_changes for bucket in model.trainable_buckets())
        if changes != self._cleared_at_change:
            self._cleared = set()
        mine = _params_of(optimizer)
        every_optimizers = set().union(*(_params_of(other) for other in self._optimizers))
        if every_optimizers <= self._cleared | mine:
            model.zero_grad_buffer(set_to_none)
            self._cleared = set()
        else:
            model.zero_grad_buffer(params=mine)
            self._cleared |= mine
        self._cleared_at_change = changes


def _params_of(optimizer: torch.optim.Optimizer) -> set[nn.Parameter]:
    return {param for group in optimizer.param_groups for param in group["params"]}


# The attribute of a sharded model that holds its release.
_ATTRIBUTE = "_megatron_fsdp_grad_release"


def grad_release_of(model: ShardedModel) -> SharedGradRelease:
    """The model's :class:`SharedGradRelease`, made at its first optimizer and held by the model."""
    release = vars(model).get(_ATTRIBUTE)
    if release is None:
        release = SharedGradRelease()
        setattr(model, _ATTRIBUTE, release)
    return release
