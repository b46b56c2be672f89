"""A step that raises on every rank (an out-of-memory error in forward, in backward, in the
optimizer's step) leaves the model usable: after ``optimizer.zero_grad()``, or a plain retry of
the forward, the next steps train bit for bit like a run that never took the failed step (same
model, data and seed, fp32: the same arithmetic in the same order, so equality is exact).
A failure on one rank only makes the others raise within ``collective_timeout``."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import megatron_fsdp
from megatron_fsdp.engine.groups.collective_watch import PROBE_SECONDS
from _dist import run_distributed
from megatron_fsdp.integrations.mcore_fsdp import MegatronCoreFSDP
from models import Block, make_batch, make_model

STEPS = 4
FAIL_AT = 2  # the step whose first attempt raises
ROWS = 2  # per rank and micro-batch


class SimulatedOutOfMemory(RuntimeError):
    pass


class _Failure:
    """Raises once, where armed: in a block's forward, in its backward (a gradient hook, where
    activation memory peaks), in the optimizer's step or in zero_grad (before it zeroes)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, where: str) -> None:
        self.where = where
        self.armed = False
        block = model.module.blocks[1]
        block.register_forward_hook(lambda module, args, output: self._maybe_raise("forward"))
        block.register_full_backward_hook(lambda module, grad_in, grad_out: self._maybe_raise("backward"))
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._maybe_raise("step"))
        zero_grad_buffer = model.zero_grad_buffer

        def failing_zero_grad_buffer(*args, **kwargs) -> None:
            self._maybe_raise("zero_grad")
            zero_grad_buffer(*args, **kwargs)

        model.zero_grad_buffer = failing_zero_grad_buffer

    def _maybe_raise(self, point: str) -> None:
        if self.armed and point == self.where:
            self.armed = False
            # Worded as torch's, so that Accelerate's check takes it for one.
            raise SimulatedOutOfMemory(f"CUDA out of memory. Tried to allocate 2.00 GiB (simulated in {point})")


def _build(case: dict, rank: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    kwargs = dict(fsdp_unit_modules=[Block], zero_dp_strategy=case["strategy"], cpu_offload=case.get("offload", False))
    if case.get("hsdp"):
        kwargs.update(device_mesh=init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_outer", "dp_shard")),
                      dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    if case.get("megatron_core"):
        config = megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy=case["strategy"])
        model = MegatronCoreFSDP(model, None, config, fsdp_unit_modules=[Block])
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)
    return megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters(), lr=1e-2), **kwargs)


