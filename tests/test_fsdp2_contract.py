"""What an FSDP2 program relies on besides the training values (tests/test_fsdp2_parity.py has
those): the module comes back sharded in place as torch's ``FSDPModule``; ``unshard``/``reshard``;
no reduce-scatter while gradient sync is off; state dicts through torch's helpers and DCP, and
checkpoints (model and optimizer) that FSDP2 loads and that load from FSDP2's, resuming exactly;
errors, raised before any collective, for what megatron_fsdp.fsdp2 cannot honour. gloo world 2.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from _dist import run_distributed
from models import make_batch, make_model


def _sharded_model(fully_shard):
    model = make_model(seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _full_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.full_tensor() for name, param in model.named_parameters()}


def _reduce_scatters(run) -> int:
    """How many reduce-scatter collectives ``run()`` launched, as torch's profiler records them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return sum(1 for event in profile.events() if "reduce_scatter" in event.name)


def _contract(rank: int, world: int) -> dict:
    from megatron_fsdp.fsdp2 import fully_shard

    plain = make_model(seed=0)
    model = make_model(seed=0)
    block = model.blocks[0]
    returned = fully_shard(block)
    fully_shard(model.blocks[1])
    fully_shard(model)
    found = {
        "same object": returned is block,
        "FSDPModule": all(isinstance(m, FSDPModule) for m in (model, *model.blocks)),
        "class name": type(model).__name__,
        "DTensor parameters": all(isinstance(p, DTensor) for p in model.parameters()),
    }
    # unshard/reshard: the block's attributes hold its full plain weights, then the pieces again.
    block.unshard()
    found["unsharded equal"] = all(
        not isinstance(p, DTensor) and torch.equal(p, dict(plain.blocks[0].named_parameters())[n])
        for n, p in block.named_parameters()
    )
    block.reshard()
    handle = block.unshard(async_op=True)
    handle.wait()
    found["async unsharded"] = not isinstance(block.qkv.weight, DTensor) and block.qkv.weight.shape == plain.blocks[0].qkv.weight.shape
    block.reshard()
    found["resharded"] = isinstance(block.qkv.weight, DTensor)

    # No reduce-scatter while gradient sync is off; the synchronising backward reduces.
    def micro_batch(index: int) -> None:
        tokens, targets = make_batch(index * world + rank, 2)
        model(tokens, targets).backward()

    model.set_requires_gradient_sync(False)
    found["reduce-scatters without sync"] = _reduce_scatters(lambda: micro_batch(0))
    found["grad while accumulating"] = model.blocks[0].qkv.weight.grad
    model.set_requires_gradient_sync(True)
    found["reduce-scatters with sync"] = _reduce_scatters(lambda: micro_batch(1))

    # State dicts: torch's helpers (full and sharded) and a DCP save / load round trip.
    saved = _full_values(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    found["full state dict"] = all(torch.equal(full[n], v) for n, v in saved.items())
    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory)
    dcp.save(get_model_state_dict(model), checkpoint_id=directory[0])
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    loaded = get_model_state_dict(model)
    dcp.load(loaded, checkpoint_id=directory[0])
    set_model_state_dict(model, loaded)
    found["DCP round trip"] = all(torch.equal(v, saved[n]) for n, v in _full_values(model).items())
    # A plain (single-process) model's full state dict loads into the pieces; forward uses it.
    set_model_state_dict(model, plain.state_dict(), options=StateDictOptions(full_state_dict=True))
    tokens, targets = make_batch(7, 2)
    found["full load"] = torch.allclose(model(tokens, targets), plain(tokens, targets), rtol=1e-6, atol=0)
    return found


def test_module_is_sharded_in_place_with_fsdp2_methods_and_state_dicts() -> None:
    for rank, found in enumerate(run_distributed(_contract, 2)):
        assert found["same object"] and found["FSDPModule"] and found["DTensor parameters"], (rank, found)
        assert found["class name"] == "FSDPTinyGPT"
        assert found["unsharded equal"] and found["async unsharded"] and found["resharded"], (rank, found)
        assert found["reduce-scatters without sync"] == 0 and found["grad while accumulating"] is None, (rank, found)
        assert found["reduce-scatters with sync"] > 0, (rank, found)
        for what in ("full state dict", "DCP round trip", "full load"):
            assert found[what], (rank, what)


