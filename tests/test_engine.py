"""Engine behaviour beyond parity: bad input, unit states, memory, inference, no_shard buffers."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp.engine.step.units import UnitState
from models import Block, TinyGPT, make_batch, make_model


def test_fully_shard_without_a_process_group_says_how_to_start_one() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block])


@pytest.mark.parametrize("strategy", ["zero3", 4, -1, True, "OPTIM_GRAD"])
def test_unknown_strategy_is_rejected_with_the_allowed_values(strategy) -> None:
    with pytest.raises(ValueError, match="use 0, 1, 2, 3 or one of no_shard, optim, optim_grads, optim_grads_params"):
        megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)


def test_strategy_names_numbers_and_case_are_equivalent() -> None:
    parse = megatron_fsdp.ShardingStrategy.parse
    assert parse("optim_grads_params") is parse(3) is parse("OPTIM_GRADS_PARAMS")
    assert [parse(i).label for i in range(4)] == ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def test_unit_classes_absent_from_the_model_are_logged_and_skipped(single_rank_group, caplog) -> None:
    """As Megatron-LM calls it: its adapter names MoE and Mamba layers for every GPT."""
    with caplog.at_level(logging.INFO, logger="megatron_fsdp"):
        model = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block, torch.nn.LSTM, torch.nn.GRU])
    assert [u.name for u in model.units] == ["<root>", "blocks.0", "blocks.1"]
    notes = [r.getMessage() for r in caplog.records if "fsdp_unit_modules" in r.getMessage()]
    assert len(notes) == 1 and "torch.nn.modules.rnn.LSTM, torch.nn.modules.rnn.GRU" in notes[0], notes


def test_sharded_weights_with_none_of_the_unit_classes_name_the_models_classes(single_rank_group) -> None:
    with pytest.raises(ValueError, match=r"torch.nn.modules.rnn.LSTM, but the model holds no module of those classes.*Block"):
        megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[torch.nn.LSTM])


def test_unit_import_paths_resolve_and_bad_ones_are_named(single_rank_group) -> None:
    model = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=["models.Block"])
    assert [u.name for u in model.units] == ["<root>", "blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match="'models.NoSuchBlock' cannot be imported"):
        megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=["models.NoSuchBlock"])


def test_sharded_weights_need_units(single_rank_group) -> None:
    with pytest.raises(ValueError, match="needs fsdp_unit_modules"):
        megatron_fsdp.fully_shard_model(make_model(), zero_dp_strategy="optim_grads_params")


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
@pytest.mark.parametrize("units", [None, [], [torch.nn.LSTM]])
def test_without_units_the_whole_model_is_one_unit(strategy, units, single_rank_group) -> None:
    """Megatron-LM passes [] under optim and optim_grads; upstream makes the model one unit."""
    model = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=units, zero_dp_strategy=strategy)
    assert [u.name for u in model.units] == ["<root>"]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in make_model().parameters())


def test_mesh_without_the_named_dim_lists_its_dims(single_rank_group) -> None:
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match=r"no dim named 'dp_shard_cp' \(its dims: \('dp',\)\)"):
        megatron_fsdp.fully_shard_model(make_model(), device_mesh=mesh, dp_shard_dim="dp_shard_cp", fsdp_unit_modules=[Block])
    model = megatron_fsdp.fully_shard_model(make_model(), device_mesh=mesh, dp_shard_dim="dp", fsdp_unit_modules=[Block])
    assert model.dp.size == 1


def test_optimizer_holding_foreign_or_frozen_params_is_rejected(single_rank_group) -> None:
    model = make_model(frozen=True)
    stranger = torch.nn.Parameter(torch.zeros(3, 5))
    trainable = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match=r"shape \(3, 5\) that is not in the sharded model"):
        megatron_fsdp.fully_shard(model, torch.optim.SGD(trainable + [stranger], lr=0.1), fsdp_unit_modules=[Block])
    model = make_model(frozen=True)
    with pytest.raises(ValueError, match="parameter 'blocks.0.norm1.weight', which does not require grad"):
        megatron_fsdp.fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=[Block])


def test_nccl_ub_without_nccl_says_so_once_and_keeps_double_buffers(single_rank_group, caplog) -> None:
    model = make_model()
    with caplog.at_level(logging.INFO, logger="megatron_fsdp"):
        model, optimizer = megatron_fsdp.fully_shard(
            model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=[Block], nccl_ub=True
        )
        tokens, targets = make_batch(0, 2)
        model(tokens, targets).backward()
        optimizer.step()
    fallbacks = [r for r in caplog.records if r.name == "megatron_fsdp.engine.buckets.user_buffers"]
    assert [r.levelno for r in fallbacks] == [logging.WARNING], [r.getMessage() for r in fallbacks]
    assert "falls back to unregistered buffers" in fallbacks[0].getMessage() and "cpu" in fallbacks[0].getMessage()
    assert model.user_buffers is None
    assert model.settings.fsdp_double_buffer and model.pool.double_buffer(), "nccl_ub implies fsdp_double_buffer"


def test_optimizer_is_found_from_its_parameters(single_rank_group) -> None:
    model = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block])
    optimizer = megatron_fsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    first_name, first_face = next(model.named_parameters())
    first_param = model.module.get_parameter(first_name)
    assert model.face_of(first_param) is first_face
    assert optimizer.param_groups[0]["params"][0] is first_face, "the optimizer holds the DTensor faces"
    with pytest.raises(ValueError, match="already passed"):
        megatron_fsdp.fully_shard_optimizer(optimizer, model)


def test_lr_schedulers_drive_the_sharded_optimizer(single_rank_group) -> None:
    model = make_model()
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.SGD(model.parameters(), lr=1.0), fsdp_unit_modules=[Block])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    before = model.full_parameters()["blocks.0.up.bias"].clone()
    for step in range(2):
        model(*make_batch(step, 2)).backward()
        grad = model.full_gradients()["blocks.0.up.bias"] if step == 1 else None
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if step == 0:
            before = model.full_parameters()["blocks.0.up.bias"].clone()
    after = model.full_parameters()["blocks.0.up.bias"]
    torch.testing.assert_close(after, before - 0.5 * grad, rtol=1e-6, atol=1e-7)


def _unit_lifecycle(rank: int, world: int, layers: int) -> dict:
    model = make_model(layers=layers)
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=[Block])
    seen = {}
    block = model.module.blocks[1]

    def record_shape(module, args) -> None:
        seen.setdefault("in_forward", block.up.weight.shape)

    block.register_forward_pre_hook(record_shape)  # runs after the unit's own gathering pre-hook
    tokens, targets = make_batch(0, 2)
    loss = model(tokens, targets)
    states_after_forward = [u.state for u in model.units]
    loss.backward()
    states_after_backward = [u.state for u in model.units]
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        model.eval()
        inference_loss = model(tokens, targets).item()
    return {
        "in_forward": tuple(seen["in_forward"]),
        "after_step": tuple(block.up.weight.shape),
        "forward": states_after_forward,
        "backward": states_after_backward,
        "after_inference": [u.state for u in model.units],
        "in_use": model.pool.bytes_in_use(),
        "high_water": model.pool.high_water_mark(),
        "inference_loss": inference_loss,
        "params": model.full_parameters(),
    }


def test_units_gather_for_use_and_reshard_after_and_the_pool_is_bounded() -> None:
    results = run_distributed(_unit_lifecycle, 2, 4)
    deeper = run_distributed(_unit_lifecycle, 2, 8)
    for r, r_deeper in zip(results, deeper):
        assert r["in_forward"] == (52, 20), "inside its forward a unit's parameters have their full shape"
        assert r["after_step"] == (0,), "outside forward/backward a sharded parameter holds no memory"
        assert r["forward"] == [UnitState.UNSHARDED] + [UnitState.SHARDED] * 4, "only the root stays gathered for backward"
        assert r_deeper["in_use"] == 0
        assert r["backward"] == [UnitState.SHARDED] * 5
        assert r["after_inference"] == [UnitState.SHARDED] * 5
        assert r["in_use"] == 0, "every pooled bucket is returned after the step"
        # The pool holds the root, about two gathered units and the reductions in flight: twice
        # the depth must not need more memory.
        assert r_deeper["high_water"] == r["high_water"], f"peak pool use grew with depth: {r['high_water']} -> {r_deeper['high_water']} B"
    reference = make_model(layers=4)
    missing = reference.load_state_dict(results[0]["params"], strict=False).missing_keys
    assert missing == ["head.weight"], "only the head, tied to the embedding, is not a parameter of its own"
    with torch.no_grad():
        expected = reference.eval()(*make_batch(0, 2)).item()
    assert abs(results[0]["inference_loss"] - expected) <= 1e-5 * abs(expected), "no_grad inference uses the stepped weights"


def _no_shard_buffers(rank: int, world: int) -> dict:
    model = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block], zero_dp_strategy="no_shard")
    optimizer = megatron_fsdp.fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), model)
    buckets = [b for u in model.units for b in u.buckets]
    views_share_buffer = all(
        p.untyped_storage().data_ptr() == b.weights.full.untyped_storage().data_ptr() for b in buckets for p in b.params
    )
    for step in range(2):
        tokens, targets = make_batch(step, 2 * world)
        model(tokens[rank::world], targets[rank::world]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {
        "buffers": [b.weights.full.untyped_storage().nbytes() for b in buckets],
        "views_share_buffer": views_share_buffer,
        "state_dict": {k: v.clone() for k, v in model.module.state_dict().items()},
    }


def test_no_shard_keeps_its_weight_buffer_and_replicas_in_sync() -> None:
    """Seed 001's bug: ``no_shard`` built no weight buffer, breaking checkpoints and parameter
    sync. Here every bucket has one, parameters are views into it, and after steps every rank
    holds the same full weights."""
    results = run_distributed(_no_shard_buffers, 2)
    for r in results:
        assert all(nbytes > 0 for nbytes in r["buffers"])
        assert r["views_share_buffer"]
    expected_shapes = {k: v.shape for k, v in TinyGPT().state_dict().items()}
    assert {k: v.shape for k, v in results[0]["state_dict"].items()} == expected_shapes
    for key, value in results[0]["state_dict"].items():
        assert torch.equal(value, results[1]["state_dict"][key]), f"ranks disagree on {key}"


def _states_seen_by_block_one(rank: int, world: int, overlap: bool) -> list:
    model = make_model(layers=3)
    model, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=[Block], overlap_param_gather=overlap
    )
    seen = []
    units = {u.name: u for u in model.units}
    model.module.blocks[1].register_forward_pre_hook(lambda m, a: seen.append(units["blocks.2"].state))
    for step in range(2):
        model(*make_batch(step, 2)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return seen


def test_the_next_unit_is_prefetched_in_recorded_forward_order() -> None:
    with_prefetch = run_distributed(_states_seen_by_block_one, 2, True)[0]
    without = run_distributed(_states_seen_by_block_one, 2, False)[0]
    # Step 1 records the order; in step 2 block 2's gather is already launched while block 1 runs.
    assert with_prefetch[0] is UnitState.SHARDED and with_prefetch[1] is not UnitState.SHARDED, with_prefetch
    assert without == [UnitState.SHARDED, UnitState.SHARDED]


def _collected_after_use(rank: int, world: int) -> bool:
    import gc
    import weakref

    model = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block])
    optimizer = megatron_fsdp.fully_shard_optimizer(torch.optim.Adam(model.parameters()), model)
    model(*make_batch(0, 2)).backward()
    optimizer.step()
    alive = weakref.ref(model)
    del model, optimizer
    gc.collect()
    return alive() is None


def test_a_sharded_model_is_freed_once_unused() -> None:
    """Parameter hooks live in C++, out of the garbage collector's sight: they must not keep
    the model (and all its buffers) alive."""
    assert run_distributed(_collected_after_use, 2) == [True, True]


def test_zero_grad_releases_main_grads_until_the_next_reduction(single_rank_group) -> None:
    model = make_model()
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters(), lr=0.1), fsdp_unit_modules=[Block])
    buckets = [b for unit in model.units for b in unit.trainable_buckets]
    assert all(b.grads.main_grad is None for b in buckets), "main grads exist before any backward"
    model(*make_batch(0, 2)).backward()
    grads = model.full_gradients()
    assert all(b.grads.main_grad is not None for b in buckets)
    optimizer.zero_grad(set_to_none=False)  # kept, zeroed
    assert all(b.grads.main_grad is not None and not b.grads.main_grad.any() for b in buckets)
    model(*make_batch(0, 2)).backward()
    for name, grad in model.full_gradients().items():
        torch.testing.assert_close(grad, grads[name], rtol=0, atol=0)
    optimizer.step()
    optimizer.zero_grad()  # set_to_none=True: released, as torch's own .grad
    assert all(b.grads.main_grad is None for b in buckets)
    # A step without gradients leaves every parameter alone, as torch's optimizers do for
    # parameters whose .grad is None (zero gradients would still move Adam's state).
    before = model.full_parameters()
    optimizer.step()
    for name, value in model.full_parameters().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_the_root_unit_has_one_bucket_per_module(single_rank_group) -> None:
    model = megatron_fsdp.fully_shard_model(make_model(tie=False), fsdp_unit_modules=[Block])
    # The head's gradients arrive first in backward, the embedding's last: separate buckets let
    # the head's reduce (and its buffer return to the pool) without waiting for the embedding.
    assert sorted(tuple(b.names) for b in model.root_unit.buckets) == sorted(
        [("embed.weight",), ("pos",), ("norm.weight", "norm.bias"), ("head.weight",)]
    )
    assert [len(u.buckets) for u in model.units[1:]] == [1, 1], "block units keep one bucket per dtype"


def test_root_buckets_give_their_weights_back_once_their_gradients_are_in(single_rank_group) -> None:
    """The root unit stays gathered into backward; each of its buckets goes back as soon as its
    gradients are in (the head's early, before the embedding's main gradient is created at the
    end of backward, where memory peaks) and the next forward gathers it again."""
    model = megatron_fsdp.fully_shard_model(make_model(tie=False), fsdp_unit_modules=[Block])
    head, embed = model.module.head.weight, model.module.embed.weight
    seen = {}

    def look(grad: torch.Tensor) -> None:  # backward between the blocks and the embedding
        seen["head"], seen["embed"] = head.numel(), embed.numel()

    def watch(module: torch.nn.Module, args: tuple) -> None:
        args[0].register_hook(look)

    model.module.blocks[0].register_forward_pre_hook(watch)
    batch = make_batch(0, 2)
    loss = model(*batch)
    assert head.numel() > 0 and embed.numel() > 0, "the root unit is gathered after forward"
    loss.backward()
    assert seen["head"] == 0, "the head's weights were still gathered after its gradients were in"
    assert seen["embed"] > 0, "the embedding's weights went back before its gradient arrived"
    assert head.numel() == 0 and embed.numel() == 0, "the root unit is resharded after backward"
    torch.testing.assert_close(model(*batch), loss, rtol=0, atol=0)
