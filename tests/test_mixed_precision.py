"""MixedPrecisionPolicy: every combination of main-parameter, main-gradient and communication
dtype under every strategy, against a single-process run that does the same arithmetic
(parity.emulated_reference_run); low-precision communication with high-precision reduction;
the deprecated flags; NaN reporting."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings

import pytest
import torch

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp import MixedPrecisionPolicy
from parity import Setup, compare_emulated, emulated_reference_run, sharded_runs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
# (main params, main grads, comm)
COMBOS = list(itertools.product(("fp32", "bf16"), repeat=3))


def _setup(strategy: int, combo: tuple[str, str, str]) -> Setup:
    params, grads, comm = (DTYPES[name] for name in combo)
    policy = MixedPrecisionPolicy(main_params_dtype=params, main_grads_dtype=grads, grad_comm_dtype=comm)
    return Setup(strategy=strategy, accum=2, dtype=torch.bfloat16, optimizer="adam", steps=3, policy=policy)


SETUPS = {f"s{s}-{'-'.join(c)}": _setup(s, c) for s in range(4) for c in COMBOS}
# float64 in the policy, each strategy once: float64 main gradients under fp32 main params (torch
# steps a cast copy; the C++ ops read only gradients below the main params), fp32 communication
# summed into float64 main gradients (promoting_reduce in fp64), and bf16 main gradients under
# float64 main params (torch steps a float64 copy).
for _strategy, _combo in ((3, ("fp32", "fp64", "fp64")), (1, ("fp32", "fp64", "fp64")),
                          (2, ("fp64", "fp64", "fp32")), (0, ("fp64", "fp64", "fp32")), (3, ("fp64", "bf16", "bf16"))):
    SETUPS[f"s{_strategy}-{'-'.join(_combo)}"] = _setup(_strategy, _combo)
# Clipping under mixed precision: fp32 main gradients of a bf16 model, bf16 communication summed
# in fp32, bf16 main params under fp32 main gradients (the optimizer reads a cast copy, which the
# clip scales), and bf16 main gradients under fp32 main params (the C++ ops read them as they
# are, and the clip scales them). torch's clip of bf16 gradients computes their norm in bf16, so
# bf16 gradients are clipped the fused way only.
for _strategy, _combo, _way in ((2, ("fp32", "fp32", "fp32"), "fused"), (3, ("fp32", "fp32", "bf16"), "torch"),
                                (3, ("bf16", "fp32", "fp32"), "fused"), (1, ("fp32", "bf16", "bf16"), "fused")):
    SETUPS[f"clip-{_way}-s{_strategy}-{'-'.join(_combo)}"] = dataclasses.replace(_setup(_strategy, _combo), clip=_way)


@functools.cache
def _results(world: int) -> dict:
    names = list(SETUPS)
    return dict(zip(names, run_distributed(sharded_runs, world, [SETUPS[n] for n in names], timeout=600)[0]))


@pytest.fixture
def one_thread():
    # The reference must compute each rank's gradients with the kernels the ranks used (one thread).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(SETUPS))
def test_policy_matches_a_reference_doing_the_same_arithmetic(name: str, world: int, one_thread) -> None:
    setup = SETUPS[name]
    compare_emulated(_results(world)[name], emulated_reference_run(setup, world), setup, world, f"{name} world {world}")


# One rank: a bf16 model's gradients copied straight into fp32 main gradients (no reduction
# buffer), bf16 communication summed in fp32 over one chunk, and strategy 1's local buffer.
ONE_RANK = ["s3-fp32-fp32-fp32", "s3-fp32-fp32-bf16", "s1-fp32-fp32-fp32"]


@functools.cache
def _one_rank_results() -> dict:
    return dict(zip(ONE_RANK, run_distributed(sharded_runs, 1, [SETUPS[n] for n in ONE_RANK], timeout=600)[0]))


@pytest.mark.parametrize("name", ONE_RANK)
def test_policy_on_one_rank_matches_a_reference_doing_the_same_arithmetic(name: str, one_thread) -> None:
    setup = SETUPS[name]
    compare_emulated(_one_rank_results()[name], emulated_reference_run(setup, 1), setup, 1, f"{name} world 1")


def _reduce_once(rank: int, world: int, comm_dtype: torch.dtype, promote: bool) -> torch.Tensor:
    """One reduce-scatter of the same bf16-representable gradients, through the promoting path
    (bf16 communication, fp32 main gradients) or a bf16 reduce-scatter (bf16 main gradients)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(main_grads_dtype=torch.float32 if promote else torch.bfloat16, grad_comm_dtype=comm_dtype)
    model = megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[torch.nn.Linear], mixed_precision_policy=policy)
    unit = model.units[1]
    bucket = unit.buckets[0]
    generator = torch.Generator().manual_seed(rank)
    local = torch.randn(bucket.layout.padded_numel, generator=generator).to(torch.bfloat16)
    assert bucket.layout.padded_numel == bucket.shapes[0].numel(), "the test needs a bucket without padding"
    unit.unshard()  # as in backward: the parameter is full-size when its gradient arrives
    bucket.params[0].grad = local.view(bucket.shapes[0])
    assert bucket.grads.note_grad(0), "a one-parameter bucket is complete with its one gradient"
    bucket.grads.take()
    bucket.grads.finish_reduction(bucket.grads.start_reduction(async_op=False))
    return bucket.grads.main_grad.float().clone()


