"""A real CUDA out-of-memory error, caught by Accelerate's find_executable_batch_size: from a
batch that does not fit the device it halves until one fits, and the sharded model then trains
bit for bit like a clean run at that batch size (issue 32). The model's activations grow with
the batch (two 1024 -> 16384 -> 1024 blocks, 256 KiB saved per row), so on an 80 GiB H100 2^19
rows run out of memory in forward, 2^18 in backward, and 2^17 fit; any GPU gets some sequence."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import megatron_fsdp
from _dist import nccl_world, run_distributed

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate"),
]

WIDTH, WIDE = 1024, 16384
STEPS = 2
START = 2**19


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDE)
        self.down = nn.Linear(WIDE, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _train(rank: int, world: int, settled: int | None) -> dict:
    from accelerate.utils import find_executable_batch_size

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).cuda()
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters(), lr=1e-4), fsdp_unit_modules=[Block])
    tried, failures = [], []

    def train(batch_size: int) -> list[float]:
        tried.append(batch_size)
        losses = []
        for step in range(STEPS):
            generator = torch.Generator(device="cuda").manual_seed(step * world + rank)
            inputs = torch.randn(batch_size, WIDTH, device="cuda", generator=generator)
            stage = "forward"
            try:
                loss = model(inputs).pow(2).mean()
                stage = "backward"
                loss.backward()
            except torch.OutOfMemoryError:
                failures.append((batch_size, stage))
                raise
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            del loss
        return losses

    if settled is None:
        size = {"rows": START}

        def halve() -> int:
            size["rows"] //= 2
            return size["rows"]

        losses = find_executable_batch_size(train, starting_batch_size=START, reduce_batch_size_fn=halve)()
    else:
        losses = train(settled)
    return {"tried": tried, "failures": failures, "losses": losses, "params": {k: v.cpu() for k, v in model.full_parameters().items()}}


def test_a_real_out_of_memory_error_settles_and_trains_like_a_clean_run() -> None:
    world = nccl_world()
    searched = run_distributed(_train, world, None, backend="nccl", timeout=500)[0]
    assert searched["failures"], f"no batch size ran out of memory: tried {searched['tried']}"
    settled = searched["tried"][-1]
    clean = run_distributed(_train, world, settled, backend="nccl", timeout=300)[0]
    print(f"tried {searched['tried']}, failed {searched['failures']}, settled at {settled} rows")
    assert searched["losses"] == clean["losses"], f"{searched['losses']} vs {clean['losses']}"
    for key, value in clean["params"].items():
        assert torch.equal(searched["params"][key], value), f"parameter {key} differs"
