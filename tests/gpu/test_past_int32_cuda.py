"""A unit of more than 2^31 elements trains on CUDA exactly as plain torch trains it (issue 60):
one Linear whose weight alone is past 2^31 fp32 elements, so its bias sits at a bucket offset past
2^31 and every op over the bucket (views, gradient copies, the reduction, the install of new
weights) takes sizes and offsets no int32 can hold. NCCL at the machine's world size; the
reference is the same model and data in one process.

Tolerance: exact. fp32 throughout (no cast), the same cuBLAS kernels on the same full weights in
forward and backward, and at world 1 the reduction of one rank's gradients is the gradients; SGD
without momentum is one multiply-add per element either way. At world > 1 the gradients are
averaged over the ranks' different batches (a sum then a division, in another order than one
process's mean over the whole batch), so the check loosens to fp32 rounding there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron_fsdp
from _dist import nccl_world, run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# 46,341^2 = 2,147,488,281 > 2^31 = 2,147,483,648: the weight alone passes int32, its bias starts after it.
WIDTH = 46_341
STEPS = 2
LR = 1e-2


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(step)
    inputs = torch.randn(2 * world, WIDTH, device="cuda", generator=generator)
    return inputs, torch.randn(2 * world, WIDTH, device="cuda", generator=generator)


def _train(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH))
    model.cuda()
    reference = {name: p.detach().clone() for name, p in model.named_parameters()} if rank == 0 else None
    model, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.SGD(model.parameters(), lr=LR), fsdp_unit_modules=[torch.nn.Linear],
        zero_dp_strategy="optim_grads_params",
    )
    bucket_numel = max(b.layout.padded_numel for unit in model.units for b in unit.buckets)
    losses = []
    for step in range(STEPS):
        inputs, targets = _batch(step, world)
        mine = slice(2 * rank, 2 * rank + 2)
        loss = F.mse_loss(model(inputs[mine]), targets[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    full = megatron_fsdp.full_state_dict(model)
    if rank != 0:
        return {"bucket_numel": bucket_numel}
    del model, optimizer
    torch.cuda.empty_cache()
    # The same steps in plain torch, from the same initial weights, over the whole batch.
    plain = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH)).cuda()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(reference[name])
    del reference
    sgd = torch.optim.SGD(plain.parameters(), lr=LR)
    plain_losses = []
    for step in range(STEPS):
        inputs, targets = _batch(step, world)
        loss = F.mse_loss(plain(inputs[:2]), targets[:2]) if world == 1 else F.mse_loss(plain(inputs), targets)
        loss.backward()
        sgd.step()
        sgd.zero_grad()
        plain_losses.append(loss.item())
    differences = {name: (full[name].cuda() - p.detach()).abs().max().item() for name, p in plain.named_parameters()}
    return {"bucket_numel": bucket_numel, "losses": losses, "plain_losses": plain_losses, "differences": differences}


def test_a_unit_past_int32_elements_trains_like_plain_torch() -> None:
    results = run_distributed(_train, nccl_world(), backend="nccl")
    first = results[0]
    assert first["bucket_numel"] > 2**31, f"the bucket holds {first['bucket_numel']} elements, not past 2^31"
    print("bucket elements", first["bucket_numel"], "losses", first["losses"], "plain", first["plain_losses"],
          "max |ours - plain|", first["differences"])
    tolerance = 0.0 if len(results) == 1 else 1e-6
    assert max(first["differences"].values()) <= tolerance, first["differences"]
    if len(results) == 1:
        assert first["losses"] == first["plain_losses"]
