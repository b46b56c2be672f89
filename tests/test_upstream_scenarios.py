"""Upstream megatron-fsdp's fully_shard test scenarios on 2 and 4 gloo ranks, each compared
with single-process training of the same model, data and seed (which upstream's tests do not
do): losses of every step, the last step's gradients read from ``p.grad`` (DTensors) of
``model.parameters()``, and the parameters after the last step.

- a CNN sharded by its ``Conv2d`` and ``Linear`` modules, under each of the four strategies, with
  ``set_model_auto_sync(False)`` on the early micro-batches and ``True`` on the last: ``.grad``
  is None on every rank until the synchronising micro-batch, then a DTensor on every
  trainable parameter;
- ``torch.nn.Transformer`` as one unit;
- HSDP and HFSDP on a ``(dp_outer, dp_shard, cp, tp)`` mesh flattened as upstream's README
  does (4 ranks: 2 x 2 x 1 x 1);
- ``preserve_fp32_weights`` both ways, on a bf16 model (fp32 main weights, or the bf16 weights
  stepped themselves), against a single process keeping the same master weights;
- meta-device init with ``tp_dim`` named (TP size 1);
- ``torch.distributed.checkpoint`` save of ``model.state_dict()`` and
  ``optimizer.state_dict()``, load into a fresh model and optimizer, resume: equal to the
  uninterrupted run bit for bit.

fp32 tolerance 1e-5 relative to each tensor's largest entry: sharded and single-process runs
differ only in the order of fp32 sums (per-rank partial sums of the batch, the reduction),
about 1e-7 relative per step; three Adam steps stay far below 1e-6 (Adam's update is the
gradient's sign-like ratio, so relative gradient noise moves parameters by lr x 1e-7). A
sharding bug (a wrong shard, a missing average, a gradient counted twice) is O(1). Adam is
used where no gradient is identically zero; the Transformer's attention key bias has an exact
zero gradient (softmax ignores it), where Adam would amplify rounding noise, so it trains with
SGD. bf16 runs cannot match to a fixed tolerance (every activation's rounding depends on the
batch split): as in test_parity, the sharded run must be within 2x of the single-process bf16
run's distance to exact (fp32) arithmetic from the same initial values.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import megatron_fsdp
import upstream_models
from _dist import run_distributed
from parity import compare_low_precision, max_relative_error

FP32_RTOL = 1e-5


@dataclass(frozen=True)
class Scenario:
    kind: str = "cnn"
    strategy: int | str = 3
    optimizer: str = "adam"
    accum: int = 2
    steps: int = 3
    micro_rows: int = 2
    dtype: torch.dtype = torch.float32
    # None: megatron_fsdp's default policy; True/False: the deprecated flag, as upstream's tests pass it.
    preserve_fp32_weights: bool | None = None
    meta_init_with_tp_dim: bool = False
    # HSDP: the outer strategy on a (dp_outer, dp_shard, cp, tp) = (2, world / 2, 1, 1) mesh.
    hybrid: str | None = None
    # Save after this many steps, resume in a fresh model and optimizer.
    checkpoint_after: int | None = None


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per step: whether any rank saw a .grad before the synchronising micro-batch, and whether
    # every trainable parameter had a DTensor .grad after it.
    seen_early: list[bool] = field(default_factory=list)
    shown_after_sync: list[bool] = field(default_factory=list)
    resumed_exactly: bool | None = None


def _optimizer(params, name: str) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2) if name == "adam" else torch.optim.SGD(params, lr=0.2, momentum=0.5)


def _global_rows(s: Scenario, world: int) -> int:
    return world * s.accum * s.micro_rows


def reference(s: Scenario, world: int, compute_dtype: torch.dtype | None = None) -> Run:
    """One process, the whole global batch per step, stepping fp32 master weights of a
    low-precision model unless ``preserve_fp32_weights=False``. ``compute_dtype`` overrides the
    model's dtype (same initial values): fp32 is the exact yardstick for a bf16 run."""
    model, _ = upstream_models.build(s.kind, dtype=s.dtype)
    dtype = compute_dtype or s.dtype
    model = model.to(dtype)
    master_dtype = dtype if s.preserve_fp32_weights is False else torch.float32
    master = {n: p.detach().to(master_dtype).clone().requires_grad_(True) for n, p in model.named_parameters()}
    optimizer = _optimizer(list(master.values()), s.optimizer)
    run = Run()
    for step in range(s.steps):
        loss = model(*upstream_models.batch_in(s.kind, step, _global_rows(s, world), dtype))
        loss.backward()
        run.losses.append(loss.item())
        for name, param in model.named_parameters():
            master[name].grad = param.grad.to(master_dtype)
        if step == s.steps - 1:
            run.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(master[name])
                param.grad = None
    run.params = {n: p.detach().clone() for n, p in master.items()}
    return run


