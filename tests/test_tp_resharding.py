"""Checkpoints reshard across tensor- and data-parallel sizes: TinyGPT with its MLPs
tensor-parallel (Colwise up, Rowwise down) trained at TP2 x DP2, saved with Adam's moments, and
resumed at TP1 x DP4 (world 4) and TP2 x DP1 (world 2); a DP-only checkpoint (TP1 x DP4) resumed
at TP2 x DP2 and TP2 x DP1. Both doors: the whole-model ``fully_shard`` through
``save_checkpoint``/``load_checkpoint``, FSDP2's per-block ``fsdp2.fully_shard`` through torch's
``get_state_dict``/``set_state_dict`` and ``dcp``.

The yardstick is one process training the unsharded model on the whole global batch for every
step: every layout splits that batch over its DP ranks (the ranks of a TP group see the same
rows), so a resumed run's losses and final weights must be that run's, whatever sizes saved
and loaded. Measured (fp32, relative to each tensor's largest entry): losses within 1.1e-7,
final weights within 6.1e-7 (Adam's division by the root of small second moments magnifies the
last-bit differences of the DP reductions); the bound is 1e-6, while a resume without the Adam
moments is 2e-2 off in the losses and 0.5 in the weights.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp.fsdp2 import fully_shard as fsdp2_fully_shard
from models import Block, make_batch, make_model
from state_dict_io import load_with_helpers, save_with_helpers

GLOBAL_ROWS, STEPS, RESUMED_STEPS, LR = 4, 3, 2, 1e-2
RTOL = 1e-6
DOORS = ("whole_model", "fsdp2")


def _mesh(tp: int) -> DeviceMesh:
    dp = dist.get_world_size() // tp
    if tp == 1:
        return init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _sharded(door: str, mesh: DeviceMesh, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """TinyGPT (its MLPs tensor-parallel where the mesh has a "tp" dim) sharded over "dp" by ``door``."""
    model = make_model(seed=seed)
    tp = "tp" in mesh.mesh_dim_names
    if tp:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if door == "fsdp2":
        for block in model.blocks:
            fsdp2_fully_shard(block, mesh=mesh["dp"])
        fsdp2_fully_shard(model, mesh=mesh["dp"])
        return model, torch.optim.Adam(model.parameters(), lr=LR)
    return megatron_fsdp.fully_shard(
        model, torch.optim.Adam(model.parameters(), lr=LR), device_mesh=mesh, dp_shard_dim="dp",
        tp_dim="tp" if tp else None, fsdp_unit_modules=[Block],
    )  # fmt: skip


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, steps: range) -> dict:
    """Each DP rank on its slice of the global batch; the loss is the global batch's mean."""
    dp = mesh["dp"]
    rows = GLOBAL_ROWS // dp.size()
    start = dp.get_local_rank() * rows
    losses = []
    for step in steps:
        tokens, targets = make_batch(step, GLOBAL_ROWS)
        loss = model(tokens[start : start + rows], targets[start : start + rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().double()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    params = {n: v.full_tensor() if isinstance(v, DTensor) else v.detach() for n, v in model.state_dict().items()}
    return {"losses": losses, "params": params}


def _save(door: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    if door == "whole_model":
        megatron_fsdp.save_checkpoint(path, STEPS, model, optimizer)
        return
    save_with_helpers(model, optimizer, path)


def _resume(door: str, tp: int, path: str) -> dict:
    """A fresh model (other weights, no optimizer state) at ``tp``, loaded from ``path``, trained on."""
    mesh = _mesh(tp)
    model, optimizer = _sharded(door, mesh, seed=1)
    if door == "whole_model":
        assert megatron_fsdp.load_checkpoint(path, model, optimizer) is not None
    else:
        load_with_helpers(model, optimizer, path)
    return _train(model, optimizer, mesh, range(STEPS, STEPS + RESUMED_STEPS))


def _world_4(rank: int, world: int, directory: str) -> dict:
    """Per door: train and save at TP2 x DP2 and at TP1 x DP4, then load each at the other."""
    results = {}
    for door in DOORS:
        for tp in (2, 1):
            mesh = _mesh(tp)
            model, optimizer = _sharded(door, mesh, seed=0)
            results[door, f"saved at tp{tp}"] = _train(model, optimizer, mesh, range(STEPS))
            _save(door, model, optimizer, f"{directory}/{door}_tp{tp}")
        results[door, "tp2 dp2 -> tp1 dp4"] = _resume(door, 1, f"{directory}/{door}_tp2")
        results[door, "tp1 dp4 -> tp2 dp2"] = _resume(door, 2, f"{directory}/{door}_tp1")
    return results


def _world_2(rank: int, world: int, directory: str) -> dict:
    """Per door: both world-4 checkpoints loaded at TP2 x DP1."""
    results = {}
    for door in DOORS:
        results[door, "tp2 dp2 -> tp2 dp1"] = _resume(door, 2, f"{directory}/{door}_tp2")
        results[door, "tp1 dp4 -> tp2 dp1"] = _resume(door, 2, f"{directory}/{door}_tp1")
    return results


@functools.cache
def _reference() -> dict:
    """One process, the unsharded model, the whole global batch, every step."""
    model = make_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS + RESUMED_STEPS):
        loss = model(*make_batch(step, GLOBAL_ROWS))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: v.detach().clone() for n, v in model.state_dict().items()}}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _errors(result: dict, resumed: bool) -> dict[str, float]:
    """Largest relative differences from the reference: the losses, and (resumed runs, which
    end with it) the final parameters."""
    reference = _reference()
    steps = slice(STEPS, STEPS + RESUMED_STEPS) if resumed else slice(0, STEPS)
    errors = {"losses": _relative(torch.tensor(result["losses"]), torch.tensor(reference["losses"][steps]))}
    if resumed:
        assert result["params"].keys() == reference["params"].keys()
        errors["params"] = max(_relative(result["params"][n], p) for n, p in reference["params"].items())
    return errors


def test_tp_and_dp_checkpoints_reshard_across_sizes_and_training_continues_as_uninterrupted(tmp_path) -> None:
    directory = str(tmp_path)
    launches = {4: run_distributed(_world_4, 4, directory), 2: run_distributed(_world_2, 2, directory)}
    measured: dict[tuple[str, str], dict[str, float]] = {}
    for per_rank in launches.values():
        for results in per_rank:
            for key, result in results.items():
                errors = _errors(result, resumed="->" in key[1])
                measured[key] = {k: max(v, measured.get(key, {}).get(k, 0.0)) for k, v in errors.items()}
    too_far = {key: errors for key, errors in measured.items() if max(errors.values()) > RTOL}
    assert not too_far, f"relative differences from the single-process run above {RTOL}: {too_far} (all: {measured})"
