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


def _free_bytes_beside_optimizer_state(rank: int, world: int) -> list[int]:
    """Per segment that holds an optimizer-state tensor of 16 MiB or more after the first step:
    the bytes of that segment not in use."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1024, seq_len=512, layers=4, hidden=1024, heads=8, ffn=4096)
    model = GPT(config).cuda().to(torch.bfloat16)
    model, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.AdamW(model.parameters(), fused=True), fsdp_unit_modules=[TransformerBlock],
        mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32),
    )
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1), device="cuda")
    F.cross_entropy(model(tokens[:, :-1]).float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1)).backward()
    # A block the caching allocator keeps after backward, as freed activations leave: 40 MiB,
    # room for two of the 16 MiB state tensors and a stranded rest.
    freed = torch.empty(40 * 2**20, dtype=torch.uint8, device="cuda")
    del freed
    optimizer.step()
    torch.cuda.synchronize()
    locals_ = [value.to_local() for entries in optimizer.state.values() for value in entries.values() if value.dim() > 0]
    states = {local.data_ptr() for local in locals_ if local.numel() * local.element_size() >= 16 * 2**20}
    assert states, "the model has no optimizer state of 16 MiB or more to check"
    free = []
    for segment in torch.cuda.memory_snapshot():
        blocks = segment["blocks"]
        if any(block["address"] in states for block in blocks):
            free.append(sum(block["size"] for block in blocks if block["state"] != "active_allocated"))
    return free


def test_optimizer_state_does_not_pin_freed_activation_memory() -> None:
    """The state the first step creates lives for the whole run; carved from blocks the first
    backward freed, it would strand the rest of each (the 8.8B model on one H200 ran out of
    memory with 3 GiB so stranded). Each of its large tensors gets a block of its own."""
    for free in run_distributed(_free_bytes_beside_optimizer_state, nccl_world(), backend="nccl"):
        # Carved out of the 40 MiB block, two 16 MiB tensors would strand 8 MiB. A tensor with
        # a block of its own strands nothing; one that took a free block in a segment still in use
        # before the step may strand that block's rest (2 MiB seen on an H100).
        assert max(free) < 8 * 2**20, f"free bytes beside optimizer state, per segment: {free}"
