"""The models a simulation builds, each anew per simulated rank and on the meta device: a Hugging
Face config (a preset below, a config.json, or a model id), or a Python callable
(``FILE.py:CALLABLE``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from megatron_fsdp.plan_memory.command import load_factory_model, load_model_file

# Published shapes (the models' config.json), enough to build each without its weights.
_LLAMA3 = dict(vocab_size=128256, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072,
               rms_norm_eps=1e-5, tie_word_embeddings=False)
PRESETS: dict[str, tuple[str, dict]] = {
    "llama3-8b": ("LlamaConfig", _LLAMA3 | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                                num_attention_heads=32)),
    "llama3-70b": ("LlamaConfig", _LLAMA3 | dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                                 num_attention_heads=64)),
    "llama3-405b": ("LlamaConfig", _LLAMA3 | dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                                  num_attention_heads=128)),
    "mixtral-8x7b": ("MixtralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                           num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
                                           tie_word_embeddings=False)),
}

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


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise ValueError("a Hugging Face model needs transformers: pip install transformers") from error
    return transformers


def hugging_face(config, dtype: torch.dtype = torch.bfloat16, num_hidden_layers: int | None = None) -> ModelSource:
    """A causal LM of ``config`` (a transformers config, a preset name, a config.json or a model
    id); ``num_hidden_layers`` overrides the config's (a shorter model for a quick look)."""
    transformers = _transformers()
    if isinstance(config, str):
        config = _config(transformers, config)
    if num_hidden_layers is not None:
        config.num_hidden_layers = num_hidden_layers

    def build() -> nn.Module:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)

    probe = build()
    names = set(getattr(probe, "_no_split_modules", None) or [])
    units = tuple({type(m) for m in probe.modules() if type(m).__name__ in names})
    params = sum(p.numel() for p in probe.parameters())
    return ModelSource(build, units, f"{type(probe).__name__}, {params / 1e9:.2f}B parameters ({dtype})")


def _config(transformers, name: str):
    if name in PRESETS:
        kind, values = PRESETS[name]
        return getattr(transformers, kind)(**values)
    path = Path(name).expanduser()
    try:
        return transformers.AutoConfig.from_pretrained(str(path) if path.exists() else name)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{name!r} is no preset ({', '.join(PRESETS)}), and transformers could not load a config from it: {error}"
        ) from error


def python_callable(spec: str, kwargs: dict, units: list[str], dtype: torch.dtype) -> ModelSource:
    """``FILE.py:CALLABLE`` called with ``kwargs`` under ``torch.device("meta")``, its unit
    classes named by ``units``. The file is run once, by plan_memory's loader (which registers it
    in ``sys.modules`` under its stem), so every build makes instances of the same classes."""
    probe = load_factory_model(spec, kwargs, dtype)
    path, _, name = spec.rpartition(":")
    factory = getattr(load_model_file(path), name)

    def build() -> nn.Module:
        with torch.device("meta"):
            return factory(**kwargs).to(dtype)

    classes = {type(m).__name__: type(m) for m in probe.modules()}
    missing = [unit for unit in units if unit not in classes]
    if missing:
        raise ValueError(f"the model has no module class {', '.join(missing)} (it has {', '.join(sorted(classes))})")
    return ModelSource(build, tuple(classes[unit] for unit in units), f"{spec} ({dtype})")