def _micro_batches(step: int, rank: int, world: int, accum: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens, targets = make_batch(step, ROWS * world * accum)
    return [
        (tokens[(m * world + rank) * ROWS : (m * world + rank + 1) * ROWS], targets[(m * world + rank) * ROWS : (m * world + rank + 1) * ROWS])
        for m in range(accum)
    ]


def _step(model, optimizer, step: int, rank: int, world: int, accum: int, megatron_core: bool) -> float:
    total = 0.0
    for micro, (tokens, targets) in enumerate(_micro_batches(step, rank, world, accum)):
        loss = model(tokens, targets) / accum
        if megatron_core and micro < accum - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
        total += loss.item()
    if megatron_core:
        model.finish_grad_sync()
    optimizer.step()
    if megatron_core:
        model.param_and_grad_buffer.copy_main_weights_to_model_weights()
    _zero_grad(model, optimizer, megatron_core)
    return total


def _zero_grad(model, optimizer, megatron_core: bool) -> None:
    optimizer.zero_grad()
    if megatron_core:  # megatron-core's optimizer releases the model's gradient buffers in zero_grad
        model.zero_grad_buffer()


def _train(rank: int, world: int, case: dict, where: str | None) -> dict:
    """STEPS steps; with ``where``, the first attempt at step FAIL_AT raises there (on every
    rank), is caught, and the step is taken again (after zero_grad unless the case retries
    straight away, as Accelerate's find_executable_batch_size does), or, when zero_grad
    raised after the step, zero_grad is called again."""
    model, optimizer = _build(case, rank, world)
    failure = _Failure(model, optimizer, where) if where else None
    accum, megatron_core = case.get("accum", 1), case.get("megatron_core", False)
    losses = []
    for step in range(STEPS):
        if failure is not None and step == FAIL_AT:
            failure.armed = True
            try:
                _step(model, optimizer, step, rank, world, accum, megatron_core)
                raise AssertionError(f"the simulated failure in {where} did not raise")
            except SimulatedOutOfMemory:
                if where == "zero_grad":  # the step itself completed: zero again and go on
                    _zero_grad(model, optimizer, megatron_core)
                    losses.append(None)
                    continue
                if not case.get("retry_without_zero_grad"):
                    _zero_grad(model, optimizer, megatron_core)
        losses.append(_step(model, optimizer, step, rank, world, accum, megatron_core))
    if megatron_core:  # between steps, megatron-core's view of the model holds the DTensor faces
        assert all(isinstance(p, DTensor) for p in model.module.parameters()), "the faces were not registered back"
    return {"losses": losses, "params": model.full_parameters()}


CASES = {
    **{f"s{s}": dict(strategy=s) for s in range(4)},
    "s3-accumulation": dict(strategy=3, accum=2),
    "s1-accumulation": dict(strategy=1, accum=2),
    "s3-hsdp": dict(strategy=3, hsdp=True),
    "s3-offload": dict(strategy=3, offload=True),
    "s2-megatron-core": dict(strategy="optim_grads", megatron_core=True, accum=2),
    # Retried without zero_grad: a failed forward or backward drops its step by itself (a failed
    # optimizer step keeps its gradients, to be accumulated into as torch's would be).
    "s3-retry-without-zero-grad": dict(strategy=3, retry_without_zero_grad=True, points=("forward", "backward")),
}
FAILURE_POINTS = ("forward", "backward", "step", "zero_grad")


def _points(case: dict) -> tuple[str, ...]:
    return case.get("points", FAILURE_POINTS)


def _all_cases(rank: int, world: int) -> dict:
    results = {}
    for name, case in CASES.items():
        results[name, None] = _train(rank, world, case, None)
        for where in _points(case):
            results[name, where] = _train(rank, world, case, where)
    return results


def test_a_failed_step_on_every_rank_leaves_training_bit_for_bit_like_a_clean_run() -> None:
    for rank, results in enumerate(run_distributed(_all_cases, 2, timeout=600)):
        for name, case in CASES.items():
            clean = results[name, None]
            for where in _points(case):
                recovered = results[name, where]
                label = f"rank {rank}, {name}, failed in {where}"
                # A failed zero_grad comes after its step's loss: that one is not recorded.
                losses = [loss if got is not None else None for loss, got in zip(clean["losses"], recovered["losses"])]
                assert recovered["losses"] == losses, f"{label}: losses {recovered['losses']} vs {clean['losses']}"
                for key, value in clean["params"].items():
                    assert torch.equal(recovered["params"][key], value), f"{label}: parameter {key} differs"


def _sharded(**kwargs) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    return megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block], **kwargs)


def _misuse_after_a_failed_backward(rank: int, world: int) -> dict:
    model, optimizer = _sharded()
    failure = _Failure(model, optimizer, "backward")
    (tokens, targets), = _micro_batches(0, rank, world, 1)
    failure.armed = True
    loss = model(tokens, targets)
    with pytest.raises(SimulatedOutOfMemory):
        loss.backward()
    before = {name: value.clone() for name, value in model.full_parameters().items()}
    messages = []
    for misuse in (lambda: optimizer.step(), lambda: model.finish_grad_sync(), lambda: loss.backward()):
        with pytest.raises(RuntimeError) as error:
            misuse()
        messages.append(str(error.value))
    unchanged = all(torch.equal(value, before[name]) for name, value in model.full_parameters().items())
    optimizer.zero_grad()
    _step(model, optimizer, 0, rank, world, 1, False)
    return {"messages": messages, "unchanged": unchanged, "state": len(optimizer.state)}


