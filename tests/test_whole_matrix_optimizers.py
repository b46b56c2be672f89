"""torch.optim.Muon (the blocks' 2-D weights) with AdamW (the rest) over a model sharded by either
front door, against the same two optimizers in one process on the same model and data.

Muon steps whole matrices (megatron_fsdp/optim/whole_tensors.py): each matrix's owner rank
receives it and its reduced gradient whole and runs torch's own step on it, and every rank gets its
piece of the new weights back. The sharded and the one-process runs
then differ only in how the gradient was summed (per rank, then over ranks, instead of over all
rows at once: ~1e-7 relative). torch's Muon rounds the momentum to bf16 before Newton-Schulz, so
such a difference can round an entry the other way, and Newton-Schulz spreads that over the matrix:
measured at world 4, one such entry of blocks.0.proj.weight's gradient moves its first step by
2.7e-4 (2% of the step), the same on one process given the two gradients. Where no entry rounds
differently (the fp32 cases below, measured: at most 8e-7 after STEPS steps on AVX2 machines) the
parameters are held to FLIP_RTOL (one such flip under AVX-512's summation orders); the others to
LOOSE_RTOL on Muon's matrices. A matrix
stepped on its flat piece, a missing gather or a piece written back to the wrong range is off by
its whole update.

Also: each matrix's momentum lives whole on its owner only, shows in the state dict as pieces of
its global shape and round-trips through it and through DCP across world sizes (both doors); bad
input (Muon given a vector), a step that raises on one owner only and an undeclared optimizer that
needs matrices fail on every rank; a declared one steps whole matrices. Over tensor parallelism
(dp 2 x tp 2, both doors) and HFSDP each matrix is stepped on one rank of the four (one of each dp
group where tp leaves it whole), under HSDP on one rank of each replica, and where data parallelism
leaves a tp block whole (no_shard, HSDP over a dp_shard of one rank; megatron-core's strided fc1
too) on one tp rank of each replica. On the whole-model door each optimizer's zero_grad clears
its own gradients only (both loops torch users write; an optimizer that never zeroes), a Muon
checkpoint of dp 2 x tp 2 resumes over dp 4, and on FSDP2's door an owner's error that ends its
program reaches the other ranks.

Where the one-process reference runs matters: computed in a worker process (one thread), it
differs from the same run in the test process by one such rounding flip (6.5e-3, measured), so
the tensor-parallel cases, whose reference runs in the workers, are held to LOOSE_RTOL although
against the test process's reference the sharded run is exact (0.0, measured 2026-11-29).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import megatron_fsdp
from _dist import run_distributed
from models import HIDDEN, Block, make_batch, make_model, train_steps
from state_dict_io import load_with_helpers, save_with_helpers

STEPS, ROWS, LR, MUON_LR, MAX_NORM = 3, 2, 1e-2, 2e-2, 0.5
# fp32: parameters within RTOL of one process after STEPS steps (measured at most 8.1e-7, see
# above), and each step's loss (the mean over ranks of the rank's loss, which is the whole batch's)
# within RTOL too (measured at most 1e-7): the owner steps the same whole tensors one process does.
RTOL = 1e-5
# Where the kernels sum the fp32 gradients in other orders (AVX-512's ATen kernels, measured on such
# a machine 2026-12-01), one gradient entry can round to the other bf16 neighbour inside Muon's
# Newton-Schulz, which then moves the matrices by up to 2.2e-3 of their largest entry and the
# momentum and AdamW's parameters by up to 1.7e-4 after STEPS steps (on AVX2 machines: below 1e-6).
# The fp32 parity cases hold every parameter, loss and momentum to this, still 20x below a matrix
# stepped wrongly (~1e-1).
FLIP_RTOL = 5e-3
# bf16 compute (fp32 main weights and reductions) against the one-process run in fp32, and HSDP's
# and CPU offloading's sums in another order that round one bf16 entry differently (see above):
# Muon's matrices end up to 1.4e-2 (bf16), 6.2e-3 (HSDP) and 2.2e-3 (offload) of their largest
# entry from one process after STEPS steps (measured; offloaded with ns_steps=0, where a rounding
# flip cannot spread, 9e-6), while a matrix stepped wrongly is off by its whole update (~1e-1). AdamW's parameters
# are left out there: they follow the matrices, and bf16 noise on a near-zero gradient (a norm's
# bias) becomes a full-size Adam update (docs/testing.md's pitfall).
LOOSE_RTOL = 3e-2


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def _is_matrix_in_block(name: str, param: torch.Tensor) -> bool:
    return name.startswith("blocks.") and param.dim() == 2


def _optimizers(named_params: list[tuple[str, torch.Tensor]]) -> list[torch.optim.Optimizer]:
    matrices = [p for n, p in named_params if _is_matrix_in_block(n, p)]
    rest = [p for n, p in named_params if not _is_matrix_in_block(n, p)]
    return [torch.optim.Muon(matrices, lr=MUON_LR, weight_decay=0.1), torch.optim.AdamW(rest, lr=LR)]


def _single_process(world: int, accumulate: int, clip: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The parameters after STEPS steps and each step's loss, in one process."""
    model = make_model(seed=0)
    optimizers = _optimizers(list(model.named_parameters()))
    losses = []
    for step in range(STEPS):
        loss = model(*make_batch(step, world * accumulate * ROWS))
        loss.backward()
        losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return {name: param.detach() for name, param in model.named_parameters()}, losses


def _global_loss(loss: torch.Tensor) -> float:
    """The mean over ranks of each rank's loss (every rank has as many rows): the loss of the
    whole batch, as one process computes it."""
    loss = loss.detach().float().clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def _micro_batches(step: int, rank: int, world: int, accumulate: int):
    tokens, targets = make_batch(step, world * accumulate * ROWS)
    for micro in range(accumulate):
        rows = slice((micro * world + rank) * ROWS, (micro * world + rank + 1) * ROWS)
        yield tokens[rows], targets[rows]


