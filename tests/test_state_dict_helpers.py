"""torch.distributed.checkpoint.state_dict's optimizer helpers on the objects fully_shard returns,
on 2 gloo ranks: what get_optimizer_state_dict reads (full or sharded, on the device or offloaded)
is the optimizer's state under the original FQNs; set_optimizer_state_dict restores it bit for
bit, so training resumed from it matches an uninterrupted run; checkpoints written by
megatron_fsdp.save_checkpoint and by dcp.save of the helpers' state dicts load either way; and
examples/stateful_checkpoint.py's torchtitan-style Stateful resumes exactly."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import megatron_fsdp
from _dist import run_distributed
from models import Block, make_batch, make_model
from state_dict_io import load_with_helpers, save_with_helpers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


def _shard(strategy: int, seed: int = 0):
    module = make_model(seed=seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    return megatron_fsdp.fully_shard(module, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)


def _train(model, optimizer, rank: int, world: int, steps: range) -> None:
    for step in steps:
        tokens, targets = make_batch(step, 2 * world)
        model(tokens[rank::world], targets[rank::world]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()


def _full_optimizer_state(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """FQN -> state name -> full value, gathered from the optimizer's own DTensor state."""
    names = {face: name for name, face in model.named_parameters()}
    return {
        names[face]: {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in optimizer.state[face].items()}
        for group in optimizer.param_groups
        for face in group["params"]
    }


def _clone(tree):
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone(v) for v in tree]
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b


def _optimizer_helpers(rank: int, world: int, strategy: int) -> dict:
    """For each option set: the read equals the optimizer's state; after training on with other
    data, the set restores it; two more steps then give the uninterrupted run's parameters."""
    model, optimizer = _shard(strategy)
    _train(model, optimizer, rank, world, range(2))
    at_step_2 = _full_optimizer_state(model, optimizer)
    _train(model, optimizer, rank, world, range(2, 4))
    uninterrupted = model.full_parameters()
    results = {}
    for full, offload in ((True, False), (True, True), (False, False), (False, True)):
        options = StateDictOptions(full_state_dict=full, cpu_offload=offload)
        load_options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=full and offload)
        model, optimizer = _shard(strategy)
        _train(model, optimizer, rank, world, range(2))
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        read = optimizer_state.get("state", {})  # full and offloaded: only rank 0 holds it
        if full:
            read_right = (offload and rank != 0) or _same(read, at_step_2)
        else:
            read_right = _same({n: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in e.items()} for n, e in read.items()}, at_step_2)
        kept_model, kept_optimizer = _clone(model_state), _clone(optimizer_state)
        _train(model, optimizer, rank, world, range(10, 12))  # moves parameters and state away
        # (Separately: set_state_dict treats an empty model state dict, which ranks other than 0
        # hold here, as "optimizer only" and would skip the model's broadcast on those ranks.)
        set_model_state_dict(model, kept_model, options=load_options)
        set_optimizer_state_dict(model, optimizer, kept_optimizer, options=load_options)
        restored = _same(_full_optimizer_state(model, optimizer), at_step_2)
        _train(model, optimizer, rank, world, range(2, 4))
        resumed = model.full_parameters()
        results[(full, offload)] = (read_right, restored, all(torch.equal(resumed[k], v) for k, v in uninterrupted.items()))
    return results


@pytest.mark.parametrize("strategy", [0, 3])
def test_torch_optimizer_state_dict_helpers_read_restore_and_resume_exactly(strategy) -> None:
    for rank, results in enumerate(run_distributed(_optimizer_helpers, 2, strategy)):
        for (full, offload), (read_right, restored, resumed) in results.items():
            label = f"strategy {strategy} rank {rank} full_state_dict={full} cpu_offload={offload}"
            assert read_right, f"{label}: get_optimizer_state_dict read other values than the optimizer's state"
            assert restored, f"{label}: set_optimizer_state_dict did not restore the optimizer's state"
            assert resumed, f"{label}: training resumed from the restored state left the uninterrupted run"


