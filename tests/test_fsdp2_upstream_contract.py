"""Behaviours PyTorch's own FSDP2 tests check (test_fully_shard_training.py) that our other
fsdp2 tests did not: explicit forward/backward prefetch lists, and a separately sharded module
called twice in one forward. Each trains megatron_fsdp.fsdp2 and torch's fully_shard on the same
model, data and seed over gloo world 2 and compares losses and full parameters.

Tolerance 1e-6 relative (fp32), as tests/test_fsdp2_parity.py: both run the same forward and
backward on the same full weights and sum the same gradients; prefetching changes only when a
gather starts, never a value. A module counted once instead of twice, or a gradient lost from
one of its calls, is O(1). scripts/fsdp2_upstream_tests.py runs the upstream files themselves.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from _dist import run_distributed
from models import make_batch, make_model

STEPS, ROWS, LR, RTOL = 3, 2, 1e-2, 1e-6


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: getattr(p, "full_tensor", p.detach)() for name, p in model.named_parameters()}


def _train_with_prefetch(fully_shard, rank: int, world: int) -> dict:
    """Each block gathers the next two blocks in forward and the previous two in backward."""
    model = make_model(seed=0)
    blocks = list(model.blocks)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    for index, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[index + 1 : index + 3])
        block.set_modules_to_backward_prefetch(blocks[max(0, index - 2) : index][::-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(*make_batch(step * world + rank, ROWS))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": _full_params(model)}


class _TwiceCalled(nn.Module):
    """``inner`` runs twice per forward, as in a weight-shared recurrent step."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.outer = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.inner(x)) + self.inner(x))


def _train_twice_called(fully_shard, rank: int, reshard_after_forward: bool) -> dict:
    torch.manual_seed(0)
    model = _TwiceCalled()
    fully_shard(model.inner, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        loss = model(torch.randn(16, 8, generator=generator)).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": _full_params(model)}


def _compare(ours: dict, theirs: dict, what: str) -> list[str]:
    problems = []
    if _relative_error(ours["losses"], theirs["losses"]) > RTOL:
        problems.append(f"{what}: losses {ours['losses'].tolist()} vs {theirs['losses'].tolist()}")
    for name, want in theirs["params"].items():
        error = _relative_error(ours["params"][name], want)
        if error > RTOL:
            problems.append(f"{what}: {name} differs by {error:.2e} relative")
    return problems


def _contract(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    problems = _compare(
        _train_with_prefetch(fully_shard, rank, world), _train_with_prefetch(torch_fully_shard, rank, world),
        "explicit prefetch",
    )
    for reshard in (True, False):
        problems += _compare(
            _train_twice_called(fully_shard, rank, reshard), _train_twice_called(torch_fully_shard, rank, reshard),
            f"module called twice, reshard_after_forward={reshard}",
        )
    return problems


def test_explicit_prefetch_and_twice_called_module_match_torch_fsdp2() -> None:
    for rank, problems in enumerate(run_distributed(_contract, world_size=2)):
        assert not problems, f"rank {rank}: {problems}"