def _whole_model_door(rank: int, world: int, strategy: int, accumulate: int, clip: bool, bf16: bool, special: str = ""):
    model = make_model(seed=0, dtype=torch.bfloat16 if bf16 else torch.float32)
    muon, adamw = _optimizers(list(model.named_parameters()))
    hybrid = {}
    if special in ("hsdp", "hfsdp"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard"))
        hybrid = {"device_mesh": mesh, "dp_shard_dim": "dp_shard", "dp_outer_dim": "dp_outer",
                  "outer_dp_sharding_strategy": "optim" if special == "hfsdp" else "no_shard"}
    model, muon = megatron_fsdp.fully_shard(
        model, muon, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, cpu_offload=special == "offload", **hybrid
    )
    adamw = megatron_fsdp.fully_shard_optimizer(adamw, model=model)
    losses = []
    for step in range(STEPS):
        loss = 0
        for tokens, targets in _micro_batches(step, rank, world, accumulate):
            micro_loss = model(tokens, targets) / accumulate
            micro_loss.backward()
            loss = loss + micro_loss.detach()
        losses.append(_global_loss(loss))
        if clip:
            megatron_fsdp.clip_grad_norm_(model, MAX_NORM)
        # Each steps and zeroes in turn, as the one-process loop: Muon's zero_grad must leave
        # AdamW's gradients (optim/grad_release.py).
        for optimizer in (muon, adamw):
            optimizer.step()
            optimizer.zero_grad()
    return model, muon, {name: param.float() for name, param in model.full_parameters().items()}, losses


def _fsdp2_muon_and_adamw(seed: int, mesh=None, **policy):
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_fsdp.fsdp2 import fully_shard

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model(seed=seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model, _optimizers(list(model.named_parameters()))


def _fsdp2_door(rank: int, world: int, accumulate: int, clip: bool, bf16: bool, special: str = ""):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # HSDP: replicated over the first dim, sharded over the second.
    if special == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    policy = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if bf16 else {}
    model, optimizers = _fsdp2_muon_and_adamw(0, mesh, **policy)
    losses = []
    for step in range(STEPS):
        loss = 0
        for micro, (tokens, targets) in enumerate(_micro_batches(step, rank, world, accumulate)):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            micro_loss = model(tokens, targets) / accumulate
            micro_loss.backward()
            loss = loss + micro_loss.detach()
        losses.append(_global_loss(loss))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizers[0], {name: param.full_tensor() for name, param in model.named_parameters()}, losses


def _parity(
    rank: int, world: int, door: str, strategy: int, accumulate: int, clip: bool, bf16: bool, special: str, loose: bool
) -> dict[str, float]:
    if door == "whole-model":
        _, _, params, losses = _whole_model_door(rank, world, strategy, accumulate, clip, bf16, special)
    else:
        _, _, params, losses = _fsdp2_door(rank, world, accumulate, clip, bf16, special)
    expected, expected_losses = _single_process(world, accumulate, clip)
    errors = {
        name: _relative_error(params[name], want)
        for name, want in expected.items()
        if not loose or _is_matrix_in_block(name, want)
    }
    for step, (loss, want) in enumerate(zip(losses, expected_losses)):
        errors[f"loss at step {step}"] = abs(loss - want) / abs(want)
    return errors


# (door, strategy, world, accumulation, clipping, bf16 compute, "offload" / "hsdp" / "")
CASES = [
    ("whole-model", 3, 2, 2, True, False, ""),
    ("whole-model", 1, 2, 1, False, False, ""),
    ("whole-model", 0, 2, 1, False, False, ""),
    ("whole-model", 2, 4, 1, True, False, ""),
    ("whole-model", 3, 2, 1, False, True, ""),
    ("whole-model", 3, 2, 1, False, False, "offload"),
    ("whole-model", 3, 4, 1, False, False, "hfsdp"),
    ("fsdp2", 3, 2, 2, True, False, ""),
    ("fsdp2", 3, 2, 1, False, True, ""),
    ("fsdp2", 3, 4, 1, False, False, "hsdp"),
]


@pytest.mark.parametrize("door, strategy, world, accumulate, clip, bf16, special", CASES)
def test_muon_and_adamw_step_like_one_process(
    door: str, strategy: int, world: int, accumulate: int, clip: bool, bf16: bool, special: str
) -> None:
    loose = bf16 or special in ("hsdp", "hfsdp", "offload")
    rtol = LOOSE_RTOL if loose else FLIP_RTOL
    for rank, errors in enumerate(run_distributed(_parity, world, door, strategy, accumulate, clip, bf16, special, loose)):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= rtol, f"rank {rank}: {worst} differs by {errors[worst]:.2e} relative (allowed {rtol:.0e}); all: {errors}"


def _momentum_round_trip(rank: int, world: int, door: str) -> tuple[dict[str, float], dict[str, int]]:
    """Muon's momentum buffers after training: each held whole by one rank only (its owner), in
    the state dict as pieces of the global shape equal to one process's buffers (and whole, by
    name, in torch's get_optimizer_state_dict with full_state_dict=True), and a fresh Muon
    loaded from the state dict holds them as they were. Returns the errors and the matrices whose
    momentum this rank holds (name -> values)."""
    if door == "whole-model":
        model, muon, _, _ = _whole_model_door(rank, world, 3, 1, False, False)
    else:
        model, muon, _, _ = _fsdp2_door(rank, world, 1, False, False)
    held = {name: param.numel() for name, param in model.named_parameters() if "momentum_buffer" in muon.state.get(param, {})}
    reference = make_model(seed=0)
    reference_muon = _optimizers(list(reference.named_parameters()))[0]
    reference_adamw = _optimizers(list(reference.named_parameters()))[1]
    for step in range(STEPS):
        reference(*make_batch(step, world * ROWS)).backward()
        for optimizer in (reference_muon, reference_adamw):
            optimizer.step()
            optimizer.zero_grad()
    saved = muon.state_dict()
    # torch's helper gathers the pieces into whole tensors keyed by name.
    full = get_optimizer_state_dict(model, muon, options=StateDictOptions(full_state_dict=True))["state"]
    names = [name for name, param in reference.named_parameters() if _is_matrix_in_block(name, param)]
    errors = {}
    for index, entries in reference_muon.state_dict()["state"].items():
        errors[f"full momentum {names[index]}"] = _relative_error(full[names[index]]["momentum_buffer"], entries["momentum_buffer"])
        momentum = saved["state"][index]["momentum_buffer"]
        assert momentum.shape == entries["momentum_buffer"].shape, (index, momentum.shape)
        errors[f"momentum {index}"] = _relative_error(momentum.full_tensor(), entries["momentum_buffer"])
    matrices = [p for n, p in model.named_parameters() if _is_matrix_in_block(n, p)]
    fresh = torch.optim.Muon(matrices, lr=MUON_LR, weight_decay=0.1)
    if door == "whole-model":
        fresh = megatron_fsdp.fully_shard_optimizer(fresh, model=model)
    fresh.load_state_dict(saved)
    for index, entries in fresh.state_dict()["state"].items():
        errors[f"reloaded momentum {index}"] = _relative_error(
            entries["momentum_buffer"].full_tensor(), saved["state"][index]["momentum_buffer"].full_tensor()
        )
    return errors, held


@pytest.mark.parametrize("door", ["whole-model", "fsdp2"])
def test_muon_momentum_lives_on_its_owner_and_round_trips_through_its_state_dict(door: str) -> None:
    """Each matrix's momentum on exactly one rank; the 8 block matrices balance to half of their
    values on each of the 2 ranks (largest Newton-Schulz cost first: qkv, up and down of each
    block, then proj, alternate), so Muon's state per rank is 1/world of the whole as Adam's is."""
    results = run_distributed(_momentum_round_trip, 2, door)
    for rank, (errors, _) in enumerate(results):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= FLIP_RTOL, f"rank {rank}: {worst} differs by {errors[worst]:.2e} relative; all: {errors}"
    held = [set(names) for _, names in results]
    matrices = {name for name, param in make_model(seed=0).named_parameters() if _is_matrix_in_block(name, param)}
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == matrices, held
    values = [sum(names.values()) for _, names in results]
    assert values[0] == values[1], f"momentum values per rank: {values}"
class RowNormalizedSGD(torch.optim.Optimizer):
    """A user's optimizer that needs matrices: each row of the gradient scaled to unit length."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.dim() != 2:
                    raise ValueError(f"RowNormalizedSGD needs matrices, got a gradient of shape {tuple(param.grad.shape)}")
                param.add_(param.grad / param.grad.norm(dim=1, keepdim=True), alpha=-group["lr"])


@megatron_fsdp.whole_tensor_optimizer
class DeclaredRowNormalizedSGD(RowNormalizedSGD):
    """The same optimizer, declared to need whole tensors."""


class RefusesQkv(DeclaredRowNormalizedSGD):
    """Raises on one matrix only, so only the rank that owns it raises in its step."""

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if any(param.shape == (3 * HIDDEN, HIDDEN) for group in self.param_groups for param in group["params"]):
            raise ValueError("RefusesQkv refuses a qkv matrix")
        super().step(closure)


class GlobalNormSGD(torch.optim.Optimizer):
    """A step that couples its tensors: every gradient divided by the norm over all of them, which
    an owner seeing only its own tensors would get wrong; declared with the replicated placement."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad / norm, alpha=-group["lr"])


megatron_fsdp.whole_tensor_optimizer(GlobalNormSGD, placement="replicated")


def _coupled_step(rank: int, world: int) -> float:
    """The largest relative error of the block matrices after two steps against one process."""
    reference = make_model(seed=0)
    model = megatron_fsdp.fully_shard_model(make_model(seed=0), fsdp_unit_modules=[Block])
    optimizers = []
    for net in (reference, model):
        optimizer = GlobalNormSGD([p for n, p in net.named_parameters() if _is_matrix_in_block(n, p)], lr=0.1)
        optimizers.append(optimizer if net is reference else megatron_fsdp.fully_shard_optimizer(optimizer, model=model))
    for step in range(2):  # train_steps' batches, all rows in one process
        reference(*make_batch(step, 2 * world)).backward()
        optimizers[0].step()
        optimizers[0].zero_grad()
    train_steps(model, optimizers[1], rank, world, range(2))
    params = model.full_parameters()
    return max(_relative_error(params[n], p) for n, p in reference.named_parameters() if _is_matrix_in_block(n, p))


def test_a_declared_coupled_optimizer_steps_every_tensor_on_every_rank() -> None:
    """placement="replicated": each rank steps all tensors, so the norm over all of them is the
    one-process norm (fp32, summed in another order: RTOL)."""
    errors = run_distributed(_coupled_step, 2)
    assert max(errors) <= RTOL, errors


def _errors_on_every_rank(rank: int, world: int, door: str, case: str) -> str:
    """The message each rank's step raised, or what it did instead."""
    if door == "whole-model":
        model = make_model(seed=0)
        model = megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Block])
    else:
        from torch.distributed.device_mesh import init_device_mesh

        from megatron_fsdp.fsdp2 import fully_shard

        model = make_model(seed=0)
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    block = dict(model.named_parameters())
    if case == "muon given a vector":
        optimizer = torch.optim.Muon([block["blocks.0.up.weight"]], lr=MUON_LR)
        optimizer.add_param_group({"params": [block["blocks.0.up.bias"]]})
    elif case == "raises on its owner":
        # Two matrices of about the same cost: one owner each at world 2.
        optimizer = RefusesQkv([block["blocks.0.qkv.weight"], block["blocks.0.up.weight"]], lr=0.1)
    else:
        optimizer_class = RowNormalizedSGD if case == "undeclared" else DeclaredRowNormalizedSGD
        optimizer = optimizer_class([block["blocks.0.up.weight"]], lr=0.1)
    if door == "whole-model":
        optimizer = megatron_fsdp.fully_shard_optimizer(optimizer, model=model)
    model(*make_batch(0, ROWS)).backward()
    try:
        optimizer.step()
    except (ValueError, RuntimeError) as error:
        return "\n".join([f"{type(error).__name__}: {error}", *getattr(error, "__notes__", [])])
    dist.barrier()
    return "stepped"


