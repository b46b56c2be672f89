"""After warm-up a training step allocates no new device memory: the caching allocator, which
the bucket pool hands its blocks back to, needs no new segments, and with fsdp_double_buffer the
pool's persistent blocks stay the same (NCCL, 2 GPUs, 1 on a one-GPU machine)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

import megatron_fsdp
from _dist import nccl_world, run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from gpt_model import GPT, GPTConfig, TransformerBlock  # noqa: E402


def _memory_over_steps(rank: int, world: int, comm: torch.dtype, double_buffer: bool) -> dict:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1024, seq_len=256, layers=6, hidden=512, heads=8, ffn=1408)
    model = GPT(config).cuda().to(torch.bfloat16)
    policy = megatron_fsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=comm)
    model, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.AdamW(model.parameters(), fused=True), fsdp_unit_modules=[TransformerBlock], mixed_precision_policy=policy,
        fsdp_double_buffer=double_buffer,
    )
    snapshots = []
    for _ in range(10):
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1), device="cuda")
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        snapshots.append((stats["segment.all.allocated"], stats["reserved_bytes.all.current"], model.pool.bytes_reserved()))
    return {"snapshots": snapshots, "pool_high_water": model.pool.high_water_mark(), "peak": torch.cuda.max_memory_allocated()}


@pytest.mark.parametrize("double_buffer", [False, True])
@pytest.mark.parametrize("comm", [torch.float32, torch.bfloat16])
def test_steady_state_steps_allocate_nothing_new(comm: torch.dtype, double_buffer: bool) -> None:
    for result in run_distributed(_memory_over_steps, nccl_world(), comm, double_buffer, backend="nccl"):
        warm = result["snapshots"][3:]
        assert len(set(warm)) == 1, f"(cudaMalloc segments, reserved bytes, pool bytes) changed after warm-up: {warm}"
        pool_reserved = warm[-1][2]
        # Without double buffering every block went back to the caching allocator after the step.
        assert (pool_reserved > 0) == double_buffer, f"pool holds {pool_reserved} B between steps"
        print(comm, "pool high water", result["pool_high_water"], "peak allocated", result["peak"], "pool", warm[-1])
