"""plan_memory on CUDA (issue 33): the planned model states, each tensor rounded as the caching
allocator rounds it, equal what torch.cuda.memory_allocated() grows by from before the model is
built to after its first optimizer step, for each strategy, bf16 with fp32 main weights; and a
model whose planned states exceed the free device memory is refused at the wrap, on every rank,
naming the biggest item and what would fit, before any buffer is allocated."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import megatron_fsdp
from _dist import nccl_world, run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WIDTH = 1000  # odd sizes: parameters straddle shards, buckets carry padding


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 3 * WIDTH + 7)
        self.down = nn.Linear(3 * WIDTH + 7, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _model(layers: int) -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), *(Block() for _ in range(layers)), nn.Linear(WIDTH, 11)).to(torch.bfloat16)


def _warm_up_cublas() -> None:
    """cuBLAS's workspaces come from the caching allocator on the first matmul and stay: not model states."""
    weight = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (weight @ weight).float().sum().backward()
    torch.cuda.synchronize()


def _states(rank: int, world: int, strategy: str) -> tuple[int, int]:
    _warm_up_cublas()
    with torch.device("meta"):
        meta = _model(4)
    plan = megatron_fsdp.plan_memory(meta, world, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, optimizer="adamw")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model, optimizer = megatron_fsdp.fully_shard(
        meta, torch.optim.AdamW(meta.parameters(), lr=1e-3), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        init_model_with_meta_device=True, device="cuda",
    )
    batch = torch.randn(8, WIDTH, device="cuda", dtype=torch.bfloat16)
    model(batch).float().square().mean().backward()
    optimizer.step()
    del batch
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - base, plan.for_rank(rank).allocator_bytes


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_planned_model_states_equal_the_allocators_growth_after_the_first_step(strategy: str) -> None:
    for rank, (held, planned) in enumerate(run_distributed(_states, nccl_world(), strategy, backend="nccl")):
        assert held == planned, f"rank {rank}: the allocator grew by {held} bytes, planned {planned}"


def _too_big(rank: int, world: int) -> str:
    free, _ = torch.cuda.mem_get_info()
    layers = int(free // (WIDTH * (6 * WIDTH + 7) * 6)) + 8  # bf16 weights + fp32 main weights alone exceed it
    with torch.device("meta"):
        model = _model(layers)
    before = torch.cuda.memory_allocated()
    with pytest.raises(ValueError) as error:
        megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Block], zero_dp_strategy="no_shard",
                                        init_model_with_meta_device=True, device="cuda")
    assert torch.cuda.memory_allocated() == before, "it allocated before refusing"
    return str(error.value)


def test_a_model_that_cannot_fit_is_refused_at_the_wrap_with_what_would_fit() -> None:
    for message in run_distributed(_too_big, nccl_world(), backend="nccl"):
        assert "model states need" in message and "the biggest item is" in message, message
        assert "plan_memory" in message, message
