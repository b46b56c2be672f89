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
2-D (dp, tp) mesh with FSDP2's placements (``_StridedShard`` where both split dim 0), so a DCP
checkpoint of model and AdamW state (torch's ``get_state_dict``) saved by either resumes in the
other, the next steps as the uninterrupted run's; ``copy.deepcopy`` of those state dicts (as
PyTorch's 2-D composability tests take them) gives FSDP2's values and placements, bit for bit.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from _dist import run_distributed
from models import FFN, HIDDEN, make_batch, make_model
from state_dict_io import load_with_helpers, save_with_helpers
from megatron_fsdp.fsdp2 import fully_shard

WORLD, DP, TP = 4, 2, 2
STEPS, RESUMED_STEPS, ROWS, LR = 4, 2, 2, 1e-2
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


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, dp_rank: int, steps: range) -> dict:
    """Losses, the first step's full gradients and the full parameters after the steps; the
    ranks of a TP group see the same rows, as TP requires."""
    losses, grads = [], {}
    for step in steps:
        tokens, targets = make_batch(step * DP + dp_rank, ROWS)
        loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.detach())
        if not grads:
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
    return {
        name: (tuple(value.device_mesh.mesh_dim_names), tuple(value.placements), tuple(value.shape))
        for name, value in model.state_dict().items()
    }


def _sharded_with_optimizer(shard, mesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _shard(shard, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    save_with_helpers(model, optimizer, path)


def _resume(shard, mesh, path: str, dp_rank: int) -> dict:
    """A model and AdamW sharded by ``shard``, loaded from the DCP checkpoint at ``path`` (model
    and optimizer state, through torch's get_/set_state_dict), then trained on."""
    model, optimizer = _sharded_with_optimizer(shard, mesh)
    load_with_helpers(model, optimizer, path)
    return _steps(model, optimizer, dp_rank, range(STEPS, STEPS + RESUMED_STEPS))


def _runs(rank: int, world: int, directory: str) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    runs = {"ours": _sharded_with_optimizer(fully_shard, mesh), "torch": _sharded_with_optimizer(torch_fully_shard, mesh)}
    placements = {name: _face_placements(model) for name, (model, _) in runs.items()}
    trained = {name: _steps(model, optimizer, dp_rank, range(STEPS)) for name, (model, optimizer) in runs.items()}
    problems = _differences(trained["ours"], trained["torch"])
    continued = {}
    for name, (model, optimizer) in runs.items():
        _save(model, optimizer, f"{directory}/{name}")
        continued[name] = _steps(model, optimizer, dp_rank, range(STEPS, STEPS + RESUMED_STEPS))
    # Each implementation's checkpoint resumed by the other: the steps after it as if uninterrupted.
    for saver, loader in (("ours", torch_fully_shard), ("torch", fully_shard)):
        resumed = _resume(loader, mesh, f"{directory}/{saver}", dp_rank)
        problems += [f"{saver}'s checkpoint resumed by the other: {p}" for p in _differences(resumed, continued[saver])]
    errors = {
        what: max(_relative_error(trained["ours"][what][n], t) for n, t in trained["torch"][what].items())
        for what in ("grads", "params")
    }
    errors["losses"] = _relative_error(trained["ours"]["losses"], trained["torch"]["losses"])
    lone = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("all",))  # every rank: it makes a group
    refusals = _refusals(mesh, lone) if rank in (0, WORLD - 1) else None
    return {"problems": problems, "errors": errors, "placements": placements, "refusals": refusals}


def _refusals(mesh, lone) -> dict[str, str]:
    """What cannot work: the message of each call's error (called on two ranks only, so a check
    that ran a collective would hang)."""
    messages = {}

    def tp_linear(placement) -> torch.nn.Module:
        module = torch.nn.Linear(4, 4)
        local = torch.zeros(2, 4) if placement.is_shard() else torch.zeros(4, 4)
        weight = DTensor.from_local(local, mesh["tp"], [placement], run_check=False, shape=(4, 4), stride=(4, 1))
        module.weight = torch.nn.Parameter(weight)
        return module

    calls = {
        "partial": lambda: fully_shard(tp_linear(Partial()), mesh=mesh["dp"]),
        "no mesh": lambda: fully_shard(tp_linear(Shard(0))),
        "other mesh": lambda: fully_shard(tp_linear(Replicate()), mesh=lone),
    }
    for what, call in calls.items():
        try:
            call()
            messages[what] = "not refused"
        except (ValueError, NotImplementedError) as error:
            messages[what] = str(error)
    return messages


def test_fsdp2_door_with_tensor_parallel_equals_torch_fsdp2_tp_and_checkpoints_resume_across(tmp_path):
    results = run_distributed(_runs, WORLD, str(tmp_path), timeout=300)
    for rank, result in enumerate(results):
        assert not result["problems"], f"rank {rank}: " + "; ".join(result["problems"]) + f" ({result['errors']})"
        ours, theirs = result["placements"]["ours"], result["placements"]["torch"]
        assert ours == theirs, f"rank {rank}: state-dict placements differ: {ours} vs {theirs}"
        assert ours["blocks.0.up.weight"] == (("dp", "tp"), (_StridedShard(0, split_factor=TP), Shard(0)), (FFN, HIDDEN))
    messages = results[0]["refusals"]
    assert results[-1]["refusals"] == messages, "ranks refused differently"
    assert "Shard(d) or Replicate()" in messages["partial"], messages["partial"]
    assert "mesh=" in messages["no mesh"], messages["no mesh"]
    assert "not other dims" in messages["other mesh"], messages["other mesh"]


def _tensors(state: dict, prefix: str = "") -> dict[str, tuple]:
    """Every tensor of a (nested) state dict: its placements and full value."""
    found = {}
    for key, value in state.items():
        if isinstance(value, dict):
            found.update(_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            placements = tuple(value.placements) if isinstance(value, DTensor) else None
            found[f"{prefix}{key}"] = (placements, _full(value).clone())
    return found


def _deep_copies(rank: int, world: int) -> dict:
    """Deep copies of each implementation's model and AdamW state dicts after a step, read after
    one more step of the originals (which a copy sharing their storage would follow)."""
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    copies = {}
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        model, optimizer = _sharded_with_optimizer(shard, mesh)
        _steps(model, optimizer, dp_rank, range(1))
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        copied = copy.deepcopy(state)
        at_copy = _tensors(state)
        _steps(model, optimizer, dp_rank, range(1, 2))
        copies[name] = {"copy": _tensors(copied), "at_copy": at_copy}
    return copies


def test_deep_copied_tp_state_dicts_equal_torch_fsdp2s_bit_for_bit():
    for rank, copies in enumerate(run_distributed(_deep_copies, WORLD, timeout=300)):
        ours, theirs = copies["ours"]["copy"], copies["torch"]["copy"]
        assert ours.keys() == theirs.keys(), f"rank {rank}: keys differ: {sorted(ours.keys() ^ theirs.keys())}"
        for key, (placements, value) in theirs.items():
            assert ours[key][0] == placements, f"rank {rank}: {key} placements {ours[key][0]} vs {placements}"
            error = (ours[key][1] - value).abs().max().item() if value.numel() else 0.0
            assert torch.equal(ours[key][1], value), f"rank {rank}: {key} differs from FSDP2's by {error:.2e}"
            # The copy kept the values of its moment, though its source stepped on.
            assert torch.equal(ours[key][1], copies["ours"]["at_copy"][key][1]), f"rank {rank}: {key} followed its source"