def _train_steps(model, optimizer, rank: int, world: int, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        tokens, targets = make_batch(step * world + rank, 2)
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _checkpoints_cross_load(rank: int, world: int) -> dict[str, tuple[list[float], list[float]]]:
    """Model and AdamW state saved with DCP by one implementation after 2 steps, loaded by the
    other: the next 2 steps' losses, continued and resumed."""
    from megatron_fsdp.fsdp2 import fully_shard

    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory)
    found = {}
    for saver, loader, name in ((torch_fully_shard, fully_shard, "FSDP2 -> ours"), (fully_shard, torch_fully_shard, "ours -> FSDP2")):
        model = _sharded_model(saver)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train_steps(model, optimizer, rank, world, 0, 2)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        path = f"{directory[0]}/{name.split()[0]}"
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
        continued = _train_steps(model, optimizer, rank, world, 2, 2)
        resumed_model = _sharded_model(loader)
        resumed_optimizer = torch.optim.AdamW(resumed_model.parameters(), lr=1e-2)
        model_state, optimizer_state = get_state_dict(resumed_model, resumed_optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(resumed_model, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        found[name] = (continued, _train_steps(resumed_model, resumed_optimizer, rank, world, 2, 2))
    # Full (unsharded) state dicts, as a single-process tool writes them: torch cuts rows of them
    # for the optimizer's state, which the first step turns into this rank's pieces.
    model = _sharded_model(fully_shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_steps(model, optimizer, rank, world, 0, 2)
    full = StateDictOptions(full_state_dict=True)
    # A copy: torch hands out the optimizer's live step counters, which the next steps advance.
    model_state, optimizer_state = copy.deepcopy(get_state_dict(model, optimizer, options=full))
    continued = _train_steps(model, optimizer, rank, world, 2, 2)
    resumed_model = _sharded_model(fully_shard)
    resumed_optimizer = torch.optim.AdamW(resumed_model.parameters(), lr=1e-2)
    set_state_dict(resumed_model, resumed_optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=full)
    found["full state dicts -> ours"] = (continued, _train_steps(resumed_model, resumed_optimizer, rank, world, 2, 2))
    return found


def test_checkpoints_load_across_fsdp2_and_ours_and_from_full_state_dicts() -> None:
    for rank, found in enumerate(run_distributed(_checkpoints_cross_load, 2)):
        for name, (continued, resumed) in found.items():
            assert continued == resumed, f"rank {rank}, {name}: continued {continued}, resumed {resumed}"


def _bad_input_on_one_rank(rank: int, world: int) -> list[str]:
    """Rank 1 makes no call: a check that ran a collective would hang there (the run times out)."""
    from megatron_fsdp import fully_shard_model
    from megatron_fsdp.fsdp2 import fully_shard

    block_class = type(make_model().blocks[0])
    wrapped = fully_shard_model(make_model(), fsdp_unit_modules=[block_class])  # on every rank: a collective
    # Sharded by torch's own fully_shard on every rank (whatever collectives it runs, every rank runs).
    torch_blocks = _blocks_sharded(torch_fully_shard)
    torch_root = torch_fully_shard(make_model())
    messages = []
    if rank == 0:
        calls = [
            lambda: fully_shard(wrapped.module.blocks[0]),
            lambda: fully_shard_model(_blocks_sharded(fully_shard), fsdp_unit_modules=[block_class]),
            lambda: fully_shard(make_model(), mesh=init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("a", "b", "c"))),
            lambda: fully_shard(make_model(), shard_placement_fn=lambda param: Shard(1)),
            lambda: fully_shard(make_model(), reshard_after_forward=2),
            lambda: _blocks_sharded(fully_shard).blocks[0].set_custom_all_gather(None),
            lambda: fully_shard(torch_blocks),  # ours over torch's
            lambda: fully_shard(torch_root),
            lambda: fully_shard(torch_root.blocks[0]),  # ours under torch's
        ]
        for call in calls:
            try:
                call()
                messages.append("no error")
            except (ValueError, TypeError, NotImplementedError) as error:
                messages.append(str(error))
    return messages


def _blocks_sharded(fully_shard) -> torch.nn.Module:
    model = make_model()
    for block in model.blocks:
        fully_shard(block)
    return model


def test_bad_input_raises_before_any_collective() -> None:
    messages = run_distributed(_bad_input_on_one_rank, 2, timeout=120)[0]
    expected = [
        "sharded by megatron_fsdp's whole-model fully_shard",
        "already sharded in place",
        "1-D mesh",
        "Shard(dim=1)",
        "reshard_after_forward=2",
        "set_custom_all_gather() is not supported",
        "fully_shard(TinyGPT): its submodule 'blocks.0' is sharded by torch's own fully_shard",
        "fully_shard(FSDPTinyGPT): it is sharded by torch's own fully_shard",
        "sharded by torch's fully_shard",
    ]
    assert len(messages) == len(expected), messages
    for message, fragment in zip(messages, expected):
        assert fragment in message, f"expected {fragment!r} in {message!r}"


def _reductions(rank: int, world: int) -> dict:
    """Whole-tensor reductions of sharded parameters (ours and torch's), what each reduction over a
    dim of our 2-D weight raised on this rank, then both weights gathered (the ranks still in step)."""
    from megatron_fsdp.fsdp2 import fully_shard

    values, layers = {}, {}
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        layer = layers[name] = torch.nn.Linear(8, 4)
        shard(layer, shard_placement_fn=lambda param: Shard(-1) if param.ndim == 1 else None)
        weight, bias = layer.weight, layer.bias
        whole = {
            "sum": weight.sum(), "norm": weight.norm(), "linalg.norm": torch.linalg.norm(weight),
            "vector_norm": torch.linalg.vector_norm(weight, 3), "bias.sum(0)": bias.sum(0),
            "bias vector_norm(dim=0)": torch.linalg.vector_norm(bias, dim=0),
            # Ours: rank 1's flat range of the bucket holds none of the weight.
            "amax": weight.amax(), "max": weight.max(), "amin": torch.amin(weight), "bias.min": bias.min(),
        }
        values[name] = {key: value.full_tensor() for key, value in whole.items()}
    weight, bias = layers["ours"].weight, layers["ours"].bias
    over_dims = [
        lambda: weight.sum(dim=1), lambda: weight.sum(0), lambda: weight.mean(1), lambda: torch.amax(weight, 1),
        lambda: weight.norm(2, 1), lambda: torch.linalg.norm(weight, dim=1), lambda: torch.linalg.norm(weight, 2),
        lambda: torch.linalg.vector_norm(weight, dim=(0, 1)), lambda: torch.linalg.matrix_norm(weight),
        lambda: weight.max(dim=1), lambda: bias.mean(0),
    ]
    raised = []
    for call in over_dims:
        try:
            call()
            raised.append("no error")
        except Exception as error:  # every rank must raise the same clear error, and no other
            raised.append(f"{type(error).__name__}: {error}")
    weights = {name: layer.weight.full_tensor() for name, layer in layers.items()}
    return {"values": values, "raised": raised, "weights": weights}


def test_reductions_over_dims_raise_on_every_rank_and_whole_ones_match_torch() -> None:
    for rank, found in enumerate(run_distributed(_reductions, 2, timeout=120)):
        for key, want in found["values"]["torch"].items():
            torch.testing.assert_close(found["values"]["ours"][key], want, msg=f"rank {rank}: {key}")
        torch.testing.assert_close(found["weights"]["ours"], found["weights"]["torch"])
        assert len(found["raised"]) == 11
        for message in found["raised"]:
            assert message.startswith("NotImplementedError") and ".full_tensor()" in message, f"rank {rank}: {message}"


def test_every_public_fsdp_module_method_is_megatron_fsdps() -> None:
    """torch's FSDPModule methods reach into FSDP2's own state: each must be overridden."""
    from megatron_fsdp.fsdp2 import MegatronFSDPModule

    public = [name for name, value in vars(FSDPModule).items() if callable(value) and not name.startswith("__")]
    missing = [name for name in public if name not in vars(MegatronFSDPModule)]
    assert not missing, f"FSDPModule methods megatron_fsdp.fsdp2 does not override: {missing}"


@pytest.fixture(autouse=True)
def _no_leftover_group() -> None:
    assert not dist.is_initialized()
