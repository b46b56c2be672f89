"""Upstream's v2 ``save_checkpoint`` / ``load_checkpoint``: a model sharded in place and its
optimizer as one DCP checkpoint, through torch's state-dict helpers (which see the DTensor
parameters and optimizer state with their global shapes)."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str | os.PathLike) -> None:
    """Writes ``{"model": ..., "optimizer": ...}`` to ``checkpoint_dir`` with DCP (a collective)."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=checkpoint_dir)


def load_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint_dir: str | os.PathLike,
    *,
    sync_model_weights: bool = True,
) -> None:
    """Reads what :func:`save_checkpoint` wrote into the model's pieces and the optimizer's
    state (DCP reshards to this rank's pieces). ``sync_model_weights`` is upstream's: here the
    loaded main weights reach the compute weights either way (the next gather reads them)."""
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
