"""plan_memory on CUDA (issue 33): the planned model states equal the bytes the wrapper and the
optimizer asked the caching allocator for, from before the model is built to after its first
optimizer step, still held then (torch's memory snapshot: each live block's requested size and
the Python frame that allocated it), for each strategy, bf16 with fp32 main weights; the
allocator's own count (memory_allocated) is within 5% of them, the rest being blocks it handed
out larger than asked (a cached block reused). And a model whose planned states exceed the free
device memory is refused at the wrap, on every rank, naming the biggest item and what would fit,
before any buffer is allocated."""

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
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    model, optimizer = megatron_fsdp.fully_shard(
        meta, torch.optim.AdamW(meta.parameters(), lr=1e-3), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        init_model_with_meta_device=True, device="cuda",
    )
    batch = torch.randn(8, WIDTH, device="cuda", dtype=torch.bfloat16)
    model(batch).float().square().mean().backward()
    optimizer.step()
    del batch
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    requested = sum(
        block["requested_size"] for segment in snapshot["segments"] for block in segment["blocks"]
        if block["state"] == "active_allocated" and _allocated_by_the_model(block.get("frames") or [])
    )
    planned = plan.for_rank(rank)
    return requested, planned.device_model_states, torch.cuda.memory_allocated() - base, planned.allocator_bytes


def _allocated_by_the_model(frames: list[dict]) -> bool:
    """Whether the innermost Python frame is megatron_fsdp's or torch's optimizers' (not an
    activation kept by a test or a block allocated before recording started)."""
    innermost = next((f["filename"] for f in frames if f["filename"].endswith(".py")), "")
    return "/megatron_fsdp/" in innermost or "/torch/optim/" in innermost


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_planned_model_states_equal_what_the_model_allocated_after_the_first_step(strategy: str) -> None:
    for rank, (requested, planned, grown, planned_blocks) in enumerate(
        run_distributed(_states, nccl_world(), strategy, backend="nccl")
    ):
        assert requested == planned, f"rank {rank}: the model's live allocations asked for {requested} bytes, planned {planned}"
        assert planned_blocks <= grown <= 1.05 * planned_blocks, f"rank {rank}: the allocator grew by {grown}, planned {planned_blocks}"


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
