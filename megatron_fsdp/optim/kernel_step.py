"""The optimizer step through megatron_fsdp's C++ ops instead of torch's update.

``torch.optim.Adam``, ``AdamW`` and ``SGD`` (the classes themselves, with options the ops
implement) are stepped by the ops ``adam_step_`` / ``sgd_step_``, one call per main-parameter
piece with its param group's hyper-parameters (so per-group learning rates and LR schedulers
apply), bucket by bucket. Two cases take this path:

- CPU offloading: the pieces are on the host. Each bucket's new weights start for the device as
  soon as it is stepped, while the host steps the next one; the op writes them, cast to the
  compute dtype, into the bucket's staging buffer in the same pass as the step, so the updated
  main parameters are not read a second time to cast them.
- Main gradients of a lower dtype than the main parameters (bf16 under fp32): the op upcasts
  each gradient in registers, so no fp32 copy of the gradients is made for the optimizer to read
  (torch's optimizers need the gradient in the parameter's dtype).

The state stays torch's (same entries, dtypes and step counts), so checkpoints do not depend on
which way stepped. Offloaded, every other optimizer runs its own ``step`` over the host pieces
(logged once); with low-precision main gradients, it reads a cast copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from megatron_fsdp import _ops
from megatron_fsdp.engine.buckets.buffer import Bucket

logger = logging.getLogger(__name__)

_ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_CAPTURE_REFUSED = (
    "optimizer.step() is being captured in a CUDA graph, but megatron_fsdp steps this optimizer with "
    "its C++ ops (bf16 main gradients or CPU offloading), which take the step count and learning rate "
    "from the host: every replay would repeat the captured ones. Build the optimizer with "
    "capturable=True (torch then steps it on the device), or do not capture the step"
)
# Compute dtypes the ops can write the new weights in (weights_out).
_WEIGHTS_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ops_available() -> bool:
    """Whether this build has the optimizer ops (wrapper and compiled kernel)."""
    return hasattr(_ops, "adam_step_") and hasattr(_ops, "sgd_step_") and hasattr(_ops._ops, "adam_step_")


def unsupported_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the ops cannot step ``optimizer`` (None: they can)."""
    if not _ops_available():
        return "this build of megatron_fsdp has no optimizer op"
    kind = type(optimizer)
    if kind not in (*_ADAM_CLASSES, torch.optim.SGD):
        return f"{kind.__qualname__} is not torch.optim.Adam, AdamW or SGD"
    for index, group in enumerate(optimizer.param_groups):
        for option in ("capturable", "differentiable"):
            if group.get(option):
                return f"param group {index} sets {option}=True"
        numbers = [group["lr"], group.get("eps", 0.0), group["weight_decay"], *group.get("betas", ())]
        if any(isinstance(value, torch.Tensor) and value.numel() != 1 for value in numbers):
            return f"param group {index} holds a hyper-parameter tensor of more than one element"
    return None


