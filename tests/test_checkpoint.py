"""Checkpointing: DCP round trips that resume bit for bit, resharding across world sizes and
strategies, conversion to a plain torch file, plain-model checkpoints, safe saves that survive
being killed, clear errors for checkpoints of other models, and the safetensors export."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import megatron_fsdp
from _dist import run_distributed
from models import Block, make_batch, make_model


def _shard(model, strategy, lr=1e-2):
    return megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters(), lr=lr), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)


def _train(model, optimizer, rank, world, steps):
    for step in steps:
        tokens, targets = make_batch(step, 2 * world)
        model(tokens[rank::world], targets[rank::world]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _resume(rank: int, world: int, path: str, strategy: int, dtype: torch.dtype, use_api: bool) -> dict:
    model, optimizer = _shard(make_model(dtype=dtype), strategy)
    _train(model, optimizer, rank, world, range(3))
    if use_api:
        megatron_fsdp.save_checkpoint(path, 3, model, optimizer, extra_state={"data_step": 3})
    else:
        dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    _train(model, optimizer, rank, world, range(3, 5))
    uninterrupted = model.full_parameters()

    model, optimizer = _shard(make_model(seed=7, dtype=dtype), strategy)  # other weights, fresh optimizer
    if use_api:
        step, extra = megatron_fsdp.load_checkpoint(path, model, optimizer)
        assert (step, extra) == (3, {"data_step": 3})
    else:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    _train(model, optimizer, rank, world, range(3, 5))
    resumed = model.full_parameters()
    return {name: torch.equal(uninterrupted[name], resumed[name]) for name in uninterrupted}


@pytest.mark.parametrize("strategy", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resuming_from_a_checkpoint_matches_an_uninterrupted_run_bit_for_bit(strategy, dtype, tmp_path) -> None:
    use_api = strategy % 2 == 1  # the seed's raw dcp.save/load for 0 and 2, save_checkpoint for 1 and 3
    for equal in run_distributed(_resume, 2, str(tmp_path / "ckpt"), strategy, dtype, use_api):
        assert all(equal.values()), [name for name, same in equal.items() if not same]


def _save_after_training(rank: int, world: int, path: str, strategy: int) -> dict:
    """Saves through torch's state-dict helpers: the optimizer state keyed by FQN."""
    model, optimizer = _shard(make_model(), strategy)
    _train(model, optimizer, rank, world, range(2))
    dcp.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
    return model.full_parameters()


def _load_and_save_again(rank: int, world: int, source: str, target: str, strategy: int) -> dict:
    model, optimizer = _shard(make_model(seed=3), strategy)
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=source)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    dcp.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=target)
    return model.full_parameters()


