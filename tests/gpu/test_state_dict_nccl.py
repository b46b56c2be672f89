"""The state-dict DTensors on NCCL (2 GPUs, 1 on a one-GPU machine): ``full_tensor()`` of the
model state dict, torch's ``get_model_state_dict(full_state_dict=True)`` (on the GPU and
offloaded) and ``get_optimizer_state_dict(full_state_dict=True)`` give the values megatron_fsdp's
own gathers give, and ``set_model_state_dict`` of a full state dict (on every rank, or on rank 0
with ``broadcast_from_rank0``, also through the host) restores them exactly; with
CPU offloading the faces and the optimizer state are views of the host buffers (not device
copies that would go stale)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

import megatron_fsdp
from _dist import nccl_world, run_distributed
from models import Block, make_batch, make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _state_dicts(rank: int, world: int, strategy: int, offload: bool) -> dict:
    torch.cuda.set_device(rank)
    module = make_model(seed=0).cuda()
    model, optimizer = megatron_fsdp.fully_shard(
        module, torch.optim.AdamW(module.parameters(), lr=1e-2), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
        cpu_offload=offload,
    )
    for step in range(2):
        tokens, targets = make_batch(step, 2 * world)
        model(tokens[rank::world].cuda(), targets[rank::world].cuda()).backward()
        optimizer.step()
        optimizer.zero_grad()
    full = model.full_parameters()
    bad = []
    if offload:
        where = {v._local_tensor.device.type for e in optimizer.state.values() for v in e.values() if isinstance(v, DTensor)}
        where |= {p._local_tensor.device.type for p in model.parameters()}
        if where != {"cpu"}:
            bad.append(f"offloaded faces and optimizer state live on {where}, not only on the host")
    for name, value in model.state_dict().items():
        if name in full and not torch.equal(value.full_tensor().cpu(), full[name].cpu()):
            bad.append(f"state_dict()[{name!r}].full_tensor()")
    for offload in (False, True):
        helper = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
        if offload and rank != 0:
            continue  # offloaded full state dicts live on rank 0 only
        bad += [f"get_model_state_dict(cpu_offload={offload})[{k!r}]" for k, v in full.items() if not torch.equal(helper[k].cpu(), v.cpu())]
    names = {face: name for name, face in model.named_parameters()}
    expected_state = {
        names[face]: {k: v.full_tensor() for k, v in entries.items() if isinstance(v, DTensor)}
        for face, entries in optimizer.state.items()
    }
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))["state"]
    for name, entries in expected_state.items():
        bad += [f"optimizer {name}.{k}" for k, v in entries.items() if not torch.equal(optimizer_state[name][k].cpu(), v.cpu())]
    kept = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    kept = {k: v.clone() for k, v in kept.items()}
    loads = {
        "every rank's full state dict": StateDictOptions(full_state_dict=True),
        "rank 0's, broadcast": StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        "rank 0's, broadcast through the host": StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True),
    }
    for what, options in loads.items():
        tokens, targets = make_batch(7, 2 * world)
        model(tokens[rank::world].cuda(), targets[rank::world].cuda()).backward()
        optimizer.step()  # moves the parameters away from what was kept
        optimizer.zero_grad()
        given = {k: v.clone() for k, v in kept.items()} if rank == 0 or not options.broadcast_from_rank0 else {}
        set_model_state_dict(model, given, options=options)  # (torch writes into the dict it is given)
        restored = model.full_parameters()
        bad += [f"set_model_state_dict({what}) restored {k}" for k, v in full.items() if not torch.equal(restored[k], v)]
    return {"bad": bad, "compared": len(full)}


@pytest.mark.parametrize("strategy,offload", [(0, False), (3, False), (3, True)])
def test_full_state_dicts_on_nccl_give_the_parameters(strategy: int, offload: bool) -> None:
    for rank, result in enumerate(run_distributed(_state_dicts, nccl_world(), strategy, offload, backend="nccl", timeout=300)):
        assert result["compared"] > 0
        assert result["bad"] == [], f"rank {rank}, strategy {strategy}: {result['bad']}"
