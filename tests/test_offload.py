"""CPU offloading (``cpu_offload=True``, docs/offloading.md) on gloo: the same training as a
single process for every strategy with accumulation, clipping either way and a bf16 model;
checkpoints that move between offloaded and device-resident runs (and across world sizes)
restoring every value bit for bit; the host step through the C++ op for Adam/AdamW/SGD with
param groups and an LR scheduler, writing the new compute weights as it steps, and torch's own
step (logged once) for anything else.

On a CPU device the transfers are synchronous copies through the same code as on a GPU, where
they run on a side stream (tests/gpu/ and benchmarks/step_time.py --offload cover those).
Tolerance: fp32 1e-5 as tests/test_parity.py (only the order of fp32 sums differs).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp.engine.buckets.offload import HostBuffers
from megatron_fsdp.optim.kernel_step import unsupported_reason
from models import Block, make_batch, make_model, train_steps
from parity import Setup, check_collectives, compare, compare_low_precision, reference_run, sharded_runs

FP32_RTOL = 1e-5
HOST_OP = unsupported_reason(torch.optim.Adam([torch.zeros(1, requires_grad=True)])) is None

SETUPS = {
    **{f"s{strategy}": Setup(strategy=strategy, accum=2, offload=True, steps=3, count_collectives=True) for strategy in range(4)},
    "clip-torch-s3": Setup(strategy=3, accum=2, clip="torch", offload=True, steps=3),
    "clip-fused-s1": Setup(strategy=1, accum=2, clip="fused", offload=True, steps=3),
    # Reduced gradients reach the host each micro-batch, which adds them up; 0/1 hold theirs
    # back on the device until the sync.
    "deferred-sync-s2": Setup(strategy=2, accum=3, sync_each_microbatch=False, offload=True, steps=3, count_collectives=True),
    "no-sync-s1": Setup(strategy=1, accum=3, no_sync_until_last=True, offload=True, steps=3, count_collectives=True),
    "adamw-s3": Setup(strategy=3, optimizer="adamw_foreach", offload=True, steps=3),
    "sgd-s0": Setup(strategy=0, accum=2, optimizer="sgd", offload=True, steps=3),
    "bf16-s3": Setup(strategy=3, accum=2, dtype=torch.bfloat16, optimizer="sgd", offload=True, steps=3),
    # HSDP: gradients reach the host after the dp_outer average; HFSDP: the host steps 1/outer.
    "hsdp-s3": Setup(strategy=3, accum=2, hsdp=(2, 1), offload=True, steps=3),
    "hfsdp-s3": Setup(strategy=3, accum=2, hsdp=(2, 1), outer_strategy="optim", offload=True, steps=3),
}


@functools.cache
def _results() -> dict:
    names = list(SETUPS)
    return dict(zip(names, run_distributed(sharded_runs, 2, [SETUPS[n] for n in names], timeout=600)[0]))


@pytest.mark.parametrize("name", list(SETUPS))
def test_offloaded_training_matches_single_process(name: str) -> None:
    setup = SETUPS[name]
    got, reference = _results()[name], reference_run(setup, 2)
    if setup.dtype == torch.float32:
        compare(got, reference, FP32_RTOL, FP32_RTOL, FP32_RTOL, name)
    else:
        compare_low_precision(got, reference, reference_run(setup, 2, compute_dtype=torch.float32), name)


@pytest.mark.parametrize("name", [name for name, setup in SETUPS.items() if setup.count_collectives])
def test_offloaded_accumulation_launches_the_reductions_the_table_names(name: str) -> None:
    check_collectives(_results()[name], SETUPS[name], name)


def _shard(offload: bool, strategy: int | str = 3, seed: int = 0):
    model = make_model(seed=seed)
    return megatron_fsdp.fully_shard(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        cpu_offload=offload,
    )


def _everything(model, optimizer) -> dict:
    """Full parameters and full optimizer state (a collective)."""
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    flat = {f"param/{n}": p for n, p in model.full_parameters().items()}
    for fqn, entries in state["state"].items():
        # Copies: the step count is a tensor the next step increments in place.
        flat.update({f"state/{fqn}/{key}": value.clone() for key, value in entries.items()})
    return flat


def _unequal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return [key for key in a if not torch.equal(a[key], b[key])]


def _max_relative_gap(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in a if b[k].numel())


def _save_and_resume(rank: int, world: int, path: str, save_offload: bool, load_offload: bool) -> dict:
    model, optimizer = _shard(save_offload)
    train_steps(model, optimizer, rank, world, range(3))
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    saved = _everything(model, optimizer)
    train_steps(model, optimizer, rank, world, range(3, 5))
    uninterrupted = _everything(model, optimizer)

    model, optimizer = _shard(load_offload, seed=7)  # other weights, a fresh optimizer
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loaded = _everything(model, optimizer)
    train_steps(model, optimizer, rank, world, range(3, 5))
    resumed = _everything(model, optimizer)
    return {
        "not restored": _unequal(loaded, saved),
        "diverged": _unequal(resumed, uninterrupted),
        "gap": _max_relative_gap(resumed, uninterrupted),
        "saved": saved,
    }


DIRECTIONS = [(True, False), (False, True), (True, True)]


def _resume_every_way(rank: int, world: int, root: str) -> list[dict]:
    return [_save_and_resume(rank, world, f"{root}/{save}-{load}", save, load) for save, load in DIRECTIONS]


@functools.cache
def _resumed(root: str) -> dict:
    return dict(zip(DIRECTIONS, run_distributed(_resume_every_way, 2, root)[0]))


@pytest.mark.parametrize("save_offload, load_offload", DIRECTIONS)
def test_checkpoints_move_between_offloaded_and_device_runs_bit_for_bit(save_offload, load_offload, tmp_path_factory) -> None:
    result = _resumed(str(tmp_path_factory.getbasetemp() / "resume"))[(save_offload, load_offload)]
    assert not result["not restored"], f"loaded values differ from the saved ones: {result['not restored']}"
    if save_offload == load_offload or not HOST_OP:
        # The same step arithmetic on both sides: the resumed run is the uninterrupted one.
        assert not result["diverged"], f"the resumed run diverged: {result['diverged']}"
    else:
        # The host op and torch's CPU Adam differ by a few fp32 ulps (torch's sqrt is MKL's).
        assert result["gap"] <= 1e-6, f"the resumed run is {result['gap']:.2e} from the uninterrupted one"


def _load_resharded(rank: int, world: int, path: str) -> dict:
    model, optimizer = _shard(True, strategy="optim", seed=7)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return _everything(model, optimizer)


def test_an_offloaded_checkpoint_reshards_to_another_world_size_and_strategy(tmp_path_factory) -> None:
    root = str(tmp_path_factory.getbasetemp() / "resume")
    saved = _resumed(root)[(True, True)]["saved"]  # 2 ranks, optim_grads_params
    loaded = run_distributed(_load_resharded, 1, f"{root}/True-True")[0]
    assert not _unequal(loaded, saved), _unequal(loaded, saved)


def _groups_and_scheduler(offload: bool, optimizer_class: type, **options) -> tuple[dict, list[str]]:
    """3 steps of an optimizer with two param groups (other lr and weight decay) and a
    scheduler changing the learning rate every step: the final parameters and optimizer state."""
    model = make_model()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = optimizer_class([{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 3e-3}], lr=1e-2, **options)
    model, optimizer = megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[Block], cpu_offload=offload)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    train_steps(model, optimizer, 0, 1, range(3))
    scheduler.step()
    return _everything(model, optimizer), [g["lr"] for g in optimizer.param_groups]


OPTIMIZERS = {
    "adam": (torch.optim.Adam, {}),
    "adamw-amsgrad": (torch.optim.AdamW, {"amsgrad": True}),
    "sgd-nesterov": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
}


@pytest.mark.skipif(not HOST_OP, reason="this build has no host optimizer op")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_host_op_steps_like_torch_with_param_groups_and_a_scheduler(name: str, single_rank_group, monkeypatch) -> None:
    from megatron_fsdp.optim import kernel_step

    calls = []
    step_all = kernel_step.KernelStep._step_all
    monkeypatch.setattr(kernel_step.KernelStep, "_step_all", staticmethod(lambda *a: calls.append(1) or step_all(*a)))
    optimizer_class, options = OPTIMIZERS[name]
    offloaded, offloaded_lrs = _groups_and_scheduler(True, optimizer_class, **options)
    on_device, device_lrs = _groups_and_scheduler(False, optimizer_class, **options)
    assert len(calls) == 3, "the host op did not step"
    assert offloaded_lrs == device_lrs
    gap = _max_relative_gap(offloaded, on_device)
    assert gap <= 1e-5, f"{name}: the host op's run is {gap:.2e} from torch's"


def test_other_optimizers_step_with_their_own_step_and_one_log_line(single_rank_group, caplog) -> None:
    results = []
    for offload in (True, False):
        model = make_model()
        model, optimizer = megatron_fsdp.fully_shard(
            model, torch.optim.RMSprop(model.parameters(), lr=1e-3), fsdp_unit_modules=[Block], cpu_offload=offload
        )
        with caplog.at_level(logging.WARNING, logger="megatron_fsdp.optim.kernel_step"):
            train_steps(model, optimizer, 0, 1, range(3))
        results.append(_everything(model, optimizer))
    lines = [r.getMessage() for r in caplog.records if "own step on the host" in r.getMessage()]
    assert len(lines) == 1, lines
    # torch's RMSprop on host tensors and on the (CPU) device: the same arithmetic.
    assert not _unequal(*results), _unequal(*results)


def test_bf16_main_params_step_with_torchs_own_adam_and_one_log_line(single_rank_group, caplog) -> None:
    """The host ops step fp32 main params; bf16 ones (a bf16 model without fp32 main params) go
    to torch's Adam, whose state stays bf16 as it would on the device."""
    results = []
    for offload in (True, False):
        model = make_model(dtype=torch.bfloat16)
        model, optimizer = megatron_fsdp.fully_shard(
            model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block], cpu_offload=offload,
            mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=None),
        )
        with caplog.at_level(logging.WARNING, logger="megatron_fsdp.optim.kernel_step"):
            train_steps(model, optimizer, 0, 1, range(3))
        results.append(_everything(model, optimizer))
    lines = [r.getMessage() for r in caplog.records if "own step on the host" in r.getMessage()]
    assert len(lines) == 1 and "torch.bfloat16, not float32" in lines[0], lines
    assert not _unequal(*results), _unequal(*results)


