"""Transformer Engine's modules are refused where a model is sharded, from the classes alone.

Their FP8 (``fp8_autocast``, ``fp8_model_init``) keeps per-module scaling state and FP8 weight
copies outside megatron_fsdp's buckets, and TE cannot be installed on the machines these
front doors are tested on, so no TE module has ever trained under them. Found by each class's
module path (``transformer_engine.*``, megatron-core's TE wrappers through their bases):
Transformer Engine is never imported here, and every rank refuses alike, before any collective.
"""

from __future__ import annotations

from torch import nn

SUPPORTED = (
    "megatron_fsdp shards torch.nn layers in any dtype (bf16 through a mixed-precision policy), and trains "
    "float8 through torchao: convert_to_float8_training(model, config=Float8LinearConfig("
    "enable_fsdp_float8_all_gather=True)) before sharding (docs/float8.md)"
)


def transformer_engine_modules(module: nn.Module) -> list[tuple[str, type]]:
    """(name, class) of each module under ``module`` (itself included) that is, or derives
    from, a class of the ``transformer_engine`` package."""
    return [
        (name, type(sub))
        for name, sub in module.named_modules()
        if any(c.__module__.split(".")[0] == "transformer_engine" for c in type(sub).__mro__)
    ]


def refuse_transformer_engine(module: nn.Module) -> None:
    """Raises NotImplementedError naming the first Transformer Engine module under ``module``
    and what is supported instead."""
    found = transformer_engine_modules(module)
    if found:
        name, cls = found[0]
        where = f"{name!r}" if name else "the module itself"
        raise NotImplementedError(
            f"{len(found)} Transformer Engine module(s) in {type(module).__name__}, e.g. {where} "
            f"({cls.__module__}.{cls.__qualname__}): Transformer Engine's modules and its FP8 (fp8_autocast, "
            f"fp8_model_init) are not supported; {SUPPORTED}"
        )