def _shard(s: Scenario, seed: int = 0):
    """fully_shard as upstream's tests call it, optimizer built before."""
    kwargs = dict(zero_dp_strategy=s.strategy)
    if s.preserve_fp32_weights is not None:
        kwargs.update(preserve_fp32_weights=s.preserve_fp32_weights, grad_reduce_in_fp32=False)
    if s.hybrid is not None:
        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (2, world // 2, 1, 1), mesh_dim_names=("dp_outer", "dp_shard", "cp", "tp"))
        mesh[("dp_outer", "dp_shard")]._flatten("dp")
        mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
        mesh[("dp_outer", "dp_shard", "cp")]._flatten("hsdp")
        kwargs.update(device_mesh=mesh, dp_shard_dim="dp_shard_cp", dp_outer_dim="dp_outer", tp_dim="tp",
                      hybrid_fsdp_group=mesh["hsdp"].get_group(), outer_dp_sharding_strategy=s.hybrid)
    if s.meta_init_with_tp_dim:
        mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp_shard", "tp"))
        # device: materialised where this gloo test computes, also on a machine with a GPU.
        kwargs.update(device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp", init_model_with_meta_device=True, device="cpu")
    module, units = upstream_models.build(s.kind, seed=seed, meta=s.meta_init_with_tp_dim, dtype=s.dtype)
    optimizer = _optimizer(module.parameters(), s.optimizer)
    if s.meta_init_with_tp_dim:
        torch.manual_seed(seed)  # reset_parameters() draws the same numbers as a normal build
    return megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=units, **kwargs)


def _any_rank(flag: bool) -> bool:
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _train(model, optimizer, s: Scenario, rank: int, world: int, steps: range, run: Run) -> None:
    """Upstream's loop: auto-sync off for the early micro-batches, on for the last; the
    optimizer steps after it."""
    for step in steps:
        data = upstream_models.batch_in(s.kind, step, _global_rows(s, world), s.dtype)
        total = torch.zeros((), dtype=torch.float64)
        seen_early = False
        for micro in range(s.accum):
            last = micro == s.accum - 1
            model.set_model_auto_sync(last)
            rows = upstream_models.rows_of(s.kind, data, (micro * world + rank) * s.micro_rows, s.micro_rows)
            loss = model(*rows)
            (loss / s.accum).backward()
            total += loss.detach().double()
            if not last:
                seen_early |= any(p.grad is not None for p in model.parameters())
        run.seen_early.append(_any_rank(seen_early))
        trainable = [p for p in model.parameters() if p.requires_grad]
        run.shown_after_sync.append(all(isinstance(p.grad, DTensor) for p in trainable))
        dist.all_reduce(total)
        run.losses.append(total.item() / (world * s.accum))
        if step == s.steps - 1:
            run.grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def sharded(rank: int, world: int, s: Scenario, checkpoint_dir: str | None) -> Run:
    model, optimizer = _shard(s)
    run = Run()
    if s.checkpoint_after is None:
        _train(model, optimizer, s, rank, world, range(s.steps), run)
        run.params = _full_params(model)
        return run
    _train(model, optimizer, s, rank, world, range(s.checkpoint_after), run)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=checkpoint_dir)
    _train(model, optimizer, s, rank, world, range(s.checkpoint_after, s.steps), run)
    run.params = _full_params(model)

    model, optimizer = _shard(s, seed=1)  # other weights, a fresh optimizer
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    _train(model, optimizer, s, rank, world, range(s.checkpoint_after, s.steps), Run())
    resumed = _full_params(model)
    run.resumed_exactly = all(torch.equal(resumed[n], value) for n, value in run.params.items())
    return run


