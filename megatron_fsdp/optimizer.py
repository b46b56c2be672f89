"""The distributed optimizer: any elementwise torch optimizer, stepping only this rank's
fp32 main-parameter pieces, then installing them into the compute weights."""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from megatron_fsdp import checkpoint
from megatron_fsdp.module import MegatronFSDP


def distribute_optimizer(optimizer: torch.optim.Optimizer, model: MegatronFSDP) -> torch.optim.Optimizer:
    """Re-points ``optimizer`` at ``model``'s main-parameter pieces, in place, and wraps its
    ``step`` (finish gradient sync, step, install weights) and ``zero_grad`` (also zero the
    main gradients). Hyper-parameters and param groups stay as the user built them."""
    if getattr(optimizer, "_megatron_fsdp_model", None) is not None:
        raise ValueError("this optimizer was already passed to fully_shard_optimizer")
    if len(optimizer.state) > 0:
        raise ValueError(
            "the optimizer already holds state (it has stepped): build it fresh and shard it before the first step"
        )
    mapping = model.optimizer_params()
    # An optimizer built before fully_shard holds the model's parameters; one built after it,
    # their DTensor faces (model.parameters()).
    mapping.update({model.face_of(param): piece for param, piece in list(mapping.items())})
    model_param_names = {p: n for n, p in model.module.named_parameters()}
    model_param_names.update({p: n for n, p in model.named_parameters()})
    for group_index, group in enumerate(optimizer.param_groups):
        pieces = []
        for param in group["params"]:
            if param not in mapping:
                if param in model_param_names:
                    what = f"the model's parameter {model_param_names[param]!r}, which does not require grad"
                else:
                    what = f"a parameter of shape {tuple(param.shape)} that is not in the sharded model"
                raise ValueError(
                    f"optimizer param group {group_index} holds {what}; megatron_fsdp steps only the model's "
                    "trainable parameters: build the optimizer from those"
                )
            pieces.append(mapping[param])
        group["params"] = pieces

    original_step = optimizer.step
    original_zero_grad = optimizer.zero_grad

    @functools.wraps(original_step)
    def step(self, *args, **kwargs):
        model.prepare_optimizer_step()
        result = original_step(*args, **kwargs)
        model.install_optimizer_step()
        return result

    @functools.wraps(original_zero_grad)
    def zero_grad(self, set_to_none: bool = True) -> None:
        model.zero_grad_buffer(set_to_none)
        original_zero_grad(set_to_none)

    original_state_dict = optimizer.state_dict
    original_load_state_dict = optimizer.load_state_dict

    @functools.wraps(original_state_dict)
    def state_dict(self) -> dict[str, Any]:
        return checkpoint.optimizer_state_dict(optimizer, model, original_step)

    @functools.wraps(original_load_state_dict)
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        checkpoint.load_optimizer_state_dict(optimizer, model, state_dict, original_load_state_dict)

    # Bound methods, as LR schedulers re-wrap ``optimizer.step`` through its ``__func__``.
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    if model.settings.preproc_state_dict_for_dcp_ckpt:
        optimizer.state_dict = types.MethodType(state_dict, optimizer)
        optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
    optimizer._megatron_fsdp_model = model
    return optimizer