def _all_local_gradients(world: int, numel: int) -> torch.Tensor:
    return torch.stack([torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in range(world)])


@pytest.mark.parametrize("world", [4])
def test_bf16_communication_with_fp32_reduction_is_closer_to_fp32_than_a_bf16_reduction(world: int) -> None:
    promoted = run_distributed(_reduce_once, world, torch.bfloat16, True)
    low = run_distributed(_reduce_once, world, torch.bfloat16, False)
    shard = promoted[0].numel()
    exact = _all_local_gradients(world, shard * world).double().mean(0)
    exact_shards = exact.view(world, shard)
    promoted_err = sum((p.double() - e).abs().mean() for p, e in zip(promoted, exact_shards)) / world
    low_err = sum((p.double() - e).abs().mean() for p, e in zip(low, exact_shards)) / world
    # fp32 sums of bf16 values are exact to ~2^-24; a bf16 reduce rounds each partial sum to
    # 2^-9: the promoting path must be at least 10x closer (measured: far more).
    assert promoted_err * 10 < low_err, f"promoting reduce error {promoted_err:.3e} vs bf16 reduce-scatter {low_err:.3e}"


class _RecordingPool:
    """Delegates to the real pool and records the purpose (the key before the bucket's role)
    and dtype of every bucket fetched."""

    def __init__(self, pool) -> None:
        self.pool, self.keys = pool, []

    def fetch(self, numel, dtype, device, key):
        self.keys.append((key.partition("/")[0], dtype))
        return self.pool.fetch(numel, dtype, device, key)

    def __getattr__(self, name):
        return getattr(self.pool, name)


def _fetched_buckets(rank: int, world: int, strategy: str, comm_dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=comm_dtype)
    model, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.Adam(model.parameters()), fsdp_unit_modules=[torch.nn.Linear], zero_dp_strategy=strategy, mixed_precision_policy=policy
    )
    recorder = _RecordingPool(model.pool)
    for unit in model.units:
        for bucket in unit.buckets:
            bucket.pool = recorder
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    return {"keys": sorted(set(recorder.keys), key=str), "in_use": model.pool.bytes_in_use()}


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_a_communication_bucket_exists_only_while_dtypes_differ_and_is_freed(strategy: str) -> None:
    same = run_distributed(_fetched_buckets, 2, strategy, torch.float32)[0]
    lower = run_distributed(_fetched_buckets, 2, strategy, torch.bfloat16)[0]
    assert same["in_use"] == lower["in_use"] == 0, "every pooled bucket is released after the step"
    # Weight gathers ("weights", "gather_input") travel in the compute dtype; gradients in fp32.
    assert all(dtype == torch.float32 for key, dtype in same["keys"] if key not in ("weights", "gather_input")), same["keys"]
    assert ("received_grads", torch.bfloat16) in lower["keys"], lower["keys"]
    if strategy in ("no_shard", "optim"):
        # Local accumulation stays fp32; a bf16 copy is made for the reduction only.
        assert ("grads", torch.float32) in lower["keys"] and ("comm_grads", torch.bfloat16) in lower["keys"], lower["keys"]
    else:
        # One micro-batch per reduction: gradients go straight into a bf16 bucket, no copy.
        assert ("grads", torch.bfloat16) in lower["keys"] and not any(k == "comm_grads" for k, _ in lower["keys"]), lower["keys"]