def _save_one_way_load_the_other(rank: int, world: int, path: str) -> dict:
    """save_checkpoint -> dcp.load of the helpers' state dicts, and dcp.save of those -> load_checkpoint."""
    model, optimizer = _shard(3)
    _train(model, optimizer, rank, world, range(2))
    megatron_fsdp.save_checkpoint(os.path.join(path, "ours"), 2, model, optimizer)
    save_with_helpers(model, optimizer, os.path.join(path, "theirs", "step_00000002"))
    _train(model, optimizer, rank, world, range(2, 4))
    uninterrupted = model.full_parameters()

    resumed = {}
    model, optimizer = _shard(3, seed=5)
    load_with_helpers(model, optimizer, os.path.join(path, "ours", "step_00000002"))
    _train(model, optimizer, rank, world, range(2, 4))
    resumed["saved by save_checkpoint, loaded by the helpers"] = model.full_parameters()

    model, optimizer = _shard(3, seed=5)
    if rank == 0:
        with open(os.path.join(path, "theirs", "latest"), "w") as handle:
            handle.write("2")
    step, _ = megatron_fsdp.load_checkpoint(os.path.join(path, "theirs"), model, optimizer, verify=False)
    _train(model, optimizer, rank, world, range(step, 4))
    resumed["saved by dcp.save of the helpers, loaded by load_checkpoint"] = model.full_parameters()
    return {way: [k for k, v in uninterrupted.items() if not torch.equal(v, params[k])] for way, params in resumed.items()}


def test_checkpoints_of_save_checkpoint_and_of_the_helpers_load_either_way(tmp_path) -> None:
    for rank, result in enumerate(run_distributed(_save_one_way_load_the_other, 2, str(tmp_path))):
        for way, differing in result.items():
            assert differing == [], f"rank {rank}, {way}: these parameters left the uninterrupted run: {differing}"


def _stateful_example(rank: int, world: int, path: str) -> dict:
    from stateful_checkpoint import build, train
    from train_gpt import CORPUS, CharData

    device = torch.device("cpu")
    data = CharData(CORPUS, seq_len=32, seed=0, rank=rank)
    uninterrupted = build(data, device)
    losses = train(uninterrupted, data, range(4), device)
    expected = uninterrupted.model.full_parameters()

    first = build(data, device)
    train(first, data, range(2), device)
    dcp.save({"app": first}, checkpoint_id=path)
    second = build(data, device, seed=9)  # other weights, a fresh optimizer and schedule
    dcp.load({"app": second}, checkpoint_id=path)
    resumed_losses = train(second, data, range(2, 4), device)
    resumed = second.model.full_parameters()
    return {
        "losses": (losses[2:], resumed_losses),
        "lr": (uninterrupted.optimizer.param_groups[0]["lr"], second.optimizer.param_groups[0]["lr"]),
        "differing": [k for k, v in expected.items() if not torch.equal(v, resumed[k])],
    }


def test_the_stateful_example_resumes_exactly(tmp_path) -> None:
    for rank, result in enumerate(run_distributed(_stateful_example, 2, str(tmp_path / "ckpt"))):
        assert result["losses"][0] == result["losses"][1], f"rank {rank}: losses {result['losses']}"
        assert result["lr"][0] == result["lr"][1], f"rank {rank}: the LR schedule did not resume: {result['lr']}"
        assert result["differing"] == [], f"rank {rank}: parameters differ: {result['differing']}"


def _bad_gradient(rank: int, world: int) -> str:
    model, optimizer = _shard(3)
    _train(model, optimizer, rank, world, range(1))
    name, face = next(model.named_parameters())
    face.grad = torch.zeros(face.shape)  # a full plain tensor, not this rank's piece
    try:
        optimizer.step()
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_gradient_that_is_not_laid_out_like_its_parameter_is_refused_on_every_rank() -> None:
    errors = run_distributed(_bad_gradient, 2)
    assert errors[0] == errors[1] and "is not a DTensor laid out like the parameter" in errors[0], errors