@pytest.mark.parametrize("door", ["whole-model", "fsdp2"])
def test_muon_given_a_vector_raises_torchs_message_on_every_rank(door: str) -> None:
    """torch's check runs inside Muon's step, on the owner only; megatron_fsdp makes it on every
    rank before any collective, with torch's type and text."""
    messages = run_distributed(_errors_on_every_rank, 2, door, "muon given a vector")
    assert messages == ["ValueError: Param gradient must be a 2D matrix"] * 2, messages


def test_a_step_that_raises_on_one_owner_raises_on_every_rank() -> None:
    """The owner of qkv raises its own error; the other rank, whose step passed, learns of it
    before the exchange back and raises too; neither changes its weights. (On FSDP2's door torch
    runs no hook after a step that raised: the other ranks wait until the raising rank's next
    step, state_dict() or forward, or the end of its program, docs/whole_matrix_optimizers.md.)"""
    messages = sorted(run_distributed(_errors_on_every_rank, 2, "whole-model", "raises on its owner"))
    assert messages[0].startswith("RuntimeError: RefusesQkv's step raised on another rank"), messages
    assert messages[1] == "ValueError: RefusesQkv refuses a qkv matrix", messages


def test_an_owner_step_error_that_ends_the_program_reaches_the_other_ranks_on_fsdp2s_door() -> None:
    """The raising rank's program ends on the error; on its way out it joins the others' agreement,
    so they raise ours at once instead of waiting out their collective timeout (a hang here)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.join(tests, "owner_raises_drill.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    log = run.stdout + run.stderr
    assert run.returncode != 0, log[-3000:]
    assert "ValueError: RefusesQkv refuses a qkv matrix" in log, log[-3000:]
    assert "RuntimeError: RefusesQkv's step raised on another rank" in log, log[-3000:]


@pytest.mark.parametrize("door", ["whole-model", "fsdp2"])
def test_an_undeclared_optimizer_that_needs_matrices_fails_on_every_rank(door: str) -> None:
    """Its own error on every rank; the whole-model door's step adds the way out (torch's step
    hooks, FSDP2's door, see no error to add it to)."""
    messages = run_distributed(_errors_on_every_rank, 2, door, "undeclared")
    assert all("needs matrices" in m for m in messages), messages
    if door == "whole-model":
        assert all("megatron_fsdp.whole_tensor_optimizer" in m for m in messages), messages


