"""nccl_ub: after the first optimizer step the pool's persistent buckets live in memory from
NCCL's allocator (ncclMemAlloc), registered with the communicator, and training is bit-for-bit the run with
fsdp_double_buffer alone (registration changes where buckets live, never the arithmetic).
NCCL, 2 GPUs, 1 on a one-GPU machine."""

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

STEPS = 4


def _in_segments(address: int, segments: list[dict]) -> bool:
    return any(s["address"] <= address < s["address"] + s["total_size"] for s in segments)


def _train(rank: int, world: int, strategy: int, comm: torch.dtype, nccl_ub: bool) -> dict:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=1024, seq_len=128, layers=4, hidden=256, heads=4, ffn=704)
    model = GPT(config).cuda().to(torch.bfloat16)
    policy = megatron_fsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=comm)
    model, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), fsdp_unit_modules=[TransformerBlock],
        zero_dp_strategy=strategy, mixed_precision_policy=policy, fsdp_double_buffer=True, nccl_ub=nccl_ub,
    )
    block = next(m for m in model.module.modules() if isinstance(m, TransformerBlock))
    gathered_at: list[int] = []
    # Registered after fully_shard's own pre-hook: sees the block's gathered weights.
    block.register_forward_pre_hook(lambda module, args: gathered_at.append(next(module.parameters()).data_ptr()))
    losses, reserved, segments_per_step = [], [], []
    generator = torch.Generator(device="cuda").manual_seed(rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1), device="cuda", generator=generator)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        reserved.append(model.pool.bytes_reserved())
        if nccl_ub:
            segments_per_step.append(model.user_buffers.mem_pool.snapshot())
    result = dict(losses=losses, reserved=reserved, params={n: p.cpu() for n, p in model.full_parameters().items()})
    if nccl_ub:
        segments = segments_per_step[-1]
        result.update(
            registered=model.user_buffers.registered,
            nccl_memory=model.user_buffers.uses_nccl_memory,
            segment_bytes=[sum(s["total_size"] for s in step) for step in segments_per_step],
            weights_in_nccl_memory=[_in_segments(address, segments) for address in gathered_at],
        )
    return result


@pytest.mark.parametrize("strategy,comm", [(3, torch.float32), (3, torch.bfloat16), (2, torch.float32)])
def test_nccl_ub_registers_the_buckets_and_trains_exactly_like_double_buffer(strategy: int, comm: torch.dtype) -> None:
    world = nccl_world()
    plain = run_distributed(_train, world, strategy, comm, False, backend="nccl")
    registered = run_distributed(_train, world, strategy, comm, True, backend="nccl")
    for rank, (reference, result) in enumerate(zip(plain, registered)):
        assert result["registered"], f"rank {rank}: the pool was never registered with NCCL"
        assert result["nccl_memory"], "NCCL 2.19+ is loaded: the buckets must come from ncclMemAlloc"
        assert result["losses"] == reference["losses"], f"rank {rank}: losses differ"
        for name, value in reference["params"].items():
            assert torch.equal(result["params"][name], value), f"rank {rank}: {name} differs after {STEPS} steps"
        assert result["reserved"] == reference["reserved"], "moving into NCCL memory must not change the pool's size"
        assert len(set(result["segment_bytes"])) == 1, f"NCCL memory grew after the first step: {result['segment_bytes']}"
        assert result["segment_bytes"][0] >= result["reserved"][0], "every pool block must fit in NCCL memory"
        if strategy == 3:  # weights are pooled buckets only under optim_grads_params
            in_nccl = result["weights_in_nccl_memory"]
            assert not in_nccl[0] and all(in_nccl[1:]), f"gathered weights in NCCL memory, per step: {in_nccl}"
