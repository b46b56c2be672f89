"""Meta-device initialisation: a model built under ``torch.device("meta")`` is materialised
module by module, children before their parent (the order constructors initialise in: a parent's
``__init__`` resets its own weights after building its children, and may re-initialise theirs,
as ``nn.MultiheadAttention`` zeroes ``out_proj.bias``), each by its ``reset_parameters()`` or
``_reset_parameters()``; a module of a Transformers model by that model's ``_init_weights(module)``
instead, as Transformers' own construction does (its norms and rotary embeddings have no reset
method). Every unit is sharded as soon as its last parameter is initialised, so the full model
never exists at once (the root unit, built last, and one unit at a time do)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)


def materialize_unit_by_unit(
    module: nn.Module,
    assignment: dict[nn.Module | None, list[str]],
    build_unit: Callable[[nn.Module | None], object],
    device: torch.device,
) -> tuple[dict[nn.Module | None, object], int]:
    """Builds every unit of ``assignment`` (owner -> parameter names, ``None`` the root) with
    ``build_unit`` once its parameters are initialised. Returns the built units and the peak
    bytes of initialised parameters not yet sharded."""
    named = dict(module.named_parameters())
    owner_of = {named[n]: owner for owner, names in assignment.items() for n in names}
    # Parameters already on a device (a model built partly outside the meta context, as
    # Megatron-LM may) are used as they are: a unit waits only for its meta parameters.
    waiting = {owner: {named[n] for n in names if named[n].is_meta} for owner, names in assignment.items()}
    owner_bytes = {owner: sum(p.numel() * p.element_size() for p in params) for owner, params in waiting.items()}
    # Materialised parameters are new objects (a meta tensor cannot take real data in place);
    # every module holding a meta parameter gets the same replacement, so ties survive.
    replacements: dict[nn.Parameter, nn.Parameter] = {}
    built: dict[nn.Module | None, object] = {}
    live = peak = 0
    order = list(_children_first(module))
    owners = transformers_init_owners(module)
    # Every module is checked before any is materialised: a refused model is left as it was.
    for name, submodule in order:
        if _holds_meta_tensors(submodule) and _reset_method(submodule, owners) is None:
            raise ValueError(
                f"init_model_with_meta_device: module {name or '<root>'} ({type(submodule).__name__}) holds "
                "meta tensors but has no reset_parameters() or _reset_parameters() to initialise them; give it "
                "one, or build the model on a real device"
            )
    for _, submodule in order:
        meta_params = {k: p for k, p in submodule._parameters.items() if p is not None and p.is_meta}
        meta_buffers = {k: b for k, b in submodule._buffers.items() if b is not None and b.is_meta}
        if not meta_params and not meta_buffers:
            continue
        reset = _reset_method(submodule, owners)
        for key, param in meta_params.items():
            if param not in replacements:
                replacements[param] = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                # What marks it (a float8 weight's spec); not Transformers' "loaded" mark, which
                # would have its init skip the empty memory.
                marks = {k: v for k, v in param.__dict__.items() if k != "_is_hf_initialized"}
                replacements[param].__dict__.update(marks)
                live += param.numel() * param.element_size()
                waiting[owner_of[param]].discard(param)
            submodule._parameters[key] = replacements[param]
        for key, buffer in meta_buffers.items():
            submodule._buffers[key] = torch.empty_like(buffer, device=device)
        with torch.no_grad():
            reset()
        peak = max(peak, live)
        for owner in [o for o, remaining in waiting.items() if not remaining and o is not None]:
            built[owner] = build_unit(owner)
            live -= owner_bytes[owner]
            del waiting[owner]
    built[None] = build_unit(None)
    logger.info("meta-device init: peak %d bytes of unsharded parameters", peak)
    return built, peak


def _children_first(module: nn.Module, prefix: str = "", seen: set[nn.Module] | None = None) -> Iterator[tuple[str, nn.Module]]:
    """``named_modules()`` in post-order: each module after all of its children, siblings in
    registration order, a shared module once."""
    seen = set() if seen is None else seen
    if module in seen:
        return
    seen.add(module)
    for name, child in module.named_children():
        yield from _children_first(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, module


def _holds_meta_tensors(module: nn.Module) -> bool:
    tensors = [*module._parameters.values(), *module._buffers.values()]
    return any(t is not None and t.is_meta for t in tensors)


def transformers_init_owners(model: nn.Module) -> dict[nn.Module, nn.Module | None]:
    """Each module of ``model`` -> the nearest module at or above it that is a Transformers
    ``PreTrainedModel`` (whose ``_init_weights(module)`` covers its submodules), or None."""
    owners: dict[nn.Module, nn.Module | None] = {}
    for module in model.modules():  # parents before children
        inherited = owners.get(module)
        owners[module] = module if _is_pretrained_model(module) else inherited
        for child in module.children():
            owners.setdefault(child, owners[module])
    return owners


def _is_pretrained_model(module: nn.Module) -> bool:
    # By name: Transformers need not be installed, and importing it costs seconds.
    return any(c.__name__ == "PreTrainedModel" and c.__module__ == "transformers.modeling_utils" for c in type(module).__mro__)


def _reset_method(module: nn.Module, owners: dict[nn.Module, nn.Module | None]) -> Callable[[], None] | None:
    owner = owners.get(module)
    if owner is not None:
        return functools.partial(owner._init_weights, module)
    # torch.nn.MultiheadAttention (and others) name theirs _reset_parameters; upstream takes either.
    return getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