@pytest.mark.parametrize("door", ["whole-model", "fsdp2"])
def test_a_declared_optimizer_steps_whole_matrices(door: str) -> None:
    assert run_distributed(_errors_on_every_rank, 2, door, "declared") == ["stepped", "stepped"]


def _zero_grad_in_turn(rank: int, world: int) -> dict[str, object]:
    """After a backward: Muon steps and zeroes, then AdamW steps and zeroes, as torch's loop."""
    model = megatron_fsdp.fully_shard_model(make_model(seed=0), fsdp_unit_modules=[Block])
    named = list(model.named_parameters())
    muon, adamw = (megatron_fsdp.fully_shard_optimizer(optimizer, model=model) for optimizer in _optimizers(named))
    tokens, targets = next(_micro_batches(0, rank, world, 1))
    model(tokens, targets).backward()
    adamw_grads = {name: param.grad.full_tensor() for name, param in named if not _is_matrix_in_block(name, param)}
    muon.step()
    muon.zero_grad()
    kept = {name: param.grad is not None and torch.equal(param.grad.full_tensor(), adamw_grads[name]) for name, param in named if name in adamw_grads}
    muon_grads_gone = all(param.grad is None for name, param in named if _is_matrix_in_block(name, param))
    held_after_muon = sum(bucket.grads.main_grad is not None for bucket in model.trainable_buckets())
    adamw.step()
    adamw.zero_grad()
    held_after_both = sum(bucket.grads.main_grad is not None for bucket in model.trainable_buckets())
    return {"kept": kept, "muon_grads_gone": muon_grads_gone, "held_after_muon": held_after_muon, "held_after_both": held_after_both}


def _train_zeroing_only_muon(model, muon, adamw, world: int, rows: slice) -> None:
    """STEPS steps in which only Muon zeroes its gradients: AdamW's accumulate from step to step
    (as torch's would), Muon's start from zero each step."""
    for step in range(STEPS):
        tokens, targets = make_batch(step, world * ROWS)
        model(tokens[rows], targets[rows]).backward()
        muon.step()
        muon.zero_grad()
        adamw.step()


