"""Every place megatron_fsdp replaces another library's code, in one table: which function of
which module, the library version it was written against, and what that function looked like
then (its signature). :func:`replace_checked` puts a replacement in only over the function it
was written for: a version whose function no longer has that signature is refused with our error,
naming the library, the version and what changed, instead of running our code in place of code we
never read.

- megatron-core 0.19's FSDP adapter (``megatron.core.distributed.fsdp.mcore_fsdp_adapter``) lays
  ``torch.arange(world_size)`` out as its meshes, which fails under pipeline parallelism;
  ``_get_dp_tp_mesh`` and ``_get_hsdp_tp_mesh`` are replaced by meshes read from the process groups
  (mcore_adapter_meshes.py) when ``install()``'s import hook loads the adapter (megatron_core.py).
- megatron-core 0.19's fsdp_dtensor checkpoint helpers
  (``megatron.core.transformer.fsdp_dtensor_checkpoint``): ``handle_swiglu_in_state_dict`` fails at
  the first save of a ``--swiglu`` model and cannot split a piece starting inside a row; it is
  replaced by mcore_gated_fc1.py's ``split_gated_linear_fc1`` when the hook loads that module.

torchtitan's model spec takes its ``parallelize_fn`` as a setting, which torchtitan.py sets after
checking it is torchtitan's llama3 one: a setting, not a replacement of code.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

from megatron_fsdp.integrations.mcore_adapter_meshes import dp_tp_mesh, hsdp_tp_mesh
from megatron_fsdp.integrations.mcore_gated_fc1 import split_gated_linear_fc1


@dataclass(frozen=True)
class Replacement:
    """``name`` of a module of ``library``, as it was in ``version`` (``signature``, as
    ``str(inspect.signature(...))`` writes it), replaced by ``replacement``."""

    library: str
    version: str
    name: str
    signature: str
    replacement: Callable


#: megatron-core's adapter module, which install()'s import hook hands to :func:`replace_checked`.
MCORE_ADAPTER_MODULE = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
MCORE_ADAPTER_MESHES = (
    Replacement("megatron-core", "0.19", "_get_dp_tp_mesh", "(dp_cp_group, tp_group, ep_size=1)", dp_tp_mesh),
    Replacement(
        "megatron-core", "0.19", "_get_hsdp_tp_mesh", "(outer_fsdp_dp_group, dp_cp_group, tp_group, ep_size=1)", hsdp_tp_mesh
    ),
)
#: megatron-core's fsdp_dtensor checkpoint helpers, whose SwiGLU splitter megatron_fsdp replaces.
MCORE_CHECKPOINT_MODULE = "megatron.core.transformer.fsdp_dtensor_checkpoint"
MCORE_GATED_FC1_SPLIT = (
    Replacement(
        "megatron-core", "0.19", "handle_swiglu_in_state_dict", "(model, model_state_dict, optimizer_state_dict)",
        split_gated_linear_fc1,
    ),
)
#: Each megatron-core module install()'s import hook loads as it is, then hands to replace_checked.
MCORE_REPLACEMENTS = {MCORE_ADAPTER_MODULE: MCORE_ADAPTER_MESHES, MCORE_CHECKPOINT_MODULE: MCORE_GATED_FC1_SPLIT}


def replace_checked(module: types.ModuleType, replacements: tuple[Replacement, ...]) -> None:
    """Puts each replacement in ``module`` after checking every replaced function is the one it
    was written for; raises ``RuntimeError`` (nothing replaced) otherwise."""
    for replacement in replacements:
        _check(module, replacement)
    for replacement in replacements:
        setattr(module, replacement.name, replacement.replacement)


def _check(module: types.ModuleType, replacement: Replacement) -> None:
    where = f"{module.__name__}.{replacement.name}"
    original = getattr(module, replacement.name, None)
    if not callable(original):
        found = "no such function"
    else:
        try:
            found = f"signature {inspect.signature(original)}"
        except (TypeError, ValueError):
            found = "a callable without a signature"
        if found == f"signature {replacement.signature}":
            return
    raise RuntimeError(
        f"megatron_fsdp replaces {where} as {replacement.library} {replacement.version} wrote it, with signature "
        f"{replacement.signature}; this {replacement.library} has {found}, which megatron_fsdp was not written "
        f"for: use {replacement.library} {replacement.version}, or a megatron_fsdp release written for this version"
    )
