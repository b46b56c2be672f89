"""torch.optim.Muon (the blocks' matrices) with AdamW (the rest) over NCCL, both doors, against
the same optimizers on one GPU: the owner exchanges (all-to-alls of uneven pieces; on a (dp, tp)
mesh the object all-gather of every rank's rectangles) run over NCCL here. Up to 4 GPUs; the
tensor-parallel case (dp 2 x tp 2, Colwise up, Rowwise down) needs 4.

Tolerance: LOOSE_RTOL on Muon's matrices, as tests/test_whole_matrix_optimizers.py explains (a
gradient summed in another order can round one bf16 entry of Muon's momentum the other way, and
Newton-Schulz spreads it); a matrix stepped on a piece, or a piece written back to the wrong place,
is off by its whole update (~1e-1). Each matrix must also be stepped on one rank only (of each tp
rank's dp group where tensor parallelism leaves it whole)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import megatron_fsdp
from _dist import nccl_world, run_distributed
from models import Block, make_batch, make_model
from test_whole_matrix_optimizers import LOOSE_RTOL, ROWS, STEPS, _is_matrix_in_block, _micro_batches, _optimizers, _relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WORLD = nccl_world(4)


def _one_gpu(dp_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    model = make_model(seed=0).to(device)
    optimizers = _optimizers(list(model.named_parameters()))
    for step in range(STEPS):
        tokens, targets = make_batch(step, dp_size * ROWS)
        model(tokens.to(device), targets.to(device)).backward()
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()
    return {name: param.detach().cpu() for name, param in model.named_parameters()}


def _sharded(rank: int, world: int, door: str, tensor_parallel: bool, device_type: str = "cuda") -> tuple[dict[str, float], list[str]]:
    """``device_type`` "cpu" runs the same on gloo (how this file's logic is checked without GPUs)."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    dp_size = 2 if tensor_parallel else world
    mesh = init_device_mesh(device_type, (dp_size, world // dp_size), mesh_dim_names=("dp", "tp"))
    model = make_model(seed=0).to(device)
    if tensor_parallel:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if door == "whole-model":
        muon, adamw = _optimizers(list(model.named_parameters()))
        tp = {"tp_dim": "tp"} if tensor_parallel else {}
        model, muon = megatron_fsdp.fully_shard(
            model, muon, device_mesh=mesh, dp_shard_dim="dp", fsdp_unit_modules=[Block], **tp
        )
        adamw = megatron_fsdp.fully_shard_optimizer(adamw, model=model)
    else:
        from megatron_fsdp.fsdp2 import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        muon, adamw = _optimizers(list(model.named_parameters()))
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(STEPS):
        tokens, targets = next(_micro_batches(step, dp_rank, dp_size, 1))
        model(tokens.to(device), targets.to(device)).backward()
        for optimizer in (muon, adamw):
            optimizer.step()
        for optimizer in (muon, adamw):
            optimizer.zero_grad()
    params = {name: value.full_tensor().cpu() for name, value in model.state_dict().items()}
    expected = _one_gpu(dp_size, device)
    errors = {name: _relative_error(params[name], want) for name, want in expected.items() if _is_matrix_in_block(name, want)}
    names = [name for name, param in make_model().named_parameters() if _is_matrix_in_block(name, param)]
    held = [name for name, param in zip(names, muon.param_groups[0]["params"]) if "momentum_buffer" in muon.state.get(param, {})]
    return errors, held


CASES = [("whole-model", False), ("fsdp2", False), ("whole-model", True), ("fsdp2", True)]


@pytest.mark.parametrize("door, tensor_parallel", CASES)
def test_muon_over_nccl_steps_like_one_gpu(door: str, tensor_parallel: bool) -> None:
    if tensor_parallel and WORLD < 4:
        pytest.skip("dp 2 x tp 2 needs 4 GPUs")
    results = run_distributed(_sharded, WORLD, door, tensor_parallel, backend="nccl")
    for rank, (errors, _) in enumerate(results):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= LOOSE_RTOL, f"rank {rank}: {worst} differs by {errors[worst]:.2e}; all: {errors}"
    copies = 1 if not tensor_parallel else 2  # a matrix TP leaves whole: one owner per tp rank
    for name in results[0][1] + [n for _, held in results[1:] for n in held]:
        holders = sum(name in held for _, held in results)
        wanted = 1 if tensor_parallel and (".up." in name or ".down." in name) else copies
        assert holders == wanted, f"{name} stepped on {holders} ranks, {wanted} wanted"