def _only_muon_zeroes(rank: int, world: int, special: str) -> dict[str, torch.Tensor]:
    """_train_zeroing_only_muon sharded (``special``: "" or "hfsdp", where the main gradient spans
    more than the range the optimizer steps)."""
    hybrid = {}
    if special == "hfsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard"))
        hybrid = {"device_mesh": mesh, "dp_shard_dim": "dp_shard", "dp_outer_dim": "dp_outer", "outer_dp_sharding_strategy": "optim"}
    model = megatron_fsdp.fully_shard_model(make_model(seed=0), fsdp_unit_modules=[Block], **hybrid)
    muon, adamw = (megatron_fsdp.fully_shard_optimizer(optimizer, model=model) for optimizer in _optimizers(list(model.named_parameters())))
    _train_zeroing_only_muon(model, muon, adamw, world, slice(rank * ROWS, (rank + 1) * ROWS))
    return {name: param.float() for name, param in model.full_parameters().items()}


@pytest.mark.parametrize("special, world", [("", 2), ("hfsdp", 4)])
def test_gradients_one_optimizer_never_zeroes_accumulate_as_torchs(special: str, world: int) -> None:
    """Muon's zero_grad zeroes its own parameters' gradients in place and keeps AdamW's, which
    then accumulate over the steps as in one process; under HFSDP the main gradient covers the
    whole shard, the optimizer a part of it, and each is zeroed at its own offsets. Held to
    LOOSE_RTOL on Muon's matrices: here the gradients round one bf16 entry differently from one
    process (the module docstring), 4.5e-3 at world 2 (measured); Muon's gradients not zeroed,
    or zeroed at the wrong offsets, are off by whole updates."""
    sharded = run_distributed(_only_muon_zeroes, world, special)[0]
    single = make_model(seed=0)
    _train_zeroing_only_muon(single, *_optimizers(list(single.named_parameters())), world, slice(None))
    errors = {name: _relative_error(sharded[name], want.detach()) for name, want in single.named_parameters() if _is_matrix_in_block(name, want)}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= LOOSE_RTOL, f"{worst} differs by {errors[worst]:.2e} (allowed {LOOSE_RTOL:.0e}); all: {errors}"


def test_one_optimizers_zero_grad_keeps_the_other_optimizers_gradients_until_both_are_zeroed() -> None:
    """torch's zero_grad clears its own parameters only; the main gradients the two optimizers'
    parameters share buckets in are released once both have zeroed (optim/grad_release.py). Before,
    Muon's zero_grad released them all, and AdamW then stepped on no gradients, silently."""
    for rank, result in enumerate(run_distributed(_zero_grad_in_turn, 2)):
        assert all(result["kept"].values()), f"rank {rank}: AdamW's gradients changed by Muon's zero_grad: {result['kept']}"
        assert result["muon_grads_gone"], f"rank {rank}: Muon's parameters still show gradients after its zero_grad"
        assert result["held_after_muon"] > 0, f"rank {rank}: the main gradients were released while AdamW still needed them"
        assert result["held_after_both"] == 0, f"rank {rank}: {result['held_after_both']} buckets still hold main gradients"


GLOBAL_ROWS = 4  # one global batch for every world size below


