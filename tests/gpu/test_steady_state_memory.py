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


# A size no allocation of the model below makes, so a segment of it is the block freed by hand.
FREED_BLOCK_BYTES = 42 * 2**20


def _freed_block_outlives_first_step(rank: int, world: int) -> bool:
    """Whether a device block freed between the first backward and the first optimizer step is
    still in torch's cache after that step."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1024, seq_len=512, layers=4, hidden=1024, heads=8, ffn=4096)
    model = GPT(config).cuda().to(torch.bfloat16)
    model, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.AdamW(model.parameters(), fused=True), fsdp_unit_modules=[TransformerBlock],
        mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32),
    )
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1), device="cuda")
    F.cross_entropy(model(tokens[:, :-1]).float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1)).backward()
    # As activations are: freed after backward, kept in torch's cache.
    freed = torch.empty(FREED_BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    del freed
    cached = any(segment["total_size"] == FREED_BLOCK_BYTES for segment in torch.cuda.memory_snapshot())
    assert cached, "the freed block should be in torch's cache before the step"
    optimizer.step()
    return any(segment["total_size"] == FREED_BLOCK_BYTES for segment in torch.cuda.memory_snapshot())


def test_first_step_state_does_not_take_memory_backward_freed() -> None:
    """The state the first step creates lives for the whole run; carved out of blocks the first
    backward freed, it would strand the rest of each (the 8.8B model on one H200 ran out of
    memory with 3 GiB so stranded). The cache goes back to the driver first, so the state takes
    blocks of its own and no cached block survives the step."""
    for outlived in run_distributed(_freed_block_outlives_first_step, nccl_world(), backend="nccl"):
        assert not outlived, "a block freed before the first optimizer step is still cached after it"
