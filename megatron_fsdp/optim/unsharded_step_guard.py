"""Refuses, at its first step, an optimizer over a whole-model ``MegatronFSDP``'s parameters that
was never sharded with the model (``fully_shard(model, optimizer)`` or ``fully_shard_optimizer``).

Such an optimizer (``transformers.Trainer`` builds one itself, say) would step the main-weight
pieces under the DTensor faces, but nothing would install them into the compute weights, and
its ``zero_grad`` would not release the main gradients, which the next backward then adds to:
training would go on, silently wrong. Its step raises instead, on every rank alike, before it
changes anything. The check is torch's public global optimizer step pre-hook, put once by the
first such model; it passes every optimizer that holds none of these faces (and megatron-core's,
whose faces belong to its own face of the wrapper, which installs the weights itself).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

# The models whose faces only a sharded optimizer may step.
_guarded_models: weakref.WeakSet = weakref.WeakSet()
# optimizer -> how many parameters it held when found to step none of those faces.
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_handle: RemovableHandle | None = None


def guard_optimizer_steps(model: torch.nn.Module) -> None:
    """From now on, an optimizer stepping ``model``'s faces without being sharded with it raises."""
    global _handle
    _guarded_models.add(model)
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_refuse_unsharded_optimizer)


def _refuse_unsharded_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, "_megatron_fsdp_model", None) is not None:
        return  # sharded: its step installs the weights
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if _checked.get(optimizer) == len(params):
        return
    for param in params:
        owner = _owner(param)
        if owner is not None and owner in _guarded_models:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() would step parameters of a model sharded by megatron_fsdp, but "
                "the optimizer was not sharded with it, so the new weights would never reach the model and the "
                "gradients would pile up across steps: pass the optimizer to fully_shard(model, optimizer, ...) or "
                "call megatron_fsdp.fully_shard_optimizer(model, optimizer) before training (for transformers."
                "Trainer, use megatron_fsdp.integrations.hugging_face.MegatronFSDPTrainer)"
            )
    _checked[optimizer] = len(params)


def _owner(param: torch.Tensor) -> torch.nn.Module | None:
    """The wrapper whose face ``param`` is, or whose module held it before the wrap."""
    owner = getattr(param, "_megatron_fsdp_model", None)
    if owner is None and getattr(param, "_megatron_fsdp_owner", None) is not None:
        owner = param._megatron_fsdp_owner()
    return owner
