"""A whole training step (forward, backward, optimizer step) of a model sharded by
``fully_shard`` captured in one CUDA graph and replayed: the losses and parameters equal the
same model's eager steps on the same batches, bit for bit (the replay runs the eager step's
kernels on the same addresses). torch's fused AdamW with ``capturable=True`` over fp32 main
gradients; the recipe is torch's for whole-network capture (docs/api.md, "CUDA graphs"). NCCL
over every GPU of the machine (1 on a one-GPU machine)."""

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

CONFIG = GPTConfig(vocab_size=1024, seq_len=128, layers=4, hidden=256, heads=4, ffn=704)
WARMUP, REPLAYS = 3, 5


def _model_and_optimizer():
    torch.manual_seed(0)
    model = GPT(CONFIG).cuda().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    policy = megatron_fsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=torch.float32)
    return megatron_fsdp.fully_shard(
        model, optimizer, fsdp_unit_modules=[TransformerBlock], mixed_precision_policy=policy
    )


def _batch(step: int, rank: int) -> torch.Tensor:
    """One of two fixed batches, alternating: the input changes at every replay, and the model
    can learn them in a few steps (random tokens would keep the loss at log(vocab))."""
    generator = torch.Generator(device="cuda").manual_seed(step % 2 * 100 + rank)
    return torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len + 1), device="cuda", generator=generator)


def _step(model, optimizer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().view(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _eager_and_captured(rank: int, world: int) -> dict:
    model, optimizer = _model_and_optimizer()
    eager = [_step(model, optimizer, _batch(step, rank)).item() for step in range(WARMUP + REPLAYS)]
    eager_params = {name: value.cpu() for name, value in model.full_parameters().items()}
    del model, optimizer

    model, optimizer = _model_and_optimizer()
    tokens = _batch(0, rank)
    captured = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(WARMUP):
            tokens.copy_(_batch(step, rank))
            captured.append(_step(model, optimizer, tokens).item())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = _step(model, optimizer, tokens)
    for step in range(WARMUP, WARMUP + REPLAYS):
        tokens.copy_(_batch(step, rank))
        graph.replay()
        captured.append(loss.item())
    captured_params = {name: value.cpu() for name, value in model.full_parameters().items()}
    return {"eager": eager, "captured": captured, "eager_params": eager_params, "captured_params": captured_params}


def test_a_captured_step_replays_the_eager_step_bit_for_bit() -> None:
    for result in run_distributed(_eager_and_captured, nccl_world(), backend="nccl"):
        assert result["captured"] == result["eager"], (result["captured"], result["eager"])
        assert result["eager"][-1] < result["eager"][0], f"did not train: {result['eager']}"
        for name, value in result["eager_params"].items():
            assert torch.equal(result["captured_params"][name], value), name