def test_a_step_or_second_backward_after_a_failed_backward_raises_and_changes_nothing() -> None:
    for result in run_distributed(_misuse_after_a_failed_backward, 2):
        step_error, sync_error, backward_error = result["messages"]
        assert "optimizer.step() was called after a backward that raised: call optimizer.zero_grad()" in step_error
        assert "finish_grad_sync() was called after a backward that raised" in sync_error
        assert "backward through the graph a second time" in backward_error, backward_error
        assert result["unchanged"], "a refused call changed the parameters"
        assert result["state"] > 0, "the step after zero_grad did not run"


TIMEOUT = 2.0


def _one_rank_fails_in_backward(rank: int, world: int) -> None:
    model, optimizer = _sharded(collective_timeout=TIMEOUT)
    failure = _Failure(model, optimizer, "backward")
    (tokens, targets), = _micro_batches(0, rank, world, 1)
    failure.armed = rank == 0
    loss = model(tokens, targets)
    if rank == 0:
        with pytest.raises(SimulatedOutOfMemory):
            loss.backward()
        time.sleep(30)  # the test fails if rank 1 waits this long
        return
    started = time.monotonic()
    try:
        loss.backward()
        optimizer.step()
    except RuntimeError as error:
        raise RuntimeError(f"raised after {time.monotonic() - started:.2f} s: {error}") from None


def test_a_failure_on_one_rank_makes_the_others_raise_within_the_collective_timeout() -> None:
    with pytest.raises(RuntimeError) as failure:
        run_distributed(_one_rank_fails_in_backward, 2, timeout=25)
    report = str(failure.value)
    match = re.search(r"raised after ([0-9.]+) s: (.*)", report)
    assert match, f"rank 1 did not raise in time:\n{report}"
    assert float(match.group(1)) < TIMEOUT + PROBE_SECONDS + 3, report
    assert f"no result within collective_timeout={TIMEOUT:g} s" in match.group(2), match.group(2)
    assert "rank 0 is alive but not in this collective (it waits for no collective)" in match.group(2), match.group(2)


def _find_executable_batch_size(rank: int, world: int, settled: int | None) -> dict:
    """Accelerate's own find_executable_batch_size around a training function written as its
    docs show (zero_grad at the end of each step, none before a retry). Backward runs out of
    memory (simulated) above 2 rows per rank; from 8 rows, halving, it settles at 2."""
    from accelerate.utils import find_executable_batch_size

    model, optimizer = _sharded()
    block = model.module.blocks[1]
    rows_now = {}
    block.register_forward_pre_hook(lambda module, args: rows_now.update(rows=args[0].shape[0]))

    def out_of_memory_above_two_rows(module, grad_in, grad_out) -> None:
        if rows_now["rows"] > 2:
            raise SimulatedOutOfMemory("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    block.register_full_backward_hook(out_of_memory_above_two_rows)
    tried = []

    def train(batch_size: int) -> list[float]:
        tried.append(batch_size)
        losses = []
        for step in range(STEPS):
            tokens, targets = make_batch(step, batch_size * world)
            loss = model(tokens[rank * batch_size : (rank + 1) * batch_size], targets[rank * batch_size : (rank + 1) * batch_size])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    if settled is None:
        halving = {"size": 8}

        def halve() -> int:
            halving["size"] //= 2
            return halving["size"]

        losses = find_executable_batch_size(train, starting_batch_size=8, reduce_batch_size_fn=halve)()
    else:
        losses = train(settled)
    return {"tried": tried, "losses": losses, "params": model.full_parameters()}


def test_accelerates_find_executable_batch_size_settles_and_trains_like_a_clean_run_at_that_size() -> None:
    searched = run_distributed(_find_executable_batch_size, 2, None)
    clean = run_distributed(_find_executable_batch_size, 2, 2)
    for rank, (found, reference) in enumerate(zip(searched, clean)):
        assert found["tried"] == [8, 4, 2], f"rank {rank} tried batch sizes {found['tried']}"
        assert found["losses"] == reference["losses"], f"rank {rank}: {found['losses']} vs {reference['losses']}"
        for key, value in reference["params"].items():
            assert torch.equal(found["params"][key], value), f"rank {rank}: parameter {key} differs"
