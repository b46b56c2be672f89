"""Gradient clipping over the flat gradient buffers: one fused norm op over every parameter's
piece, one all-reduce, one in-place scale per bucket.

torch's own ``clip_grad_norm_(model.parameters(), ...)`` gives the same result through the
parameters' DTensor gradients (one norm and one collective per mesh, through DTensor dispatch);
this is the fast path, and the one that also works when parameters live on different meshes
(dense and expert parameters).
"""

from __future__ import annotations

import math

import torch

from megatron_fsdp import _ops
from megatron_fsdp.engine.groups.collectives import all_reduce_max, all_reduce_sum
from megatron_fsdp.engine.step.sharded_model import ShardedModel


def _check_arguments(max_norm: float, norm_type: float) -> None:
    """Raises before any collective: every rank got the same arguments or fails the same way."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not (0 < max_norm < math.inf):
        raise ValueError(f"clip_grad_norm_: max_norm must be a finite number > 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 (or math.inf), got {norm_type!r}")


def total_grad_norm(model: ShardedModel, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of every trainable parameter's reduced gradient, as a single process holding the
    whole model would compute it (a collective over the whole world). Each piece counts once:
    pieces that several ranks hold (no_shard, HSDP replicas, tensor-parallel replicas) are
    divided by their number of copies."""
    model.finish_grad_sync()
    pieces, copies = [], []
    for bucket in model.trainable_buckets():
        if bucket.grads.optimizer_grads is None:  # nothing reduced since zero_grad: the same on every rank
            continue
        for face, (lo, hi) in zip(bucket.faces, bucket.optim_ranges):
            if hi > lo:
                pieces.append(bucket.grads.optimizer_grads[lo:hi])
                copies.append(face.spec.copies)
    device = model.compute_device
    if pieces:
        # On the gradients' device (the host, when offloaded); the sum then travels on the model's.
        per_piece = _ops.multi_tensor_norm(pieces, float(norm_type)).double()
    else:
        per_piece = torch.zeros(0, dtype=torch.float64, device=device)
    if math.isinf(norm_type):
        local = per_piece.max() if pieces else torch.zeros((), dtype=torch.float64, device=device)
        local = local.to(device)
        all_reduce_max(local, None)
        return local.float()
    weights = torch.tensor([1.0 / c for c in copies], dtype=torch.float64, device=per_piece.device)
    local = (per_piece * weights).sum().to(device)
    all_reduce_sum(local, None)
    return local.pow(1.0 / norm_type).float()


def clip_grad_norm_(
    model: ShardedModel, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = True
) -> torch.Tensor:
    """Scales every trainable parameter's reduced gradient (what ``param.grad`` shows and the
    optimizer steps with) so their total ``norm_type``-norm is at most ``max_norm``; returns the
    total norm before clipping, a float32 scalar tensor, equal on every rank. A collective: call
    it on every rank, after backward and before ``optimizer.step()``.

    ``error_if_nonfinite`` (default True): a NaN or Inf norm raises ``FloatingPointError`` on every
    rank, as ``check_for_nan_in_grad`` does, and nothing is scaled; False returns it and scales
    by it as torch does (which fills the gradients with NaN)."""
    _check_arguments(max_norm, norm_type)
    total = total_grad_norm(model, norm_type)
    if error_if_nonfinite and not torch.isfinite(total).item():
        raise FloatingPointError(
            f"clip_grad_norm_: the total gradient norm is {total.item()} before optimizer step "
            f"{model.optimizer_steps}; set report_nan_in_param_grad=True to find the parameters"
        )
    # A float32 factor, applied in float32 to gradients of any dtype (as torch's clip does).
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [b.grads.optimizer_grads for b in model.trainable_buckets() if b.grads.optimizer_grads is not None]
    if grads:
        torch._foreach_mul_(grads, scale.to(grads[0].device))
    return total