def _change_comm_dtype_mid_flight(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16)).to(torch.bfloat16)
    policy = MixedPrecisionPolicy(main_grads_dtype=torch.float32)
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=[torch.nn.Linear], mixed_precision_policy=policy)
    paths = []
    for step, comm in enumerate([torch.float32, torch.bfloat16, torch.float32]):
        model.mixed_precision_policy = MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=comm)
        paths.append(model.units[1].buckets[0].dtypes.promotes_reduction)
        model(torch.randn(2, 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step * world + rank))).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    try:
        model.mixed_precision_policy = MixedPrecisionPolicy(main_params_dtype=torch.bfloat16)
        error = ""
    except ValueError as caught:
        error = str(caught)
    return {"paths": paths, "error": error, "params": model.full_parameters()}


def test_grad_comm_dtype_can_change_between_steps() -> None:
    results = run_distributed(_change_comm_dtype_mid_flight, 2)
    assert results[0]["paths"] == [False, True, False], "fp32 -> bf16 -> fp32 communication takes effect each step"
    assert "only grad_comm_dtype can change" in results[0]["error"]
    for key, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][key])


def _nan_run(rank: int, world: int, option: str, poison_rank: int) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=[torch.nn.Linear], **{option: True}
    )
    inputs = torch.randn(2, 8)
    if rank == poison_rank:
        inputs[0, 3] = float("nan")
    try:
        model(torch.randn(2, 8)).sum().backward()  # a clean step first
        optimizer.step()
        optimizer.zero_grad()
        model(inputs).sum().backward()
        optimizer.step()
    except FloatingPointError as error:
        return str(error)
    return "no error"


def test_check_for_nan_in_grad_names_the_step_on_every_rank() -> None:
    messages = run_distributed(_nan_run, 2, "check_for_nan_in_grad", 1)
    for message in messages:
        assert "before optimizer step 1" in message, message


def test_report_nan_in_param_grad_names_parameters_and_ranks() -> None:
    messages = run_distributed(_nan_run, 2, "report_nan_in_param_grad", 1)
    for message in messages:
        # The NaN enters the first layer's input: both layers' weight gradients see it.
        assert "0.weight (ranks [1])" in message and "1.weight (ranks [1])" in message, message
        assert "0.bias" not in message, message


