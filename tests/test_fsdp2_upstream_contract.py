"""Behaviours PyTorch's own FSDP2 tests check (test_fully_shard_training.py) that our other
fsdp2 tests did not: explicit forward/backward prefetch lists, a separately sharded module
called twice in one forward, a frozen float8 parameter (test_fully_shard_init.py), and the error
of a forward on the meta device. Each trains megatron_fsdp.fsdp2 and torch's fully_shard on the same
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
from parity import max_relative_error, run_differences
from models import make_batch, make_model

STEPS, ROWS, LR, RTOL = 3, 2, 1e-2, 1e-6


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


def _contract(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    problems = run_differences(
        _train_with_prefetch(fully_shard, rank, world), _train_with_prefetch(torch_fully_shard, rank, world),
        "explicit prefetch", RTOL,
    )
    for reshard in (True, False):
        problems += run_differences(
            _train_twice_called(fully_shard, rank, reshard), _train_twice_called(torch_fully_shard, rank, reshard),
            f"module called twice, reshard_after_forward={reshard}", RTOL,
        )
    return problems


def test_explicit_prefetch_and_twice_called_module_match_torch_fsdp2() -> None:
    for rank, problems in enumerate(run_distributed(_contract, world_size=2)):
        assert not problems, f"rank {rank}: {problems}"


class _FrozenFloat8(nn.Module):
    """A frozen float8 weight (no torchao) in its own bucket beside a trained fp32 one, as
    upstream's test_mixed_dtypes_no_grad_param; gloo has no float8 type."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w_fp8 = nn.Parameter(torch.randn(16, 16).to(torch.float8_e4m3fn), requires_grad=False)
        self.w_fp32 = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w_fp8.float()) @ self.w_fp32


def _frozen_float8(fully_shard, rank: int) -> dict:
    model = _FrozenFloat8()
    fully_shard(model)
    out = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)))
    out.square().mean().backward()
    return {"out": out.detach(), "grad": model.w_fp32.grad.full_tensor()}


class _MetaMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("offset", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.offset


def _meta_model(fully_shard) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(_MetaMLP(), _MetaMLP())
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    return model


def _materialise(model: nn.Module) -> nn.Module:
    model.to_empty(device="cpu")
    with torch.no_grad():
        for index, tensor in enumerate([*model.parameters(), *model.buffers()]):
            tensor.fill_(0.1 * (index + 1))
    return model


def _meta_forward(fully_shard, rank: int) -> dict:
    """The forward's error before ``to_empty``; the output of a model materialised before its
    first forward, and (``retried``) of the failed model materialised afterwards: torch's FSDP2
    cannot run again after the error, ours raised before any state or collective changed."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    failed = _meta_model(fully_shard)
    try:
        failed(x)
        error = ""
    except RuntimeError as raised:
        error = str(raised)
    result = {"error": error, "out": _materialise(_meta_model(fully_shard))(x).detach()}
    if fully_shard is not torch_fully_shard:
        result["retried"] = _materialise(failed)(x).detach()
    return result


def _frozen_float8_contract(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    ours, theirs = _frozen_float8(fully_shard, rank), _frozen_float8(torch_fully_shard, rank)
    return [
        f"frozen float8: {key} differs by {max_relative_error(ours[key], theirs[key]):.2e}"
        for key in ("out", "grad")
        if max_relative_error(ours[key], theirs[key]) > RTOL
    ]


def _meta_contract(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    problems = []
    ours, theirs = _meta_forward(fully_shard, rank), _meta_forward(torch_fully_shard, rank)
    # fully_shard gives meta parameters memory (by design), so ours names the buffers left on meta.
    if "materialized from meta device" not in ours["error"] or "['0.offset', '1.offset']" not in ours["error"]:
        problems.append(f"meta forward: error {ours['error']!r}")
    if "materialized from meta device" not in theirs["error"]:
        problems.append(f"meta forward, torch's: error {theirs['error']!r}")
    for key in ("out", "retried"):
        if max_relative_error(ours[key], theirs["out"]) > RTOL:
            problems.append(f"meta forward after to_empty ({key}): {ours[key]} vs {theirs['out']}")
    return problems


def test_frozen_float8_param_matches_torch_fsdp2() -> None:
    for rank, problems in enumerate(run_distributed(_frozen_float8_contract, world_size=2)):
        assert not problems, f"rank {rank}: {problems}"


def test_forward_on_meta_names_what_to_materialise() -> None:
    for rank, problems in enumerate(run_distributed(_meta_contract, world_size=2)):
        assert not problems, f"rank {rank}: {problems}"
