"""Meta-device initialisation: a model built under ``torch.device("meta")`` is materialised
module by module in registration order, initialised by each module's ``reset_parameters()``, and
every unit is sharded as soon as its last parameter is initialised, so the full model never
exists at once (the root unit, built last, and one unit at a time do)."""

from __future__ import annotations

import logging
from collections.abc import Callable

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
    waiting = {owner: {named[n] for n in names} for owner, names in assignment.items()}
    owner_bytes = {owner: sum(named[n].numel() * named[n].element_size() for n in names) for owner, names in assignment.items()}
    # Materialised parameters are new objects (a meta tensor cannot take real data in place);
    # every module holding a meta parameter gets the same replacement, so ties survive.
    replacements: dict[nn.Parameter, nn.Parameter] = {}
    built: dict[nn.Module | None, object] = {}
    live = peak = 0
    for name, submodule in module.named_modules():
        meta_params = {k: p for k, p in submodule._parameters.items() if p is not None and p.is_meta}
        meta_buffers = {k: b for k, b in submodule._buffers.items() if b is not None and b.is_meta}
        if not meta_params and not meta_buffers:
            continue
        reset = getattr(submodule, "reset_parameters", None)
        if reset is None:
            raise ValueError(
                f"init_model_with_meta_device: module {name or '<root>'} ({type(submodule).__name__}) holds "
                "meta tensors but has no reset_parameters() to initialise them; give it one, or build the "
                "model on a real device"
            )
        for key, param in meta_params.items():
            if param not in replacements:
                replacements[param] = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
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
