"""Plans for checkpoints whose names are already Hugging Face's: models trained through
Transformers, Accelerate or our doors save ``model.`` + the module's own FQNs, so they map as they
are (``model.`` dropped on the way out, added on the way in; optimizer state left behind)."""

from __future__ import annotations

import torch

from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.plan import Plan
from megatron_fsdp.convert.sources import TensorInfo

MODEL_PREFIX = "model."
TIED_HEAD = "lm_head.weight"
TIED_EMBEDDING = "model.embed_tokens.weight"


def ours_to_hf(tensors: dict[str, TensorInfo], tied: bool, dtype: torch.dtype | None) -> Plan:
    """Our DCP checkpoint (``model.<fqn>``) -> Hugging Face names. A tied head is written once,
    as the embedding (``save_pretrained`` leaves ``lm_head.weight`` out the same way)."""
    plan = Plan()
    for name, info in tensors.items():
        if not name.startswith(MODEL_PREFIX):
            continue  # optimizer state, and anything else a training run saved beside the model
        hf_name = name[len(MODEL_PREFIX) :]
        if tied and hf_name == TIED_HEAD:
            continue
        plan.copy(name, hf_name, TensorInfo(info.shape, dtype or info.dtype))
    if not plan.steps:
        raise ConversionError(
            "the checkpoint holds no tensor named model.<name>: it was not saved by megatron_fsdp, torch's state-dict "
            "helpers or Accelerate with the model under 'model' (a Megatron-LM checkpoint: pass --from megatron)"
        )
    return plan


def hf_to_ours(tensors: dict[str, TensorInfo], tied: bool, dtype: torch.dtype | None) -> Plan:
    """Hugging Face names -> our DCP checkpoint (``model.<fqn>``). A tied head is written under
    both names, as the sharded model's ``state_dict()`` lists it."""
    plan = Plan()
    for name, info in tensors.items():
        plan.copy(name, MODEL_PREFIX + name, TensorInfo(info.shape, dtype or info.dtype))
    if tied and TIED_HEAD not in tensors:
        if TIED_EMBEDDING not in tensors:
            raise ConversionError(f"config.json ties the head to the embedding, but the model has no {TIED_EMBEDDING}")
        info = tensors[TIED_EMBEDDING]
        plan.copy(TIED_EMBEDDING, MODEL_PREFIX + TIED_HEAD, TensorInfo(info.shape, dtype or info.dtype))
    return plan
