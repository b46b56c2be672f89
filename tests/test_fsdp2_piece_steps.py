"""A plain torch optimizer over parameters sharded in place by megatron_fsdp.fsdp2 steps the plain
pieces under the DTensor faces (megatron_fsdp/optim/global_step_hooks.py) and trains as torch's FSDP2.

What the step sees is read through torch's public surface: a step pre-hook the test registers on
the optimizer runs after the global hooks, so it sees what torch's update then iterates (its
param groups, their ``.grad`` and the optimizer's state). Between steps the optimizer shows the
DTensor faces and DTensor state, as FSDP2's.

Each case trains TinyGPT (tied head, parameters straddling shard boundaries) sharded per block and
then the root, on gloo world 2, with ours and with torch's FSDP2 in the same process; the second
step's closure raises, the test clears the gradients and trains on (FSDP2 alike). Tolerance 1e-6
relative to each tensor's largest entry, as tests/test_fsdp2_parity.py: both reduce the same sums
and step the same fp32 values elementwise (measured: bit-identical).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from _dist import run_distributed
from models import make_batch, make_model

STEPS, ROWS, RAISING_STEP = 4, 2, 1
RTOL = 1e-6

OPTIMIZERS = {
    "AdamW": lambda params, foreach: torch.optim.AdamW(params, lr=1e-2, foreach=foreach),
    "Adam": lambda params, foreach: torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, foreach=foreach),
    "SGD momentum": lambda params, foreach: torch.optim.SGD(params, lr=1e-1, momentum=0.9, foreach=foreach),
}


def _raise() -> None:
    raise ArithmeticError("the closure raised")


def _train(fully_shard, optimizer_name: str, foreach: bool | None, rank: int, world: int) -> dict:
    model = make_model(seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters(), foreach)
    seen_in_step: set[type] = set()

    def record(opt: torch.optim.Optimizer, args, kwargs) -> None:
        for group in opt.param_groups:
            for param in group["params"]:
                seen_in_step.update({type(param), type(param.grad)})
        for entries in opt.state.values():
            seen_in_step.update(type(value) for value in entries.values())

    optimizer.register_step_pre_hook(record)
    losses, shown_between_steps = [], set()
    for step in range(STEPS):
        loss = model(*make_batch(step * world + rank, ROWS))
        loss.backward()
        losses.append(loss.detach())
        if step == RAISING_STEP:
            with pytest.raises(ArithmeticError):
                optimizer.step(_raise)
        else:
            optimizer.step()
            shown_between_steps.update(type(p) for group in optimizer.param_groups for p in group["params"])
        optimizer.zero_grad()
    state = optimizer.state_dict()["state"]
    full_state = {
        (index, name): value.full_tensor()
        for index, entries in state.items()
        for name, value in entries.items()
        if isinstance(value, DTensor)
    }
    return {
        "losses": torch.stack(losses),
        "params": {name: param.full_tensor() for name, param in model.named_parameters()},
        "state": full_state,
        "seen_in_step": seen_in_step,
        "shown_between_steps": shown_between_steps,
        "state_types": {type(value) for entries in state.values() for value in entries.values() if value.dim() > 0},
    }


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _steps_on_pieces_match_fsdp2(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    problems = []
    for optimizer_name in OPTIMIZERS:
        for foreach in (False, True):
            what = f"{optimizer_name} foreach={foreach}"
            ours = _train(fully_shard, optimizer_name, foreach, rank, world)
            theirs = _train(torch_fully_shard, optimizer_name, foreach, rank, world)
            if not ours["seen_in_step"] <= {torch.nn.Parameter, torch.Tensor, type(None)}:
                problems.append(f"{what}: the step saw {ours['seen_in_step']}, not plain tensors")
            if torch.nn.Parameter not in ours["seen_in_step"]:
                problems.append(f"{what}: the hook saw no parameter")
            for key in ("shown_between_steps", "state_types"):
                if not ours[key] or not all(issubclass(t, DTensor) for t in ours[key]):
                    problems.append(f"{what}: {key} {ours[key]}, not DTensors as FSDP2's")
            if _relative_error(ours["losses"], theirs["losses"]) > RTOL:
                problems.append(f"{what}: losses {ours['losses'].tolist()} vs FSDP2's {theirs['losses'].tolist()}")
            for name, want in theirs["params"].items():
                if _relative_error(ours["params"][name], want) > RTOL:
                    problems.append(f"{what}: parameter {name} differs")
            if ours["state"].keys() != theirs["state"].keys():
                problems.append(f"{what}: state keys {sorted(ours['state'])} vs FSDP2's {sorted(theirs['state'])}")
            for key, want in theirs["state"].items():
                if key in ours["state"] and _relative_error(ours["state"][key], want) > RTOL:
                    problems.append(f"{what}: optimizer state {key} differs")
    return problems


def test_plain_optimizer_steps_plain_pieces_and_trains_as_fsdp2() -> None:
    for rank, problems in enumerate(run_distributed(_steps_on_pieces_match_fsdp2, 2)):
        assert not problems, f"rank {rank}: " + "; ".join(problems)