def _assert_same_tree(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ: {set(a) ^ set(b)}"
        for key in a:
            _assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize(
    "save_world, save_strategy, load_world, load_strategy",
    [(4, "optim_grads_params", 2, "optim"), (2, "optim", 4, "optim_grads_params"), (4, "optim_grads_params", 1, "no_shard"), (2, "no_shard", 4, "optim_grads")],
)
def test_checkpoints_reshard_across_world_sizes_and_strategies(save_world, save_strategy, load_world, load_strategy, tmp_path) -> None:
    saved_params = run_distributed(_save_after_training, save_world, str(tmp_path / "a"), save_strategy)[0]
    loaded_params = run_distributed(_load_and_save_again, load_world, str(tmp_path / "a"), str(tmp_path / "b"), load_strategy)[0]
    for name, value in saved_params.items():
        assert torch.equal(value, loaded_params[name]), f"parameter {name} changed across resharding"
    # Saving again from the resharded run must reproduce the first checkpoint exactly,
    # optimizer state (exp_avg, exp_avg_sq, step, hyper-parameters) included.
    dcp_to_torch_save(str(tmp_path / "a"), str(tmp_path / "a.pt"))
    dcp_to_torch_save(str(tmp_path / "b"), str(tmp_path / "b.pt"))
    _assert_same_tree(torch.load(tmp_path / "a.pt", weights_only=False), torch.load(tmp_path / "b.pt", weights_only=False))


def test_a_checkpoint_converts_to_a_plain_torch_file_holding_the_full_tensors(tmp_path) -> None:
    params = run_distributed(_save_after_training, 2, str(tmp_path / "ckpt"), "optim_grads_params")[0]
    dcp_to_torch_save(str(tmp_path / "ckpt"), str(tmp_path / "plain.pt"))
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    reference = make_model().state_dict()
    assert plain["model"].keys() == reference.keys(), "the original FQNs, tied head included"
    for key, value in plain["model"].items():
        assert value.shape == reference[key].shape, f"{key}: {tuple(value.shape)} is not the original shape"
        source = "embed.weight" if key == "head.weight" else key
        assert torch.equal(value, params[source]), f"{key} differs from the sharded model's parameter"
    assert plain["optimizer"]["state"]["blocks.0.qkv.weight"]["exp_avg"].shape == reference["blocks.0.qkv.weight"].shape


def _plain_save(rank: int, world: int, path: str) -> None:
    dcp.save({"model": make_model(seed=11).state_dict()}, checkpoint_id=path)


def _sharded_load(rank: int, world: int, path: str, strategy: str) -> dict:
    model, _ = _shard(make_model(), strategy)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    return model.full_parameters()


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_a_plain_models_dcp_checkpoint_loads_into_a_sharded_model(strategy, tmp_path) -> None:
    run_distributed(_plain_save, 2, str(tmp_path / "plain"))
    loaded = run_distributed(_sharded_load, 2, str(tmp_path / "plain"), strategy)[0]
    for name, value in make_model(seed=11).named_parameters():
        assert torch.equal(loaded[name], value.detach()), name


def _load_other_model(rank: int, world: int, path: str) -> str:
    other = make_model(layers=2)
    other.pos = torch.nn.Parameter(torch.zeros(5, other.pos.shape[1]))  # another shape
    other.extra = torch.nn.Parameter(torch.zeros(3))  # not in the checkpoint
    model, optimizer = _shard(other, 3)
    try:
        megatron_fsdp.load_checkpoint(path, model, optimizer)
    except RuntimeError as error:
        return str(error)
    return "loaded"


def _save_api(rank: int, world: int, path: str) -> None:
    model, optimizer = _shard(make_model(layers=3), 3)
    megatron_fsdp.save_checkpoint(path, 1, model, optimizer)


def test_loading_a_checkpoint_of_another_model_names_the_keys(tmp_path) -> None:
    run_distributed(_save_api, 2, str(tmp_path))
    for message in run_distributed(_load_other_model, 2, str(tmp_path)):
        assert "mis-shaped: pos (given (9, 20), model (5, 20))" in message, message
        assert "missing: extra" in message, message
        assert "unexpected: blocks.2.norm1.weight" in message, message


def _full_export(rank: int, world: int, path: str) -> dict:
    model, optimizer = _shard(make_model(dtype=torch.bfloat16), 3)
    _train(model, optimizer, rank, world, range(2))
    megatron_fsdp.export_safetensors(model, path)
    full = megatron_fsdp.full_state_dict(model)
    return {"full": full, "params": model.full_parameters()}


def test_full_weights_export_to_safetensors_on_rank_zero(tmp_path) -> None:
    from safetensors.torch import load_file

    path = str(tmp_path / "model.safetensors")
    results = run_distributed(_full_export, 2, path)
    assert results[1]["full"] == {}, "only rank 0 holds the gathered weights"
    exported = load_file(path)
    assert exported.keys() == make_model().state_dict().keys()
    for key, value in exported.items():
        source = "embed.weight" if key == "head.weight" else key
        assert value.dtype == torch.float32, "trainable weights are exported from the fp32 main weights"
        assert torch.equal(value, results[0]["params"][source]), key


SAVE_FOREVER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist, megatron_fsdp
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters()), fsdp_unit_modules=[torch.nn.Linear])
    step = 0
    while True:
        step += 1
        model(torch.randn(4, 256)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        megatron_fsdp.save_checkpoint(sys.argv[1], step, model, optimizer, keep_last=2)
    """
)


def _load_latest(rank: int, world: int, path: str) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters()), fsdp_unit_modules=[torch.nn.Linear])
    step, _ = megatron_fsdp.load_checkpoint(path, model, optimizer)
    assert optimizer.state_dict()["state"][0]["step"].item() == step
    return step


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.13, 0.31])
def test_a_save_killed_midway_leaves_the_last_complete_checkpoint_loadable(delay, tmp_path) -> None:
    from _dist import free_port

    path = str(tmp_path / "ckpt")
    saver = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, path, str(free_port())], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while megatron_fsdp.latest_checkpoint_step(path) is None:
            assert saver.poll() is None and time.monotonic() < deadline, "the saving process never committed a checkpoint"
            time.sleep(0.01)
        time.sleep(delay)
        os.killpg(saver.pid, signal.SIGKILL)
    finally:
        saver.kill()
        saver.wait()
    latest = megatron_fsdp.latest_checkpoint_step(path)
    assert run_distributed(_load_latest, 1, path) == [latest]


class _WithExtraState(torch.nn.Linear):
    """A module with extra state (as Transformer Engine's and megatron-core's modules have)."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.calls = 0

    def get_extra_state(self) -> dict:
        return {"calls": self.calls}

    def set_extra_state(self, state: dict) -> None:
        self.calls = state["calls"]


def test_extra_state_is_saved_and_loaded_through_its_module(single_rank_group) -> None:
    model = megatron_fsdp.fully_shard_model(torch.nn.Sequential(_WithExtraState(), _WithExtraState()), fsdp_unit_modules=[_WithExtraState])
    model.module[1].calls = 7
    state = model.state_dict()
    assert state["1._extra_state"] == {"calls": 7}
    model.module[1].calls = 0
    model.load_state_dict(state)
    assert model.module[1].calls == 7
