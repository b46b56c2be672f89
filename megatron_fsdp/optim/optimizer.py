"""The distributed optimizer: any elementwise torch optimizer over the model's DTensor faces,
stepping only this rank's fp32 main-parameter pieces (swapped in by piece_swap.py), then
installing them into the compute weights. With CPU offloading, or main gradients of a lower
dtype than the main params, the C++ ops step them (kernel_step.py)."""

from __future__ import annotations

import functools
import types

import torch

from megatron_fsdp.engine.params.piece_dtensor import plain_attribute_access
from megatron_fsdp.engine.step.sharded_model import ShardedModel
from megatron_fsdp.optim.grad_release import grad_release_of
from megatron_fsdp.optim.initial_state import InitialStatePlaceholders
from megatron_fsdp.optim.kernel_step import kernel_step_for, reads_main_grads_as_they_are
from megatron_fsdp.optim.piece_swap import PieceSwap


def _return_cached_device_memory(model: ShardedModel) -> None:
    """Before a fresh optimizer's first step, which creates state that lives for the whole run
    (Adam: two tensors per main param), the device memory torch caches goes back to the driver,
    so that state takes blocks of its own. Otherwise it is carved out of the blocks the first
    backward's activations freed, pins the rest of each, and the memory later steps need whole
    is left in pieces: the 8.8B model on one H200 ran out of memory that way with 3 GiB free."""
    if any(bucket.device.type == "cuda" and bucket.host is None for bucket in model.trainable_buckets()):
        torch.cuda.empty_cache()


def distribute_optimizer(optimizer: torch.optim.Optimizer, model: ShardedModel) -> torch.optim.Optimizer:
    """Re-points ``optimizer`` at ``model``'s DTensor faces (``model.parameters()``), in place,
    and wraps its ``step`` (finish gradient sync, step the pieces, install weights) and
    ``zero_grad`` (also release the main gradients). Hyper-parameters and param groups stay as
    the user built them; ``state_dict()`` is torch's own, with DTensor state.

    Why the instance's methods are replaced rather than torch's step hooks used: upstream's
    callers pass keywords to both (``sync_grad_before_optimizer_step``,
    ``install_optimized_model_weights``, ``zero_grad_buffer``); with CPU offloading the host ops
    take the place of torch's update; and the swap to the plain pieces must be undone when the
    update raises, which a post-hook (skipped then) cannot do. The wrappers are bound methods of
    this instance only: torch's classes are unchanged."""
    if getattr(optimizer, "_megatron_fsdp_model", None) is not None:
        raise ValueError("this optimizer was already passed to fully_shard_optimizer")
    if len(optimizer.state) > 0:
        raise ValueError(
            "the optimizer already holds state (it has stepped): build it fresh and shard it before the first step"
        )
    swap = PieceSwap(model.trainable_buckets(), names={face: name for name, face in model.named_parameters()})
    # An optimizer built before fully_shard holds the model's parameters; one built after it,
    # their DTensor faces (model.parameters()).
    to_face = {param: model.face_of(param) for param in model.optimizer_params()}
    to_face.update({face: face for face in to_face.values()})
    to_face.update({old: to_face[new] for old, new in getattr(model, "replaced_params", {}).items() if new in to_face})
    model_param_names = {p: n for n, p in model.module.named_parameters()}
    model_param_names.update({p: n for n, p in model.named_parameters()})
    for group_index, group in enumerate(optimizer.param_groups):
        faces = []
        for param in group["params"]:
            if param not in to_face:
                if param in model_param_names:
                    what = f"the model's parameter {model_param_names[param]!r}, which does not require grad"
                else:
                    what = f"a parameter of shape {tuple(param.shape)} that is not in the sharded model"
                raise ValueError(
                    f"optimizer param group {group_index} holds {what}; megatron_fsdp steps only the model's "
                    "trainable parameters: build the optimizer from those"
                )
            faces.append(to_face[param])
        group["params"] = faces

    original_step = optimizer.step
    original_zero_grad = optimizer.zero_grad
    release = grad_release_of(model)
    release.add(optimizer)
    steps_with_ops = model.settings.cpu_offload or reads_main_grads_as_they_are(optimizer, model.trainable_buckets())

    @functools.wraps(original_step)
    def step(self, *args, sync_grad_before_optimizer_step: bool = True, install_optimized_model_weights: bool = True, **kwargs):
        """Upstream's keywords: ``sync_grad_before_optimizer_step=False`` steps on the gradients
        shown so far (the caller synced them); ``install_optimized_model_weights=False`` leaves
        the compute weights to ``model.install_optimized_model_weights()``."""
        # Offloaded, or reading low-precision main gradients, the ops step Adam/AdamW/SGD and
        # install bucket by bucket (no closure).
        kernel_step = kernel_step_for(optimizer, model.trainable_buckets()) if steps_with_ops else None
        # Accelerate's optimizer wrapper passes closure=None positionally: no closure either.
        has_closure = any(value is not None for value in (*args, *kwargs.values()))
        if kernel_step is not None and has_closure and not model.settings.cpu_offload:
            raise ValueError(
                "optimizer.step() got arguments (a closure?), but with main gradients of a lower dtype than the main "
                "params megatron_fsdp's kernels step this optimizer and take none: call the closure before step()"
            )
        model.prepare_optimizer_step(sync_grads=sync_grad_before_optimizer_step)
        with swap.pieces(optimizer):
            if kernel_step is not None and not has_closure:
                kernel_step(install_optimized_model_weights)
                result, installed = None, install_optimized_model_weights
            else:
                if not optimizer.state:
                    _return_cached_device_memory(model)
                try:
                    result, installed = original_step(*args, **kwargs), False
                except (ValueError, RuntimeError, IndexError) as error:
                    swap.kind_of(optimizer).note_step_error(error, optimizer)
                    raise
        model.install_optimizer_step(install_weights=install_optimized_model_weights and not installed)
        return result

    @functools.wraps(original_zero_grad)
    def zero_grad(self, set_to_none: bool = True, zero_grad_buffer: bool = True) -> None:
        """``zero_grad_buffer=False`` (upstream's keyword) keeps the main gradients."""
        if zero_grad_buffer:
            release.zero_grad(model, self, set_to_none)
        if set_to_none:
            with plain_attribute_access():  # torch's zero_grad then only reads and clears .grad
                original_zero_grad(set_to_none)
        else:
            original_zero_grad(set_to_none)

    # Bound methods, as LR schedulers re-wrap ``optimizer.step`` through its ``__func__``.
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    # Before the placeholders' post-hook, which notes the tensors the state dict hands out.
    optimizer.register_state_dict_post_hook(swap.shown_state_dict)
    placeholders = InitialStatePlaceholders()
    if model.settings.preproc_state_dict_for_dcp_ckpt:
        # A fresh optimizer's state dict then holds tensors dcp.load fills in place (initial_state.py).
        optimizer.register_state_dict_pre_hook(
            lambda opt: placeholders.before_state_dict(opt, lambda: swap.take_zero_step(opt, original_step))
        )
        optimizer.register_state_dict_post_hook(placeholders.after_state_dict)
    optimizer.register_load_state_dict_pre_hook(
        lambda opt, state_dict: swap.to_face_layouts(opt, {**state_dict, "state": placeholders.drop_unfilled(state_dict["state"])})
    )
    optimizer._megatron_fsdp_model = model
    return optimizer