class KernelStep:
    """Steps an optimizer's pieces with the C++ ops (see the module docstring). Call
    :meth:`step` inside ``PieceSwap.pieces``, where the param groups hold the pieces."""

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: list[Bucket]) -> None:
        self.optimizer = optimizer
        self.buckets = buckets
        self.is_adam = isinstance(optimizer, _ADAM_CLASSES)
        # torch's own hooks and profiler range around the step, as its optimizers have.
        self._hooked_step = torch.optim.Optimizer.profile_hook_step(KernelStep._step_all)

    def step(self, install: bool) -> None:
        """One step of every piece; with ``install``, each bucket's weights leave for the device
        right after its pieces are stepped."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(_CAPTURE_REFUSED)
        self._hooked_step(self.optimizer, self, install)

    @staticmethod
    @torch.no_grad()
    def _step_all(optimizer: torch.optim.Optimizer, self: KernelStep, install: bool) -> None:
        group_of = {piece: group for group in optimizer.param_groups for piece in group["params"]}
        for bucket in self.buckets:
            staged = bucket.weights.stage() if install and bucket.dtype in _WEIGHTS_OUT_DTYPES else None
            stepped: list[tuple[int, int]] = []
            for piece, (lo, hi) in zip(bucket.optim_params, bucket.optim_ranges):
                group = group_of.get(piece)
                if group is not None and piece.grad is not None:
                    weights_out = None if staged is None else staged.buffer[lo:hi]
                    self._step_piece(piece, group, optimizer.state[piece], weights_out)
                    stepped.append((lo, hi))
            if staged is not None:
                _cast_unstepped(staged.buffer, bucket.main_params, stepped)
            if install:
                bucket.weights.install(staged)

    def _step_piece(
        self, piece: nn.Parameter, group: dict[str, Any], state: dict[str, Any], weights_out: torch.Tensor | None
    ) -> None:
        if self.is_adam:
            self._adam(piece, group, state, weights_out)
        else:
            self._sgd(piece, group, state, weights_out)

    def _adam(
        self, piece: nn.Parameter, group: dict[str, Any], state: dict[str, Any], weights_out: torch.Tensor | None
    ) -> None:
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        if not state:
            # torch.optim.Adam's initial state: a float32 step count and zeroed moments.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for name in names:
                state[name] = torch.zeros_like(piece, memory_format=torch.preserve_format)
        buffers = [_as_flat_fp32(state, name, piece) for name in names]
        state["step"] += 1
        if piece.numel() == 0:
            return
        beta1, beta2 = group["betas"]
        _ops.adam_step_(
            piece.view(-1), piece.grad.view(-1), buffers[0], buffers[1],
            step=int(state["step"].item()), lr=float(group["lr"]), betas=(float(beta1), float(beta2)),
            eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
            decoupled_weight_decay=bool(group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))),
            amsgrad=bool(group["amsgrad"]), max_exp_avg_sq=buffers[2] if group["amsgrad"] else None,
            maximize=bool(group["maximize"]), weights_out=weights_out,
        )

    def _sgd(
        self, piece: nn.Parameter, group: dict[str, Any], state: dict[str, Any], weights_out: torch.Tensor | None
    ) -> None:
        momentum = float(group["momentum"])
        buffer, first_step = None, False
        if momentum != 0.0:
            # torch.optim.SGD keeps a momentum buffer only once it has stepped with momentum.
            first_step = state.get("momentum_buffer") is None
            if first_step:
                state["momentum_buffer"] = torch.empty_like(piece)
            buffer = _as_flat_fp32(state, "momentum_buffer", piece)
        if piece.numel() == 0:
            return
        _ops.sgd_step_(
            piece.view(-1), piece.grad.view(-1), buffer, lr=float(group["lr"]), momentum=momentum,
            dampening=float(group["dampening"]), weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]), first_step=first_step,
            weights_out=weights_out,
        )


def _cast_unstepped(staging: torch.Tensor, main_params: torch.Tensor, stepped: list[tuple[int, int]]) -> None:
    """Casts into ``staging`` the main params the op did not write there: pieces it did not step
    (no gradient, or not in the optimizer) and the padding between pieces. ``stepped``: the
    disjoint ranges it wrote."""
    start, end = 0, main_params.numel()
    for lo, hi in [*sorted(stepped), (end, end)]:
        if lo > start:
            staging[start:lo].copy_(main_params[start:lo])
        start = max(start, hi)


def _as_flat_fp32(state: dict[str, Any], name: str, piece: torch.Tensor) -> torch.Tensor:
    """A state entry as the ops take it (contiguous float32 on the piece's device, viewed flat);
    an entry loaded in another form is converted once, in the state itself."""
    value = state[name]
    if value.dtype != torch.float32 or value.device != piece.device or not value.is_contiguous():
        value = state[name] = value.to(piece.device, torch.float32).contiguous()
    return value.view(-1)


def kernel_step_for(optimizer: torch.optim.Optimizer, buckets: Iterable[Bucket]) -> Callable[[bool], None] | None:
    """The ops' step for ``optimizer`` over ``buckets``, or None (logged once per optimizer)
    when torch's own step must run on the (offloaded) pieces instead."""
    buckets = list(buckets)
    reason = unsupported_reason(optimizer) or _main_params_reason(buckets)
    if reason is not None:
        if not getattr(optimizer, "_megatron_fsdp_fallback_logged", False):
            optimizer._megatron_fsdp_fallback_logged = True
            logger.warning(
                "megatron_fsdp: cpu_offload steps this optimizer with its own step on the host (slower): %s", reason
            )
        return None
    return KernelStep(optimizer, buckets).step


def reads_main_grads_as_they_are(optimizer: torch.optim.Optimizer, buckets: Iterable[Bucket]) -> bool:
    """Whether the ops will step ``optimizer`` because some device bucket's main gradients are
    of a lower dtype than its main params; if so, those buckets show them as they are."""
    buckets = list(buckets)
    low = [b for b in buckets if b.host is None and b.dtypes.grads_below_main_params]
    if not low or unsupported_reason(optimizer) is not None or _main_params_reason(buckets) is not None:
        return False
    for bucket in low:
        bucket.grads.read_main_grads_as_they_are()
    return True


def _main_params_reason(buckets: list[Bucket]) -> str | None:
    """Why the ops cannot step these buckets' main params (they step float32 ones, and
    torch.optim keeps the state of others in their own dtype)."""
    dtypes = sorted({str(b.main_params.dtype) for b in buckets if b.main_params.dtype != torch.float32})
    if dtypes:
        return f"the main params are {', '.join(dtypes)}, not float32 (set main_params_dtype=torch.float32)"
    return None
