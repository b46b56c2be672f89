"""Models built on the meta device from what a command line names, for the planner and the
simulator alike: a Hugging Face config (a preset of published shapes, a config.json, its folder
or a model id) or a Python callable (``FILE.py:CALLABLE``). Problems raise ValueError naming the
fix; the commands turn them into their exit messages."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

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


def _transformers() -> types.ModuleType:
    try:
        import transformers
    except ImportError as error:
        raise ValueError("a Hugging Face model needs transformers: pip install transformers") from error
    return transformers


def hf_config(name: str):
    """The transformers config ``name`` names: a preset, a config.json, its folder or a model id."""
    transformers = _transformers()
    if name in PRESETS:
        kind, values = PRESETS[name]
        return getattr(transformers, kind)(**values)
    path = Path(name).expanduser()
    if (name.endswith(".json") or name.startswith((".", "/", "~"))) and not path.exists():
        raise ValueError(f"{name}: no such file or folder; give a config.json, its folder, a model id or a preset "
                         f"({', '.join(PRESETS)})")
    try:
        return transformers.AutoConfig.from_pretrained(str(path) if path.exists() else name)
    except (OSError, ValueError) as error:
        raise ValueError(f"{name}: no preset ({', '.join(PRESETS)}), and transformers could not load a config "
                         f"from it: {error}") from error


def hf_model_on_meta(config, dtype: torch.dtype) -> nn.Module:
    """A causal LM of ``config`` on the meta device."""
    transformers = _transformers()
    with torch.device("meta"), _without_torchao():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def decoder_layer_names(model: nn.Module) -> list[str]:
    """The class names a Hugging Face model keeps whole (``_no_split_modules``): its units."""
    return list(getattr(model, "_no_split_modules", None) or [])


@contextlib.contextmanager
def _without_torchao() -> Iterator[None]:
    """transformers' model code imports torchao wherever it is installed (for its quantizers),
    whose import logs native libraries it fails to load and torch deprecation warnings. A model
    built from a config holds no torchao Float8Linear, the one thing the plan reads torchao for
    (float8_weights.py), so while it is built torchao reads as not installed (a None entry in
    sys.modules: find_spec answers None and an import raises ImportError)."""
    if "torchao" in sys.modules:
        yield
        return
    sys.modules["torchao"] = None
    try:
        yield
    finally:
        if sys.modules.get("torchao", ...) is None:
            del sys.modules["torchao"]


def load_model_file(path: str) -> types.ModuleType:
    """The Python file at ``path``, run once a process: registered in ``sys.modules`` (dataclasses in
    it look their module up) under a name of its own, so it never replaces a module the process
    imported by the file's stem (a test's ``models``, a user's ``gpt_model``)."""
    resolved = Path(path).resolve()
    name = f"_megatron_fsdp_model_file_{hashlib.sha1(str(resolved).encode()).hexdigest()[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    loaded = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(loaded)
    sys.modules[name] = module
    try:
        loaded.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def model_factory(spec: str) -> Callable[..., nn.Module]:
    """The callable ``FILE.py:CALLABLE`` names, its file run once (:func:`load_model_file`)."""
    path, _, name = spec.rpartition(":")
    if not path or not Path(path).is_file():
        raise ValueError(f"{spec!r}: give FILE.py:CALLABLE, e.g. examples/gpt_model.py:gpt")
    factory = getattr(load_model_file(path), name, None)
    if not callable(factory):
        raise ValueError(f"{spec!r}: {path} has no callable {name!r}")
    return factory


def factory_model_on_meta(factory: Callable[..., nn.Module], kwargs: dict, dtype: torch.dtype) -> nn.Module:
    """``factory(**kwargs)`` built on the meta device, in ``dtype``."""
    with torch.device("meta"):
        return factory(**kwargs).to(dtype)


def unit_classes(model: nn.Module, names: list[str]) -> list[type]:
    """The model's module classes with these names."""
    classes = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in classes]
    if missing:
        raise ValueError(f"the model has no module class {', '.join(missing)} (it has {', '.join(sorted(classes))})")
    return [classes[n] for n in names]