def test_offloaded_main_params_are_a_copy_that_each_step_installs(single_rank_group) -> None:
    model, optimizer = _shard(True, strategy="no_shard")  # fp32: without offloading, the weights themselves
    for bucket in model.trainable_buckets():
        weights = bucket.weights.full.untyped_storage()
        assert bucket.main_params.untyped_storage().data_ptr() != weights.data_ptr()
    train_steps(model, optimizer, 0, 1, range(2))
    for name, param in model.module.named_parameters():
        assert torch.equal(param.detach(), model.face_of(param).to_local().view(param.shape)), name


def test_device_gradients_are_released_once_on_the_host_which_accumulates(single_rank_group) -> None:
    """Each backward's reduced gradients leave the device; the host holds their sum, which is
    what a device-resident run holds after the same micro-batches."""
    runs = {offload: _shard(offload) for offload in (True, False)}
    for offload, (model, _) in runs.items():
        for micro_batch in range(2):
            tokens, targets = make_batch(micro_batch, 2)
            model(tokens, targets).backward()
            if offload:
                assert all(b.grads.main_grad is None and b.grads.outer_grad is None for b in model.trainable_buckets())
    grads = {offload: model.full_gradients() for offload, (model, _) in runs.items()}
    assert grads[True].keys() == grads[False].keys()
    for name in grads[True]:
        # The same fp32 additions in the same order, on the host instead of the device.
        assert torch.equal(grads[True][name], grads[False][name]), name
    model, optimizer = runs[True]
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert model.full_gradients() and all(not g.any() for g in model.full_gradients().values())