TWO_RANKS = {
    **{f"cnn-s{strategy}": Scenario(strategy=strategy) for strategy in range(4)},
    "transformer-s3": Scenario(kind="transformer", optimizer="sgd", accum=1),
    "transformer-s1": Scenario(kind="transformer", strategy="optim", optimizer="sgd"),
    "preserve-fp32-weights": Scenario(preserve_fp32_weights=True, dtype=torch.bfloat16, optimizer="sgd", accum=1),
    "no-fp32-weights": Scenario(preserve_fp32_weights=False, dtype=torch.bfloat16, optimizer="sgd", accum=1),
    "meta-init-with-tp-dim": Scenario(meta_init_with_tp_dim=True),
    "dcp-resume-s3": Scenario(steps=4, checkpoint_after=2),
}
FOUR_RANKS = {
    "hsdp": Scenario(hybrid="no_shard"),
    "hfsdp-dcp-resume": Scenario(hybrid="optim", steps=4, checkpoint_after=2),
}


def _all_scenarios(rank: int, world: int, scenarios: dict[str, Scenario], directory: str) -> dict[str, Run]:
    return {name: sharded(rank, world, s, os.path.join(directory, name)) for name, s in scenarios.items()}


@functools.cache
def _runs(world: int, directory: str) -> dict[str, Run]:
    """Every scenario of a world size in one launch (rank 0's view; ranks are checked to agree)."""
    scenarios = TWO_RANKS if world == 2 else FOUR_RANKS
    per_rank = run_distributed(_all_scenarios, world, scenarios, directory, timeout=600)
    for name in scenarios:
        for rank, theirs in enumerate(per_rank[1:], start=1):
            for key, value in per_rank[0][name].params.items():
                assert torch.equal(value, theirs[name].params[key]), f"{name}: rank {rank} ends with another {key}"
    return per_rank[0]


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("upstream_scenarios"))


def _check(name: str, world: int, root: str) -> None:
    s = (TWO_RANKS if world == 2 else FOUR_RANKS)[name]
    got, expected = _runs(world, root)[name], reference(s, world)
    label = f"{name} on {world} ranks"
    assert not any(got.seen_early), f"{label}: .grad visible before the synchronising micro-batch (steps {got.seen_early})"
    assert all(got.shown_after_sync), f"{label}: .grad not a DTensor on every parameter after the sync"
    if s.dtype != torch.float32:
        main_dtype = torch.float32 if s.preserve_fp32_weights else s.dtype
        assert {p.dtype for p in got.params.values()} == {main_dtype}, f"{label}: main weights are not {main_dtype}"
        compare_low_precision(got, expected, reference(s, world, compute_dtype=torch.float32), label)
        return
    for step, (a, b) in enumerate(zip(got.losses, expected.losses, strict=True)):
        assert abs(a - b) <= FP32_RTOL * abs(b), f"{label}: loss at step {step}: {a} vs single process {b}"
    for kind, ours, theirs in (("gradient", got.grads, expected.grads), ("parameter", got.params, expected.params)):
        assert ours.keys() == theirs.keys(), f"{label}: {kind} names differ"
        for key, value in theirs.items():
            error = max_relative_error(ours[key], value)
            assert error <= FP32_RTOL, f"{label}: {kind} {key}: relative error {error:.2e} > {FP32_RTOL}"
    if s.checkpoint_after is not None:
        assert got.resumed_exactly, f"{label}: the resumed run differs from the uninterrupted one"


@pytest.mark.parametrize("strategy", range(4))
def test_cnn_sharded_by_conv_and_linear_units_with_auto_sync_on_the_last_micro_batch(strategy, checkpoint_root) -> None:
    _check(f"cnn-s{strategy}", 2, checkpoint_root)


@pytest.mark.parametrize("name", ["transformer-s3", "transformer-s1"])
def test_torch_transformer_as_one_unit_matches_single_process(name, checkpoint_root) -> None:
    _check(name, 2, checkpoint_root)


@pytest.mark.parametrize("name", ["preserve-fp32-weights", "no-fp32-weights"])
def test_preserve_fp32_weights_either_way_matches_single_process(name, checkpoint_root) -> None:
    _check(name, 2, checkpoint_root)


def test_meta_device_init_with_tp_dim_named_matches_a_normal_build(checkpoint_root) -> None:
    _check("meta-init-with-tp-dim", 2, checkpoint_root)


def test_dcp_save_load_of_model_and_optimizer_state_dicts_resumes_exactly(checkpoint_root) -> None:
    _check("dcp-resume-s3", 2, checkpoint_root)


@pytest.mark.parametrize("name", ["hsdp", "hfsdp-dcp-resume"])
def test_hsdp_and_hfsdp_on_upstreams_flattened_four_dim_mesh(name, checkpoint_root) -> None:
    _check(name, 4, checkpoint_root)
