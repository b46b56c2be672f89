"""A model and its optimizer saved and loaded with DCP through torch's state-dict helpers
(``get_state_dict`` / ``set_state_dict``), as FSDP2 and torchtitan users checkpoint."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save_with_helpers(model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], path: str) -> None:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)


def load_with_helpers(model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], path: str) -> None:
    """DCP fills the helpers' state dicts in place; ``set_state_dict`` then loads them."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
