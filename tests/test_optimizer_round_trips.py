"""A sharded optimizer's ``state_dict()`` and ``load_state_dict()`` change nothing (issue 38):
a fresh one shows no step taken and keeps no state, as torch's; loading it back (Accelerate does
``load_state_dict(state_dict())`` when it wraps an optimizer) leaves the next step torch's first
step; and after round trips, fresh or mid-training, training equals single-process training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import megatron_fsdp
from _dist import run_distributed
from models import Block, make_batch, make_model

WORLD, STEPS, ROWS = 2, 4, 2
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# SGD's dampening makes a zero momentum buffer differ from none: torch's first step takes the
# gradient itself as the buffer, a zero buffer would give (1 - dampening) * gradient.
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9, dampening=0.5),
}


def _round_trip(optimizer: torch.optim.Optimizer) -> None:
    optimizer.load_state_dict(optimizer.state_dict())


def _train(model, optimizer, rows: slice) -> list[float]:
    losses = []
    for step in range(STEPS):
        tokens, targets = make_batch(step, WORLD * ROWS)
        loss = model(tokens[rows], targets[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            _round_trip(optimizer)  # mid-training: the state goes out and comes back
        losses.append(loss.item())
    return losses


def _sharded(rank: int, world: int) -> dict:
    results = {}
    for strategy in STRATEGIES:
        for name, build in OPTIMIZERS.items():
            model = make_model()
            model, optimizer = megatron_fsdp.fully_shard(
                model, build(model.parameters()), fsdp_unit_modules=[Block], zero_dp_strategy=strategy
            )
            fresh = optimizer.state_dict()
            steps_shown = {entries["step"].item() for entries in fresh["state"].values() if "step" in entries}
            state_kept = len(optimizer.state)
            for _ in range(3):
                _round_trip(optimizer)
            # Accelerate on a GPU moves the state dict to the device: new step counter tensors.
            moved = optimizer.state_dict()
            for entries in moved["state"].values():
                if "step" in entries:
                    entries["step"] = entries["step"].clone()
            optimizer.load_state_dict(moved)
            state_after_round_trips = len(optimizer.state)
            _train(model, optimizer, slice(rank * ROWS, (rank + 1) * ROWS))
            results[strategy, name] = {
                "steps_shown": steps_shown,
                "state_kept": state_kept,
                "state_after_round_trips": state_after_round_trips,
                "params": model.full_parameters(),
            }
    return results


def _reference(name: str) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, torch's optimizer with the same round trips."""
    model = make_model()
    optimizer = OPTIMIZERS[name](model.parameters())
    for _ in range(3):
        _round_trip(optimizer)
    _train(model, optimizer, slice(None))
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def sharded() -> dict:
    return run_distributed(_sharded, WORLD)[0]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_round_trips_leave_training_as_torchs(sharded, strategy: str, name: str) -> None:
    got = sharded[strategy, name]
    assert got["state_kept"] == 0, f"{strategy}/{name}: state_dict() left {got['state_kept']} parameters with state"
    assert got["steps_shown"] <= {0.0}, f"{strategy}/{name}: a fresh optimizer's state dict shows steps {got['steps_shown']}"
    assert got["state_after_round_trips"] == 0, f"{strategy}/{name}: loading a fresh state dict back created state"
    # fp32; the sharded run sums two half-batch gradients where the reference differentiates the
    # whole batch: rounding of a few 1e-7 relative, which 4 Adam steps keep near 1e-6 (Adam's
    # update hardly depends on the gradient's size). An extra step taken by state_dict() moves
    # Adam's bias correction and SGD's first momentum by 1e-2 relative or more.
    for param_name, value in _reference(name).items():
        scale = value.abs().max().item()
        err = (got["params"][param_name] - value).abs().max().item() / scale
        assert err <= 1e-5, f"{strategy}/{name}: {param_name}: relative error {err:.2e}"


def _loaded_steps(rank: int, world: int, path: str) -> dict[str, float]:
    """This rank's step counters after ``dcp.load`` into a fresh optimizer's state dict."""
    model, optimizer = _sharded_adam()
    _train(model, optimizer, slice(rank * ROWS, (rank + 1) * ROWS))
    dcp.save({"optimizer": optimizer.state_dict()}, checkpoint_id=path)
    model, optimizer = _sharded_adam()
    state = {"optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    optimizer.load_state_dict(state["optimizer"])
    names = {face: name for name, face in model.named_parameters()}
    return {names[face]: entries["step"].item() for face, entries in optimizer.state.items()}


def _sharded_adam():
    model = make_model()
    return megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block])


def test_dcp_load_into_a_fresh_optimizer_loads_every_parameter_on_every_rank(tmp_path) -> None:
    """Parameters whose piece is empty on a rank (small norms at a shard's end) included: there
    dcp.load writes only the step counter, and that state must load too."""
    for rank, steps in enumerate(run_distributed(_loaded_steps, WORLD, str(tmp_path))):
        names = [name for name, _ in make_model().named_parameters()]
        assert steps == {name: float(STEPS) for name in names}, f"rank {rank}: step counters after loading: {steps}"
