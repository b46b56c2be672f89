"""megatron_fsdp.fsdp2.fully_shard over tensor parallelism, against torch's own FSDP2 + TP: the
same TinyGPT with its MLPs tensor-parallel (``parallelize_module``, Colwise up / Rowwise down) on
the "tp" dim of a 2 x 2 (dp, tp) gloo mesh, each block and the root sharded over the "dp" dim, a
plain AdamW built after sharding, the same data and seed.

Tolerance (fp32, relative to each tensor's largest entry): 1e-5. Both run the same TP forward and
backward on the same full local weights and sum the same two data-parallel gradients; what can
differ is the grouping of those sums (our flat buckets against FSDP2's per-parameter rows), last-bit
rounding that 4 AdamW steps amplify (tests/test_fsdp2_parity.py measures 1e-7 without TP). A
gradient reduced over the TP dim too, or not averaged, is O(1).

Checkpoints: ours shows each TP parameter as FSDP2 does, a DTensor of the full global shape on the
2-D (dp, tp) mesh, so a DCP checkpoint of either loads into the other with equal values.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from _dist import run_distributed
from models import make_batch, make_model
from megatron_fsdp.fsdp2 import fully_shard

WORLD, DP, TP = 4, 2, 2
STEPS, ROWS, LR = 4, 2, 1e-2
RTOL = 1e-5


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _tp_model(mesh) -> torch.nn.Module:
    model = make_model(seed=0)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _shard(shard, mesh) -> torch.nn.Module:
    model = _tp_model(mesh)
    for block in model.blocks:
        shard(block, mesh=mesh["dp"])
    shard(model, mesh=mesh["dp"])
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def _train(model: torch.nn.Module, dp_rank: int) -> dict:
    """Losses, the first step's full gradients and the full parameters after STEPS steps; the
    ranks of a TP group see the same rows, as TP requires."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        tokens, targets = make_batch(step * DP + dp_rank, ROWS)
        loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.detach())
        if step == 0:
            grads = {name: _full(param.grad) for name, param in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    params = {name: _full(param) for name, param in model.named_parameters()}
    return {"losses": torch.stack(losses), "grads": grads, "params": params}


def _differences(ours: dict, theirs: dict) -> list[str]:
    problems = []
    error = _relative_error(ours["losses"], theirs["losses"])
    if error > RTOL:
        problems.append(f"losses differ by {error:.2e}: {ours['losses'].tolist()} vs {theirs['losses'].tolist()}")
    for what in ("grads", "params"):
        for name, want in theirs[what].items():
            error = _relative_error(ours[what][name], want)
            if error > RTOL:
                problems.append(f"{what} {name} differ by {error:.2e}")
    return problems


def _face_placements(model: torch.nn.Module) -> dict[str, tuple]:
    return {name: (tuple(v.device_mesh.mesh_dim_names), tuple(v.placements), tuple(v.shape)) for name, v in model.state_dict().items()}


def _cross_load(save_model: torch.nn.Module, load_model: torch.nn.Module, path: str) -> float:
    """The largest relative difference between a model's values and another's after DCP carried
    them over (the loading model starts from other values: a fresh seed)."""
    dcp.save(save_model.state_dict(), checkpoint_id=path)
    state = load_model.state_dict()
    dcp.load(state, checkpoint_id=path)
    load_model.load_state_dict(state)
    saved = {name: _full(value) for name, value in save_model.state_dict().items()}
    loaded = {name: _full(value) for name, value in load_model.state_dict().items()}
    return max(_relative_error(loaded[name], saved[name]) for name in saved)


def _fresh(shard, mesh) -> torch.nn.Module:
    torch.manual_seed(1)
    model = _shard(shard, mesh)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5).add_(0.25)
    return model


def _runs(rank: int, world: int, directory: str) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    ours_model, theirs_model = _shard(fully_shard, mesh), _shard(torch_fully_shard, mesh)
    placements = {"ours": _face_placements(ours_model), "theirs": _face_placements(theirs_model)}
    ours, theirs = _train(ours_model, dp_rank), _train(theirs_model, dp_rank)
    problems = _differences(ours, theirs)
    errors = {
        "losses": _relative_error(ours["losses"], theirs["losses"]),
        "grads": max(_relative_error(ours["grads"][n], g) for n, g in theirs["grads"].items()),
        "params": max(_relative_error(ours["params"][n], p) for n, p in theirs["params"].items()),
        "ours -> torch": _cross_load(ours_model, _fresh(torch_fully_shard, mesh), f"{directory}/ours"),
        "torch -> ours": _cross_load(theirs_model, _fresh(fully_shard, mesh), f"{directory}/theirs"),
    }
    return {"problems": problems, "errors": errors, "placements": placements, "refusals": _refusals(mesh)}


def _refusals(mesh) -> dict[str, str]:
    """What cannot work raises before any collective (so one rank's message is every rank's)."""
    messages = {}

    def refused(what: str, build) -> None:
        try:
            build()
        except (ValueError, NotImplementedError) as error:
            messages[what] = str(error)
        else:
            messages[what] = "not refused"

    def partial_placement() -> None:
        module = torch.nn.Linear(4, 4)
        module.weight = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh["tp"], [Partial()], run_check=False))
        fully_shard(module, mesh=mesh["dp"])

    def no_mesh() -> None:
        module = torch.nn.Linear(4, 4)
        module.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh["tp"], [Shard(0)]))
        fully_shard(module)

    def other_mesh() -> None:
        lone = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("all",))
        module = torch.nn.Linear(4, 4)
        module.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 4), mesh["tp"], [Replicate()]))
        fully_shard(module, mesh=lone)

    refused("partial", partial_placement)
    refused("no mesh", no_mesh)
    refused("other mesh", other_mesh)
    return messages


@pytest.mark.timeout(300)
def test_fsdp2_door_with_tensor_parallel_equals_torch_fsdp2_tp_and_checkpoints_cross_load(tmp_path):
    results = run_distributed(_runs, WORLD, str(tmp_path))
    for rank, result in enumerate(results):
        assert not result["problems"], f"rank {rank}: " + "; ".join(result["problems"]) + f" ({result['errors']})"
        for direction in ("ours -> torch", "torch -> ours"):
            assert result["errors"][direction] == 0, f"rank {rank}: {direction} {result['errors']}"
        ours, theirs = result["placements"]["ours"], result["placements"]["theirs"]
        assert ours == theirs, f"rank {rank}: state-dict placements differ: {ours} vs {theirs}"
    print("measured against torch FSDP2 + TP:", results[0]["errors"])
    messages = results[0]["refusals"]
    assert all(result["refusals"] == messages for result in results), "ranks refused differently"
    assert "Shard(d) or Replicate()" in messages["partial"], messages["partial"]
    assert "mesh=" in messages["no mesh"], messages["no mesh"]
    assert "not other dims" in messages["other mesh"], messages["other mesh"]
