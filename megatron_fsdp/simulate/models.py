"""The models a simulation builds, each anew per simulated rank and on the meta device: a Hugging
Face config (a preset of meta_models.PRESETS, a config.json, or a model id), or a Python callable
(``FILE.py:CALLABLE``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megatron_fsdp.plan_memory import meta_models

# Megatron-LM's split of a Llama-style decoder layer (plan_memory's default plan, written out
# for torch's parallelize_module): q/k/v and gate/up column-parallel, o/down row-parallel.
LLAMA_TP_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


@dataclass(frozen=True)
class ModelSource:
    """``build()`` returns a fresh model on the meta device; ``units``: its unit classes."""

    build: Callable[[], nn.Module]
    units: tuple[type, ...]
    description: str


def hugging_face(config, dtype: torch.dtype = torch.bfloat16, num_hidden_layers: int | None = None) -> ModelSource:
    """A causal LM of ``config`` (a transformers config, a preset name, a config.json or a model
    id); ``num_hidden_layers`` overrides the config's (a shorter model for a quick look)."""
    if isinstance(config, str):
        config = meta_models.hf_config(config)
    if num_hidden_layers is not None:
        config.num_hidden_layers = num_hidden_layers

    def build() -> nn.Module:
        return meta_models.hf_model_on_meta(config, dtype)

    probe = build()
    names = set(meta_models.decoder_layer_names(probe))
    units = tuple({type(m) for m in probe.modules() if type(m).__name__ in names})
    params = sum(p.numel() for p in probe.parameters())
    return ModelSource(build, units, f"{type(probe).__name__}, {params / 1e9:.2f}B parameters ({dtype})")


def python_callable(spec: str, kwargs: dict, units: list[str], dtype: torch.dtype) -> ModelSource:
    """``FILE.py:CALLABLE`` called with ``kwargs`` on the meta device, its unit classes named by
    ``units``. The file is run once a process (:func:`meta_models.load_model_file`), so every build
    makes instances of the same classes."""
    factory = meta_models.model_factory(spec)

    def build() -> nn.Module:
        return meta_models.factory_model_on_meta(factory, kwargs, dtype)

    return ModelSource(build, tuple(meta_models.unit_classes(build(), units)), f"{spec} ({dtype})")