def _train_rows(model, optimizers, rank: int, world: int, steps: range) -> None:
    for step in steps:
        tokens, targets = make_batch(step, GLOBAL_ROWS)
        rows = slice(rank * GLOBAL_ROWS // world, (rank + 1) * GLOBAL_ROWS // world)
        model(tokens[rows], targets[rows]).backward()
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()


def _sharded_muon_and_adamw(seed: int):
    model = make_model(seed=seed)
    muon, adamw = _optimizers(list(model.named_parameters()))
    model, muon = megatron_fsdp.fully_shard(model, muon, fsdp_unit_modules=[Block])
    return model, [muon, megatron_fsdp.fully_shard_optimizer(adamw, model=model)]


def _checkpoint(model, optimizers) -> dict:
    return {"model": model.state_dict(), "muon": optimizers[0].state_dict(), "adamw": optimizers[1].state_dict()}


def _save_then_train(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    model, optimizers = _sharded_muon_and_adamw(seed=0)
    _train_rows(model, optimizers, rank, world, range(2))
    dcp.save(_checkpoint(model, optimizers), checkpoint_id=path)
    _train_rows(model, optimizers, rank, world, range(2, 4))
    return model.full_parameters()


def _load_then_train(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    model, optimizers = _sharded_muon_and_adamw(seed=7)  # other weights, fresh optimizers
    state = _checkpoint(model, optimizers)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizers[0].load_state_dict(state["muon"])
    optimizers[1].load_state_dict(state["adamw"])
    _train_rows(model, optimizers, rank, world, range(2, 4))
    return model.full_parameters()


def test_muon_resumes_from_a_dcp_checkpoint_at_another_world_size(tmp_path) -> None:
    uninterrupted = run_distributed(_save_then_train, 2, str(tmp_path / "ckpt"))[0]
    resumed = run_distributed(_load_then_train, 4, str(tmp_path / "ckpt"))[0]
    errors = {name: _relative_error(resumed[name], want) for name, want in uninterrupted.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, f"{worst} differs by {errors[worst]:.2e} relative after resuming at world 4; all: {errors}"


def _round_trip_fresh_then_train(rank: int, world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], bool]:
    """Trained without, then with Accelerate's round trip of the fresh optimizers' state dicts
    first; and whether this rank holds nothing of some matrix (a placeholder no load can write)."""
    model, optimizers = _sharded_muon_and_adamw(seed=0)
    _train_rows(model, optimizers, rank, world, range(2))
    plain = model.full_parameters()
    model, optimizers = _sharded_muon_and_adamw(seed=0)
    fresh = optimizers[0].state_dict()
    empty_here = any(entry["momentum_buffer"]._local_tensor.numel() == 0 for entry in fresh["state"].values())
    for optimizer in optimizers:
        optimizer.load_state_dict(optimizer.state_dict())
    _train_rows(model, optimizers, rank, world, range(2))
    return plain, model.full_parameters(), empty_here


def test_a_fresh_round_trip_leaves_no_muon_state_on_any_rank_even_one_holding_nothing_of_a_matrix() -> None:
    """A rank whose piece of a matrix is empty cannot tell from its own placeholder whether a load
    wrote it: it follows its other placeholders (initial_state.py). Were it to keep its entry while
    the others dropped theirs, the owners' exchange at the next step would mismatch."""
    results = run_distributed(_round_trip_fresh_then_train, 4)
    assert any(empty_here for _, _, empty_here in results), "some rank should hold nothing of some matrix at world 4"
    plain, round_tripped, _ = results[0]
    for name, want in plain.items():
        assert torch.equal(round_tripped[name], want), f"{name} changed by the fresh round trip"

def _fsdp2_save_then_train(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    model, optimizers = _fsdp2_muon_and_adamw(seed=0)
    _train_rows(model, optimizers, rank, world, range(2))
    save_with_helpers(model, optimizers, path)
    _train_rows(model, optimizers, rank, world, range(2, 4))
    return {name: param.full_tensor() for name, param in model.named_parameters()}


def _fsdp2_load_then_train(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    model, optimizers = _fsdp2_muon_and_adamw(seed=7)  # other weights, fresh optimizers
    load_with_helpers(model, optimizers, path)
    _train_rows(model, optimizers, rank, world, range(2, 4))
    return {name: param.full_tensor() for name, param in model.named_parameters()}


def test_fsdp2_muon_resumes_through_torchs_state_dict_helpers_at_another_world_size(tmp_path) -> None:
    """Saved at world 4 (other owners, pieces a quarter long) through get_state_dict, loaded at
    world 2 through set_state_dict: the resumed run continues the uninterrupted one."""
    uninterrupted = run_distributed(_fsdp2_save_then_train, 4, str(tmp_path / "ckpt"))[0]
    resumed = run_distributed(_fsdp2_load_then_train, 2, str(tmp_path / "ckpt"))[0]
    errors = {name: _relative_error(resumed[name], want) for name, want in uninterrupted.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, f"{worst} differs by {errors[worst]:.2e} relative after resuming at world 2; all: {errors}"


def test_owners_are_balanced_by_newton_schulz_cost_and_the_same_on_every_call() -> None:
    from megatron_fsdp.engine.params.owner_assignment import assign_owners, step_cost

    shapes = [(60, 20), (20, 20), (52, 20), (20, 52)] * 2 + [(512, 512), (7,)]
    owners = assign_owners(shapes, 4)
    assert owners == assign_owners(list(shapes), 4)
    assert owners[8] not in owners[:8], "the largest matrix should have a rank to itself"
    load = [sum(step_cost(shape) for shape, owner in zip(shapes, owners) if owner == rank) for rank in range(4)]
    small = sorted(load)[:3]
    assert max(small) - min(small) <= step_cost((60, 20)), load


def muon_over_dp_tp(
    rank: int, world: int, door: str, tensor_parallel: bool = True, device_type: str = "cpu", setup: str = "fsdp"
) -> tuple[dict[str, float], list[str]]:
    """Muon and AdamW over a model sharded by ``door`` over a (dp, tp) mesh, its MLPs tensor-parallel
    DTensors (Colwise up, Rowwise down) on dp 2 x tp 2 with ``tensor_parallel``, else sharded over
    all ``world`` ranks; on ``device_type`` ("cuda": tests/gpu/test_muon_nccl.py). ``setup`` (the
    whole-model door, with ``tensor_parallel``; see SETUP_HOLDERS): "fsdp" shards over dp
    (zero_dp_strategy 3), "no_shard" does not (0), "hsdp" is HSDP on the seeds' mesh (dp_outer 2,
    dp_shard 1, cp 1, tp 2), which leaves each tp block whole too. Returns the errors of Muon's
    matrices and of each step's loss against one process on the same global batches (tensor
    parallelism sums the activations and gradients in another order: held to LOOSE_RTOL, as HSDP),
    with Muon's state taken through its state dict and back midway, and the matrices whose
    momentum this rank holds."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    dp_size = 2 if tensor_parallel else world
    model, muon, adamw, mesh = _muon_model_over_dp_tp(world, door, tensor_parallel, device, setup)
    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    for step in range(STEPS):
        tokens, targets = next(_micro_batches(step, dp_rank, dp_size, 1))
        loss = model(tokens.to(device), targets.to(device))
        loss.backward()
        losses.append(_global_loss(loss))
        if step == 1:
            # Through the state dict and back (momentum as pieces of its global shape, gathered
            # to the owners at the next step): a wrong piece moves the matrices by a whole update.
            muon.load_state_dict(muon.state_dict())
        for optimizer in (muon, adamw):
            optimizer.step()
        for optimizer in (muon, adamw):
            optimizer.zero_grad()
    # Global tensors (the whole-model door's full_parameters() gathers over the data-parallel ranks only).
    params = {name: value.full_tensor().cpu() for name, value in model.state_dict().items()}
    expected, expected_losses = _single_process(dp_size, 1, False)
    errors = {name: _relative_error(params[name], want) for name, want in expected.items() if _is_matrix_in_block(name, want)}
    for step, (loss, want) in enumerate(zip(losses, expected_losses)):
        errors[f"loss at step {step}"] = abs(loss - want) / abs(want)
    names = [name for name, param in make_model().named_parameters() if _is_matrix_in_block(name, param)]
    held = [name for name, param in zip(names, muon.param_groups[0]["params"]) if "momentum_buffer" in muon.state.get(param, {})]
    return errors, held


def _muon_model_over_dp_tp(world: int, door: str, tensor_parallel: bool, device: torch.device, setup: str = "fsdp"):
    """muon_over_dp_tp's model, sharded by ``door``, with its Muon and AdamW, and its mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from megatron_fsdp.fsdp2 import fully_shard

    device_type = device.type
    dp_size = 2 if tensor_parallel else world
    if setup == "hsdp":
        mesh = init_device_mesh(device_type, (dp_size, 1, 1, world // dp_size), mesh_dim_names=("dp_outer", "dp_shard", "cp", "tp"))
        mesh[("dp_outer", "dp_shard")]._flatten("dp")
        mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
        hybrid = {"dp_shard_dim": "dp_shard_cp", "dp_outer_dim": "dp_outer",
                  "hybrid_fsdp_group": mesh[("dp_outer", "dp_shard", "cp")]._flatten("hsdp").get_group()}
    else:
        mesh = init_device_mesh(device_type, (dp_size, world // dp_size), mesh_dim_names=("dp", "tp"))
        hybrid = {"dp_shard_dim": "dp"}
    model = make_model(seed=0).to(device)
    if tensor_parallel:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if door == "whole-model":
        muon, adamw = _optimizers(list(model.named_parameters()))
        tp = {"tp_dim": "tp"} if tensor_parallel else {}
        model, muon = megatron_fsdp.fully_shard(
            model, muon, device_mesh=mesh, fsdp_unit_modules=[Block], zero_dp_strategy=0 if setup == "no_shard" else 3, **hybrid, **tp
        )
        adamw = megatron_fsdp.fully_shard_optimizer(adamw, model=model)
    else:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        muon, adamw = _optimizers(list(model.named_parameters()))
    return model, muon, adamw, mesh


# muon_over_dp_tp's setup -> on how many of the 4 ranks (dp 2 x tp 2) a matrix split by tp, and one
# tp leaves whole, is stepped. "fsdp": a tp block is split again over dp, one owner among all 4; a
# whole matrix is split over dp only, one owner in each tp rank's dp group. "no_shard" and "hsdp"
# (dp_shard of one rank) leave each tp block whole on its rank: one owner among the tp ranks of
# each dp replica; a matrix whole on every rank has one owner among all 4 ("no_shard"), or one in
# each dp_outer replica ("hsdp", whose replicas step apart).
SETUP_HOLDERS = {"fsdp": (1, 2), "no_shard": (2, 1), "hsdp": (2, 2)}


def check_muon_over_dp_tp(results: list[tuple[dict[str, float], list[str]]], tensor_parallel: bool, setup: str = "fsdp") -> None:
    """Every rank within LOOSE_RTOL of one process; each matrix stepped (its momentum held) on as
    many ranks as SETUP_HOLDERS says for ``setup`` (on one without ``tensor_parallel``)."""
    for rank, (errors, _) in enumerate(results):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= LOOSE_RTOL, f"rank {rank}: {worst} differs by {errors[worst]:.2e} relative (allowed {LOOSE_RTOL:.0e}); all: {errors}"
    names = [name for name, param in make_model().named_parameters() if _is_matrix_in_block(name, param)]
    holders = {name: sum(name in held for _, held in results) for name in names}
    split_by_tp, whole_on_tp = SETUP_HOLDERS[setup] if tensor_parallel else (1, 1)
    wanted = {name: split_by_tp if any(part in name for part in (".up.", ".down.")) else whole_on_tp for name in names}
    assert holders == wanted, holders


@pytest.mark.parametrize("door, setup", [("whole-model", "fsdp"), ("fsdp2", "fsdp"), ("whole-model", "no_shard"), ("whole-model", "hsdp")])
def test_muon_over_tensor_parallel_matrices_steps_like_one_process(door: str, setup: str) -> None:
    check_muon_over_dp_tp(run_distributed(muon_over_dp_tp, 4, door, True, "cpu", setup), tensor_parallel=True, setup=setup)


def _muon_across_tensor_parallel_sizes(rank: int, world: int, path: str, phase: str, keep_muon_state: bool = True) -> dict[str, torch.Tensor]:
    """"save": STEPS - 1 steps over dp 2 x tp 2, then a DCP checkpoint; "load": the checkpoint
    into the model over dp 4 (no tensor parallelism) and the last step. Both doors' whole-model
    wrapper; the same 2 * ROWS rows a step either way (ROWS a rank at dp 2, ROWS / 2 at dp 4).
    ``keep_muon_state`` False loads the model and AdamW only: the control a lost momentum fails."""
    import torch.distributed.checkpoint as dcp

    tensor_parallel = phase == "save"
    model, muon, adamw, mesh = _muon_model_over_dp_tp(world, "whole-model", tensor_parallel, torch.device("cpu"))
    dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    steps = range(STEPS - 1) if phase == "save" else range(STEPS - 1, STEPS)
    if phase == "load":
        state = {"model": model.state_dict(), "muon": muon.state_dict(), "adamw": adamw.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        if keep_muon_state:
            muon.load_state_dict(state["muon"])
        adamw.load_state_dict(state["adamw"])
    for step in steps:
        tokens, targets = make_batch(step, 2 * ROWS)
        rows = slice(dp_rank * 2 * ROWS // dp_size, (dp_rank + 1) * 2 * ROWS // dp_size)
        model(tokens[rows], targets[rows]).backward()
        for optimizer in (muon, adamw):
            optimizer.step()
            optimizer.zero_grad()
    if phase == "save":
        dcp.save({"model": model.state_dict(), "muon": muon.state_dict(), "adamw": adamw.state_dict()}, checkpoint_id=path)
    return {name: value.full_tensor() for name, value in model.state_dict().items()}


def test_muon_state_saved_over_tensor_parallelism_resumes_without_it(tmp_path) -> None:
    """A checkpoint of dp 2 x tp 2 (Muon's momentum as pieces of TP blocks split again over dp)
    loaded over dp 4: the last step lands where one process's does, within LOOSE_RTOL (tensor
    parallelism's sums, as above); the same load without Muon's state is off by far more."""
    path = str(tmp_path / "ckpt")
    run_distributed(_muon_across_tensor_parallel_sizes, 4, path, "save")
    resumed = run_distributed(_muon_across_tensor_parallel_sizes, 4, path, "load")[0]
    lost = run_distributed(_muon_across_tensor_parallel_sizes, 4, path, "load", False)[0]
    expected, _ = _single_process(2, 1, False)
    errors = {name: _relative_error(resumed[name], want) for name, want in expected.items() if _is_matrix_in_block(name, want)}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= LOOSE_RTOL, f"{worst} differs by {errors[worst]:.2e} after resuming at dp 4; all: {errors}"
    control = max(_relative_error(lost[name], want) for name, want in expected.items() if _is_matrix_in_block(name, want))
    assert control > 2 * LOOSE_RTOL, f"without Muon's state the step should be far off, it is {control:.2e}"


def _matrices_stepped_here(rank: int, world: int, door: str, special: str) -> list[int]:
    """The indices of Muon's matrices whose momentum this rank holds after training."""
    if door == "whole-model":
        _, muon, _, _ = _whole_model_door(rank, world, 3, 1, False, False, special)
    else:
        _, muon, _, _ = _fsdp2_door(rank, world, 1, False, False, special)
    return [index for index, param in enumerate(muon.param_groups[0]["params"]) if "momentum_buffer" in muon.state.get(param, {})]


@pytest.mark.parametrize("door, special, replicas", [("whole-model", "hfsdp", 1), ("fsdp2", "hsdp", 2)])
def test_each_matrix_is_stepped_on_one_rank_of_each_replica(door: str, special: str, replicas: int) -> None:
    """HFSDP splits each matrix over all 4 ranks: one owner among them; HSDP replicates it over
    the outer dim: one owner in each replica, never every rank."""
    held = run_distributed(_matrices_stepped_here, 4, door, special)
    matrices = sum(1 for name, param in make_model().named_parameters() if _is_matrix_in_block(name, param))
    assert sorted(index for indices in held for index in indices) == sorted(list(range(matrices)) * replicas), held


class ReplicatedMuon(torch.optim.Muon):
    """torch's Muon gathered and stepped on every rank: the reference the owners must match."""


megatron_fsdp.whole_tensor_optimizer(ReplicatedMuon, placement="replicated")


def _strided_split_held_whole(rank: int, world: int, muon_class: type) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``muon_class`` on the 2-D weights of megatron-core's tensor-parallel blocks
    (test_megatron_core_tensor_parallel.py: a SwiGLU fc1 split strided, an fc2 split by columns),
    AdamW on the rest, under HSDP over shard groups of one rank (tp 2), where each rank holds its
    tp blocks whole, fc1's in its strided rows' layout. The global parameters after STEPS steps and
    the matrices whose momentum this rank holds."""
    import test_megatron_core_tensor_parallel as mcore_tp

    from megatron_fsdp.integrations.mcore_optimizer_steps import install_piece_steps

    handles = install_piece_steps()  # megatron-core's optimizer steps the faces as pieces
    try:
        adapter = mcore_tp._Adapter(mcore_tp.Layout(outer=2, dp=1, tp=2))
        named = list(adapter.named_parameters())
        matrices = {name for name, param in named if ".blocks." in name and param.dim() == 2}
        muon = muon_class([param for name, param in named if name in matrices], lr=MUON_LR)
        adamw = torch.optim.AdamW([param for name, param in named if name not in matrices], lr=LR)
        for step in range(STEPS):
            tokens, targets = mcore_tp.make_batch(step)
            rows = slice(adapter.dp_rank * mcore_tp.ROWS // adapter.dp, (adapter.dp_rank + 1) * mcore_tp.ROWS // adapter.dp)
            adapter.module(tokens[rows], targets[rows]).backward()
            adapter.module.finish_grad_sync()
            for optimizer in (muon, adamw):
                optimizer.step()
            adapter.module.param_and_grad_buffer.copy_main_weights_to_model_weights()
            adapter.module.zero_grad_buffer()
        params = {name: value.full_tensor() for name, value in adapter.module.state_dict().items()}
        held = [name for name, param in named if name in matrices and "momentum_buffer" in muon.state.get(param, {})]
        return params, held
    finally:
        for handle in handles:
            handle.remove()


def test_a_strided_split_held_whole_is_stepped_on_one_tp_rank_of_each_replica() -> None:
    """megatron-core's strided fc1 and its fc2, each rank's tp block whole (HSDP, dp_shard 1): one
    owner among the tp ranks of each replica, its strided rows sent as their rectangles; the
    weights bit-equal to gathering and stepping every matrix on every rank."""
    owned = run_distributed(_strided_split_held_whole, 4, torch.optim.Muon)
    replicated = run_distributed(_strided_split_held_whole, 4, ReplicatedMuon)
    for rank, ((params, _), (want, _)) in enumerate(zip(owned, replicated)):
        differ = [name for name in want if not torch.equal(params[name], want[name])]
        assert not differ, f"rank {rank}: {differ} differ from the replicated placement's"
    holders = Counter(name for _, held in owned for name in held)
    assert holders == {name: 2 for name in replicated[0][1]}, holders
