"""Hugging Face's ``save_pretrained`` for a sharded model: the full weights, gathered from every
rank's pieces, written by the first rank through the wrapped model's own ``save_pretrained``, so
that ``from_pretrained`` loads them (config, tied weights, shards and all, as Transformers writes
them)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_fsdp.engine.step.sharded_model import ShardedModel


def gathered_state_dict(state_dict: dict[str, Any], keep: bool) -> dict[str, Any]:
    """``state_dict`` with every DTensor value gathered into its full tensor on the host (a
    collective per DTensor: every rank, in the same order). ``keep=False``: gathers and drops
    them (ranks that do not write). A tensor shown under several names (a tied weight) gives
    one full tensor under all of them, which Transformers (and Accelerate, given an OrderedDict as
    ``nn.Module.state_dict`` returns) then saves once."""
    full: OrderedDict[str, Any] = OrderedDict()
    gathered: dict[int, torch.Tensor | None] = {}
    for name, value in state_dict.items():
        if isinstance(value, DTensor):
            if id(value) not in gathered:
                whole = value.full_tensor()
                gathered[id(value)] = whole.detach().cpu() if keep else None
            value = gathered[id(value)]
        if keep:
            full[name] = value.detach() if isinstance(value, torch.Tensor) else value
    return full


def save_pretrained(
    model: ShardedModel,
    save_directory: str,
    *args: Any,
    state_dict: dict[str, Any] | None = None,
    is_main_process: bool = True,
    **kwargs: Any,
) -> None:
    """See :meth:`MegatronFSDP.save_pretrained`."""
    if not callable(getattr(model.module, "save_pretrained", None)):
        raise TypeError(
            f"the sharded {type(model.module).__name__} has no save_pretrained (it is not a Hugging Face model): "
            "write its full weights with megatron_fsdp.export_safetensors(model, path)"
        )
    writes = is_main_process and dist.get_rank() == 0
    full = gathered_state_dict(model.state_dict() if state_dict is None else state_dict, keep=writes)
    if writes:
        model.module.save_pretrained(save_directory, *args, state_dict=full, is_main_process=True, **kwargs)
    dist.barrier()  # the files exist on every rank's return
