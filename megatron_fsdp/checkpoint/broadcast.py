"""torch's ``set_model_state_dict`` / ``set_optimizer_state_dict`` with
``broadcast_from_rank0=True`` copy each broadcast full tensor into a DTensor's local tensor as
its ``torch.chunk`` rows (``torch.distributed._state_dict_utils._distribute_tensors``), which a
flat-sharded :class:`~megatron_fsdp.engine.piece_dtensor.PieceDTensor` is not: the copy would fail on
a shape mismatch. :func:`install` wraps that function so flat-sharded entries take their own
piece of the full tensor first; every other entry goes through torch's code unchanged."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._state_dict_utils as torch_state_dict_utils

from megatron_fsdp.engine.piece_dtensor import PieceDTensor

_torch_distribute_tensors = getattr(torch_state_dict_utils, "_distribute_tensors", None)


def _distribute_tensors(local_state_dict: dict[str, Any], keys: list[str], device: torch.device, pg: Any = None) -> None:
    for key in keys:
        entry = local_state_dict.get(key)
        # torch hands each DTensor entry over as (the local DTensor, the broadcast full tensor).
        if isinstance(entry, tuple) and isinstance(entry[0], PieceDTensor) and entry[0]._flat_layout is not None:
            local, full = entry
            with torch.no_grad():
                local._local_tensor.copy_(local.piece_of(full))
            local_state_dict[key] = local
    _torch_distribute_tensors(local_state_dict, keys, device, pg)


def install() -> None:
    """Idempotent; does nothing on a torch without that function (its broadcast then raises)."""
    if _torch_distribute_tensors is not None and torch_state_dict_utils._distribute_tensors is _torch_distribute_tensors:
        torch_state_dict_utils._distribute_tensors = _distribute_tensors