def test_deprecated_flags_map_onto_the_policy_with_a_warning(single_rank_group) -> None:
    with pytest.warns(DeprecationWarning, match="grad_reduce_in_fp32 are deprecated"):
        model = megatron_fsdp.fully_shard_model(
            torch.nn.Sequential(torch.nn.Linear(4, 4)).to(torch.bfloat16), fsdp_unit_modules=[torch.nn.Linear], grad_reduce_in_fp32=True
        )
    dtypes = model.units[1].buckets[0].dtypes
    assert (dtypes.main_params, dtypes.main_grads, dtypes.comm) == (torch.float32, torch.float32, torch.float32)
    with pytest.warns(DeprecationWarning):
        model = megatron_fsdp.fully_shard_model(
            torch.nn.Sequential(torch.nn.Linear(4, 4)).to(torch.bfloat16), fsdp_unit_modules=[torch.nn.Linear], preserve_fp32_weights=False
        )
    assert model.units[1].buckets[0].dtypes.main_params == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = megatron_fsdp.fully_shard_model(torch.nn.Sequential(torch.nn.Linear(4, 4)).to(torch.bfloat16), fsdp_unit_modules=[torch.nn.Linear])
    dtypes = model.units[1].buckets[0].dtypes
    assert (dtypes.main_params, dtypes.main_grads, dtypes.comm) == (torch.float32, torch.bfloat16, torch.bfloat16), "defaults"
    with pytest.raises(ValueError, match="either mixed_precision_policy or grad_reduce_in_fp32"):
        megatron_fsdp.fully_shard_model(
            torch.nn.Sequential(torch.nn.Linear(4, 4)), fsdp_unit_modules=[torch.nn.Linear],
            mixed_precision_policy=MixedPrecisionPolicy(), grad_reduce_in_fp32=True,
        )
    with pytest.raises(ValueError, match="float dtype"):
        MixedPrecisionPolicy(grad_comm_dtype=torch.int8)


def _optimizer_grads(rank: int, world: int) -> dict:
    """Per optimizer, after one backward: the dtype of what it reads, and whether that is the
    main gradient itself (no copy)."""
    from models import Block, make_batch, make_model

    found = {}
    for name, build in (("adamw", lambda p: torch.optim.AdamW(p, lr=1e-3)),
                        ("sgd momentum", lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9)),
                        ("rmsprop", lambda p: torch.optim.RMSprop(p, lr=1e-3))):
        model = make_model(dtype=torch.bfloat16)
        model, optimizer = megatron_fsdp.fully_shard(model, build(model.parameters()), fsdp_unit_modules=[Block])
        tokens, targets = make_batch(rank, 2)
        model(tokens, targets).backward()
        model.finish_grad_sync()
        bucket = model.trainable_buckets()[0]
        found[name] = (bucket.grads.optimizer_grads.dtype, bucket.grads.optimizer_grads is bucket.grads.main_grad)
        if name != "rmsprop":  # a closure cannot reach the kernels: refused before anything changes
            with pytest.raises(ValueError, match="call the closure before step"):
                optimizer.step(lambda: None)
        optimizer.step(None)  # as Accelerate's optimizer wrapper calls it
    return found


def test_bf16_main_grads_are_read_as_they_are_by_adam_and_sgd_and_cast_for_other_optimizers() -> None:
    """Issue 40: bf16 main gradients under fp32 main params cost 2 bytes a parameter shard, not 2 + 4:
    the C++ ops step Adam/AdamW/SGD reading them as they are (test_policy_... checks the numbers),
    and only optimizers they do not implement get an fp32 copy."""
    found = run_distributed(_optimizer_grads, 2)[0]
    assert found == {
        "adamw": (torch.bfloat16, True), "sgd momentum": (torch.bfloat16, True), "rmsprop": (torch.float32, False),
    }, found


def test_capturing_a_step_the_ops_would_freeze_is_refused(single_rank_group, monkeypatch) -> None:
    """A CUDA graph capturing optimizer.step() while the C++ ops step it (bf16 main gradients)
    would replay the captured step count and learning rate at every replay: refused, naming
    the way out (capturable=True), before any parameter changes. The capture itself needs a GPU
    (tests/gpu/test_cuda_graph_step.py); here torch.cuda reports one."""
    from models import Block, make_batch, make_model

    model = make_model(dtype=torch.bfloat16)
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), fsdp_unit_modules=[Block])
    tokens, targets = make_batch(0, 2)
    model(tokens, targets).backward()
    before = {name: value.clone() for name, value in model.full_parameters().items()}
    with monkeypatch.context() as capturing:
        capturing.setattr(torch.cuda, "is_available", lambda: True)
        capturing.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.raises(RuntimeError, match="capturable=True"):
            optimizer.step()
    assert all(torch.equal(before[name], value) for name, value in model.full_parameters().items())
    optimizer.step()  # not capturing: steps as before
    assert any(not torch.equal(before[name], value) for name, value in model.full_parameters().items())