@pytest.mark.skipif(not HOST_OP, reason="this build has no host optimizer op")
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_the_host_op_writes_the_new_weights_as_it_steps(strategy: str, single_rank_group, monkeypatch) -> None:
    """No second pass casts the stepped main params (send_weights never runs in the step), and
    every element of each bucket's weights is its main params' cast: pieces the optimizer does
    not hold and the padding between pieces included."""
    model = make_model(dtype=torch.bfloat16)
    skipped = model.blocks[0].proj.weight
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p is not skipped], lr=1e-2)
    model, optimizer = megatron_fsdp.fully_shard(
        model, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, cpu_offload=True
    )
    casts = []
    send_weights = HostBuffers.send_weights
    monkeypatch.setattr(HostBuffers, "send_weights", lambda self, target: casts.append(target) or send_weights(self, target))
    for step in range(2):
        tokens, targets = make_batch(step, 2)
        model(tokens, targets).backward()
        with torch.no_grad():
            for bucket in model.trainable_buckets():
                bucket.weights.main_target().fill_(float("nan"))  # what the step leaves unwritten shows
        optimizer.step()
        optimizer.zero_grad()
    assert not casts, f"{len(casts)} bucket ranges were cast after the step"
    for bucket in model.trainable_buckets():
        weights, main = bucket.weights.main_target(), bucket.main_params
        assert weights.dtype == torch.bfloat16 and main.dtype == torch.float32
        assert torch.equal(weights, main.to(weights.dtype)), f"{bucket.names}: {int((weights != main.to(weights.dtype)).sum())} elements differ"
