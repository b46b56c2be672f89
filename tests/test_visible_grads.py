"""What ``model.parameters()`` and their ``.grad`` are after fully_shard, on 2 gloo ranks: DTensor
parameters whose gradients are DTensors over views of the reduced-gradient buffers, None
where torch has None, and what torch's own gradient tools compute from them."""

from __future__ import annotations

import gc
import math
import weakref

import torch
from torch.distributed.tensor import DTensor

import megatron_fsdp
from _dist import run_distributed
from expected_errors import value_error_messages
from models import Block, make_batch, make_model
from parity import max_relative_error, train_data_parallel

MICRO_ROWS = 2


def _backward(model: megatron_fsdp.MegatronFSDP, rank: int, world: int, step: int = 0) -> None:
    tokens, targets = make_batch(step, world * MICRO_ROWS)
    rows = slice(rank * MICRO_ROWS, (rank + 1) * MICRO_ROWS)
    model(tokens[rows], targets[rows]).backward()


def _pieces_of_full(model: megatron_fsdp.MegatronFSDP, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's flat piece of each full tensor: what its DTensor's local tensor holds."""
    pieces = {}
    for bucket in model.trainable_buckets():
        for name, (piece, start) in zip(bucket.names, bucket.checkpoint_pieces()):
            pieces[name] = full[name].reshape(-1)[start : start + piece.numel()]
    return pieces


def _grad_views(rank: int, world: int, strategy: int) -> dict:
    model = megatron_fsdp.fully_shard_model(make_model(seed=0, frozen=True), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    named = dict(model.named_parameters())
    report = {"names": list(named), "before": [n for n, p in named.items() if p.grad is not None]}
    report["dtensor_params"] = all(isinstance(p, torch.nn.Parameter) and isinstance(p, DTensor) for p in named.values())
    reference_shapes = {n: p.shape for n, p in make_model(seed=0).named_parameters()}
    report["shapes_right"] = all(named[n].shape == shape for n, shape in reference_shapes.items())
    _backward(model, rank, world)
    expected = _pieces_of_full(model, model.full_gradients())
    report["frozen_with_grad"] = [n for n, p in named.items() if not p.requires_grad and p.grad is not None]
    report["errors"] = {}
    report["views"] = True
    for bucket in model.trainable_buckets():
        lo_ptr = bucket.grads.optimizer_grads.data_ptr()
        hi_ptr = lo_ptr + bucket.grads.optimizer_grads.numel() * bucket.grads.optimizer_grads.element_size()
        for name in bucket.names:
            grad = named[name].grad
            assert isinstance(grad, DTensor) and grad.shape == named[name].shape, name
            local = grad.to_local()
            report["views"] &= lo_ptr <= local.data_ptr() < hi_ptr or local.numel() == 0
            report["errors"][name] = max_relative_error(local.reshape(-1), expected[name]) if local.numel() else 0.0
    # torch's own helpers on the DTensor gradients: the norm of the whole model's gradient.
    full_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in model.full_gradients().values()))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    report["norms"] = (torch.nn.utils.get_total_norm(grads).full_tensor().item(), full_norm)
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    report["clipped_max"] = max(g.abs().max().item() for g in model.full_gradients().values())
    model.zero_grad(set_to_none=False)
    report["zeroed"] = all(p.grad is None or p.grad.to_local().abs().sum().item() == 0 for p in model.parameters())
    released = [weakref.ref(b.grads.main_grad) for b in model.trainable_buckets()]
    del grads, grad, local
    model.zero_grad()
    report["after_zero_grad"] = [n for n, p in model.named_parameters() if p.grad is not None]
    # The gradient DTensors are kept for the next step but must not keep their buffers alive.
    gc.collect()
    report["grads_freed"] = all(ref() is None for ref in released)
    return report


def test_grads_are_dtensor_views_of_the_reduced_buffers_for_every_strategy() -> None:
    for strategy in range(4):
        report = run_distributed(_grad_views, 2, strategy)[0]
        label = f"strategy {strategy}"
        assert report["dtensor_params"] and "blocks.0.norm1.weight" in report["names"], label
        assert report["shapes_right"], f"{label}: a DTensor parameter has another shape than the model's parameter"
        assert report["before"] == [], f"{label}: gradients before any backward: {report['before']}"
        assert report["frozen_with_grad"] == [], f"{label}: frozen parameters with a gradient: {report['frozen_with_grad']}"
        assert report["views"], f"{label}: a .grad is not a view of the reduced-gradient buffer"
        worst = max(report["errors"].values())
        assert worst == 0.0, f"{label}: a .grad differs from the reduced gradient by {worst:.2e}"
        torch_norm, full_norm = report["norms"]
        assert abs(torch_norm - full_norm) <= 1e-6 * full_norm, f"{label}: get_total_norm {torch_norm} vs {full_norm}"
        assert report["clipped_max"] <= 0.01, f"{label}: clip_grad_value_ left {report['clipped_max']}"
        assert report["zeroed"], f"{label}: zero_grad(set_to_none=False) left non-zero gradients"
        assert report["after_zero_grad"] == [], f"{label}: zero_grad() left {report['after_zero_grad']}"
        assert report["grads_freed"], f"{label}: a released main gradient is still alive"


def _optimizer_after_fully_shard(rank: int, world: int) -> tuple[list[float], list[float]]:
    """FSDP2's habit, an optimizer built from model.parameters() after fully_shard, trains as
    one passed to fully_shard."""
    losses = {}
    for when in ("before", "after"):
        module = make_model(seed=0)
        if when == "before":
            model, optimizer = megatron_fsdp.fully_shard(module, torch.optim.Adam(module.parameters(), lr=1e-2), fsdp_unit_modules=[Block])
        else:
            model = megatron_fsdp.fully_shard_model(module, fsdp_unit_modules=[Block])
            optimizer = megatron_fsdp.fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
        losses[when] = train_data_parallel(model, optimizer, 3, 1, MICRO_ROWS, rank, world).losses
    return losses["before"], losses["after"]


def test_optimizer_built_from_sharded_parameters_trains_like_one_passed_to_fully_shard() -> None:
    before, after = run_distributed(_optimizer_after_fully_shard, 2)[0]
    assert before == after, (before, after)


def _bad_max_norm(rank: int, world: int) -> list[str]:
    model = megatron_fsdp.fully_shard_model(make_model(seed=0), fsdp_unit_modules=[Block])
    _backward(model, rank, world)
    calls = {repr(v): (lambda v=v: megatron_fsdp.clip_grad_norm_(model, v)) for v in (0.0, -1.0, math.inf, math.nan, "1")}
    calls["norm_type=0"] = lambda: megatron_fsdp.clip_grad_norm_(model, 1.0, norm_type=0)
    messages = list(value_error_messages(calls).values())
    # No rank entered a collective for the refused calls: a real one now pairs up.
    megatron_fsdp.clip_grad_norm_(model, 1.0)
    # An Inf in one rank's gradient: every rank reports the non-finite norm and nothing is scaled.
    grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.to_local().numel())
    if rank == 0:
        grad.to_local()[0] = math.inf
    before = grad.to_local().clone()
    try:
        megatron_fsdp.clip_grad_norm_(model, 1e-3)
        messages.append("no error")
    except FloatingPointError as error:
        messages.append(str(error).split(" before")[0])
    messages.append(str(torch.equal(grad.to_local(), before)))
    return messages


def test_clip_grad_norm_refuses_bad_max_norm_and_reports_non_finite_norms_on_every_rank() -> None:
    per_rank = run_distributed(_bad_max_norm, 2)
    assert per_rank[0] == per_rank[1]
    assert all(m is not None and "max_norm must be a finite number > 0" in m for m in per_rank[0][:5]), per_rank[0]
    assert "norm_type must be > 0" in per_rank[0][5], per_rank[0]
    assert per_rank[0][6] == "clip_grad_norm_: the total gradient norm is inf", per_rank[0]
    assert per_rank[0][7] == per_rank[1][7] == "True", "a non-finite norm scaled the gradients"
