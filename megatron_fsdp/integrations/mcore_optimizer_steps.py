"""megatron-core builds torch's AdamW over the parameters megatron_fsdp's wrapper registers between
steps, its DTensor faces, and steps it itself. torch's optimizers take their per-tensor loop for a
DTensor subclass (their foreach kernels want an exact tensor type), with Python dispatch on every
op: on CPU, AdamW over a 2-layer GPT's 28 parameters took 1.4 ms on plain tensors and 27.6 ms on
the faces. While ``install_piece_steps()`` is in effect (``install()`` puts it), each optimizer
step over a ``MegatronFSDP``'s faces runs on the plain pieces under them, and the faces come back
after it: the same swap as ``fully_shard_optimizer``'s step and ``megatron_fsdp.fsdp2``'s plain
optimizers, through the same global step hooks (``megatron_fsdp/optim/global_step_hooks.py``).

``fully_shard_optimizer``'s own steps are left alone: they already step the pieces. megatron-core
syncs the gradients and installs the stepped weights itself, so nothing follows the step here.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.hooks import RemovableHandle

from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.megatron_fsdp import MegatronFSDP
from megatron_fsdp.optim.global_step_hooks import step_faces_as_pieces


class _WrapperFaces:
    """A ``MegatronFSDP``'s trainable faces as the step hooks see them."""

    def __init__(self, model: MegatronFSDP) -> None:
        self._model = weakref.ref(model)

    def piece_buckets(self) -> list[Bucket]:
        model = self._model()
        return model.trainable_buckets() if model is not None else []

    def after_piece_step(self) -> None:
        """megatron-core installs the weights itself (``install_optimized_model_weights``)."""


# The attribute of a model that holds its owner: one per model, living as long as it (the hooks
# hold owners weakly).
_ATTRIBUTE = "_megatron_fsdp_piece_owner"


def install_piece_steps() -> tuple[RemovableHandle]:
    """Steps over a ``MegatronFSDP``'s faces run on the pieces from now on; ``.remove()`` on the
    returned handle ends that."""
    return (step_faces_as_pieces(_wrapper_faces),)


def _wrapper_faces(param: torch.Tensor) -> _WrapperFaces | None:
    model = getattr(param, "_megatron_fsdp_model", None)
    if not isinstance(model, MegatronFSDP):
        return None
    owner = vars(model).get(_ATTRIBUTE)
    if owner is None:
        owner = _WrapperFaces(model)
        setattr(model, _ATTRIBUTE, owner)
    return owner
