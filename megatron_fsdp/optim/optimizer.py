"""The distributed optimizer: any elementwise torch optimizer over the model's DTensor faces,
stepping only this rank's fp32 main-parameter pieces, then installing them into the compute
weights. With CPU offloading, or main gradients of a lower dtype than the main
params, the C++ ops step them (kernel_step.py)."""

from __future__ import annotations

import functools
import types
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp.checkpoint import state_dicts
from megatron_fsdp.engine.piece_dtensor import plain_attribute_access
from megatron_fsdp.engine.sharded_params import sharded_dtensor
from megatron_fsdp.optim.kernel_step import kernel_step_for, reads_main_grads_as_they_are
from megatron_fsdp.optim.initial_state import InitialStatePlaceholders

if TYPE_CHECKING:  # the wrapper sits above this module; it is passed in
    from megatron_fsdp.megatron_fsdp import MegatronFSDP


class PieceSwap:
    """Outside ``step`` the optimizer holds what users and torch's tools expect of FSDP: the
    DTensor faces in its param groups, their ``.grad``, and DTensor state keyed by them, so
    ``state_dict()`` and torch's ``get/set_optimizer_state_dict`` map them to FQNs. Inside
    ``step`` it holds the plain 1-D pieces under the faces (the same storage) with plain
    gradients and state, so no DTensor dispatch lands in the step. Either side's wrappers are
    reused while the other side still holds the same tensors, so a swap costs a few dict
    look-ups per parameter."""

    def __init__(self, model: MegatronFSDP) -> None:
        self.sources = state_dicts.face_sources(model)
        self.sharded = {sharded.param: sharded for bucket in model.trainable_buckets() for sharded in bucket.faces}
        pieces = model.optimizer_params()
        self.piece_of = {model.face_of(param): piece for param, piece in pieces.items()}
        self.face_of = {piece: face for face, piece in self.piece_of.items()}
        self.names = {face: name for name, face in model.named_parameters()}
        # face -> state name -> (the DTensor shown, the plain tensor stepped): what a swap reuses.
        self._pairs: dict[nn.Parameter, dict[str, tuple[DTensor, torch.Tensor]]] = {}

    @contextmanager
    def pieces(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        faces_per_group = [group["params"] for group in optimizer.param_groups]
        # Everything that can raise comes first: the optimizer is left as it was.
        with plain_attribute_access():
            pieces_per_group = [[self._piece_with_grad(face) for face in faces] for faces in faces_per_group]
        shown_state = optimizer.state
        plain_state = self._plain_state(shown_state)
        for group, pieces in zip(optimizer.param_groups, pieces_per_group):
            group["params"] = pieces
        optimizer.state = plain_state
        try:
            yield
        finally:
            optimizer.state = self._shown_state(optimizer.state)
            for group, faces in zip(optimizer.param_groups, faces_per_group):
                group["params"] = faces

    def _piece_with_grad(self, face: nn.Parameter) -> nn.Parameter:
        """The face's piece, its ``.grad`` the face's: the reduced gradient shown after the
        sync (already on the piece), one a user or a tool assigned, or None."""
        piece = self.piece_of.get(face)
        if piece is None:
            raise ValueError(
                "an optimizer param group holds a tensor that is not a parameter of the sharded model; add "
                "model.parameters() (after fully_shard) to the optimizer, not other tensors"
            )
        grad = face.grad
        if grad is None:
            piece.grad = None
        elif grad is not self.sharded[face].shown_grad:
            piece.grad = self._assigned_grad(face, grad)
        return piece

    def _assigned_grad(self, face: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        source = self.sources[face]
        if not isinstance(grad, DTensor) or not state_dicts.holds_this_piece(grad, source.spec):
            raise ValueError(
                f"the .grad of parameter {self.names[face]!r} is not a DTensor laid out like the parameter; "
                "assign gradients made from the parameter or its .grad (torch.zeros_like(p), p.grad * 2), "
                "not full tensors"
            )
        return grad._local_tensor.reshape(source.piece.shape)

    def _plain_state(self, shown_state: dict[Any, dict[str, Any]]) -> defaultdict:
        plain: defaultdict = defaultdict(dict)
        for face, entries in shown_state.items():
            pairs = self._pairs.get(face, {})
            piece = self.piece_of[face]
            plain_entries = {}
            for name, value in entries.items():
                pair = pairs.get(name)
                if pair is not None and pair[0] is value:
                    plain_entries[name] = pair[1]
                elif isinstance(value, DTensor):
                    plain_entries[name] = value._local_tensor.view(piece.shape)
                else:
                    plain_entries[name] = value
            plain[piece] = plain_entries
        return plain

    def _shown_state(self, plain_state: dict[Any, dict[str, Any]]) -> defaultdict:
        shown: defaultdict = defaultdict(dict)
        pairs_now: dict[nn.Parameter, dict[str, tuple[DTensor, torch.Tensor]]] = {}
        for piece, entries in plain_state.items():
            face = self.face_of[piece]
            pairs = self._pairs.get(face, {})
            face_pairs = pairs_now[face] = {}
            shown_entries = {}
            for name, value in entries.items():
                per_element = isinstance(value, torch.Tensor) and value.shape == piece.shape
                if not per_element:
                    shown_entries[name] = value
                    continue
                pair = pairs.get(name)
                if pair is None or pair[1] is not value:
                    pair = (sharded_dtensor(value, self.sources[face].spec), value)
                face_pairs[name] = pair
                shown_entries[name] = pair[0]
            shown[face] = shown_entries
        self._pairs = pairs_now
        return shown

    def take_zero_step(self, optimizer: torch.optim.Optimizer, unwrapped_step: Any) -> None:
        """One step of zero gradients at zero learning rate on the pieces, as torch's distributed
        state-dict helpers take: it creates the optimizer's state and moves no weight."""
        saved_lrs = []
        for group in optimizer.param_groups:
            saved_lrs.append(group.get("lr"))
            if "lr" in group:
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        with self.pieces(optimizer):
            saved_grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
            for piece, _ in saved_grads:
                piece.grad = torch.zeros_like(piece)
            unwrapped_step()
            for piece, grad in saved_grads:
                piece.grad = grad
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            if lr is not None:
                group["lr"] = lr

    def to_face_layouts(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A state dict about to be loaded, its per-element entries laid out like the faces (torch
        matches saved entries to parameters by position, keyed by index or by FQN)."""
        faces = [face for group in optimizer.param_groups for face in group["params"]]
        keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        if len(keys) != len(faces):
            raise ValueError(
                f"the optimizer state dict holds {len(keys)} parameters, this optimizer {len(faces)}: "
                "load it into an optimizer built over the same parameters"
            )
        unexpected = [str(key) for key in state_dict["state"] if key not in set(keys)]
        if unexpected:
            raise RuntimeError(
                f"the optimizer state dict does not fit this model; unexpected: {', '.join(unexpected)} (state for "
                "parameters its param groups do not list)"
            )
        state = dict(state_dict["state"])
        for key, face in zip(keys, faces):
            if key in state:
                state[key] = {
                    name: state_dicts.to_face_layout(value, self.sources[face], f"{name!r} of {self.names[face]!r}")
                    for name, value in state[key].items()
                }
        return {**state_dict, "state": state}


def _return_cached_device_memory(model: MegatronFSDP) -> None:
    """Before a fresh optimizer's first step, which creates state that lives for the whole run
    (Adam: two tensors per main param), the device memory torch caches goes back to the driver,
    so that state takes blocks of its own. Otherwise it is carved out of the blocks the first
    backward's activations freed, pins the rest of each, and the memory later steps need whole
    is left in pieces: the 8.8B model on one H200 ran out of memory that way with 3 GiB free."""
    if any(bucket.device.type == "cuda" and bucket.host is None for bucket in model.trainable_buckets()):
        torch.cuda.empty_cache()


def distribute_optimizer(optimizer: torch.optim.Optimizer, model: MegatronFSDP) -> torch.optim.Optimizer:
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
    swap = PieceSwap(model)
    # An optimizer built before fully_shard holds the model's parameters; one built after it,
    # their DTensor faces (model.parameters()).
    to_face = {param: model.face_of(param) for param in model.optimizer_params()}
    to_face.update({face: face for face in swap.piece_of})
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
                result, installed = original_step(*args, **kwargs), False
        model.install_optimizer_step(install_weights=install_optimized_model_weights and not installed)
        return result

    @functools.wraps(original_zero_grad)
    def zero_grad(self, set_to_none: bool = True, zero_grad_buffer: bool = True) -> None:
        """``zero_grad_buffer=False`` (upstream's keyword) keeps the main gradients."""
        if zero_grad_buffer:
            model.zero_grad_buffer(set_to_none)
        if set_to_none:
            with plain_attribute_access():  # torch's zero_grad then only reads and clears .grad
                original_zero_grad(set_to_none)
        else:
            original_zero_grad(set_to_none)

    # Bound methods, as LR schedulers re-wrap ``optimizer.step`` through its ``__func__``.
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
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
