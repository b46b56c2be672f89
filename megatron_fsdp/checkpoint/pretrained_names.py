"""Which module of a sharded model is the Hugging Face model, and the names its tensors go by in
Hugging Face's files: a tied weight (Llama's ``lm_head.weight`` on ``model.embed_tokens.weight``)
is one tensor under several state-dict names, stored once under the name Transformers keeps."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def hugging_face_module(model: nn.Module) -> nn.Module:
    """The user's model: the one the whole-model wrapper (``megatron_fsdp.fully_shard``) holds,
    or ``model`` itself (sharded in place by ``megatron_fsdp.fsdp2.fully_shard``, or not at all)."""
    if hasattr(model, "units") and isinstance(getattr(model, "module", None), nn.Module):
        return model.module
    return model


def tied_targets(module: nn.Module) -> set[str]:
    """The names Transformers drops from a tied group when it saves (``all_tied_weights_keys``:
    target -> source, Transformers 5); empty for other models."""
    tied = getattr(module, "all_tied_weights_keys", None)
    return set(tied) if isinstance(tied, dict) else set()


def tensor_aliases(state_dict: dict[str, Any], module: nn.Module) -> list[list[str]]:
    """The tensor entries of ``state_dict`` grouped by the parameter or buffer of ``module`` they
    show (a tied weight's names together; ``nn.Module.state_dict`` gives each name a tensor of
    its own), in state-dict order, each group's name Transformers keeps first."""
    owner_of: dict[str, int] = {}
    for name, tensor in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        owner_of[name] = id(tensor)
    groups: dict[int, list[str]] = {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            groups.setdefault(owner_of.get(name, id(value)), []).append(name)
    targets = tied_targets(module)
    return [sorted(names, key=lambda name: name in targets) for names in groups.values()]
