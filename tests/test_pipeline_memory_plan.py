"""plan_memory under pipeline parallelism (issue 50, part 3): the model states planned for a
pipeline rank equal, to the byte, what it holds after a step of torch's ScheduleGPipe over its
stage sharded by megatron_fsdp.fsdp2.fully_shard (every live tensor storage that appeared since
before the stage was built, counted as tests/test_memory_plan.py counts them), and the gathered
weights held between micro-batches equal the bucket pool's bytes at the end of every forward of
the stage: the whole stage under reshard_after_forward=False (torchtitan's choice under PP),
nothing under True. The model, mesh and data are tests/test_fsdp2_pipelining.py's (PP2 x DP2 on
4 gloo ranks, 4 blocks, embedding on the first stage, norm and head on the last)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp.fsdp2 import fully_shard
from megatron_fsdp.fsdp2.state import shared_resources
from models import Block, make_batch
from test_fsdp2_pipelining import BLOCKS, DP, MICROBATCHES, PP, ROWS, WORLD, StageModel, _loss, _stage_models
from test_memory_plan import _live_storages


def _meta_model() -> nn.Module:
    """The whole model the stages are cut from, in the same registration order."""
    with torch.device("meta"):
        return StageModel([Block() for _ in range(BLOCKS)], embeds=True, ends=True)


def _held_and_planned(rank: int, world: int) -> dict[bool, dict]:
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    results = {}
    for reshard_after_forward in (False, True):
        plan = megatron_fsdp.plan_memory(
            _meta_model(), world, fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params",
            pipeline_parallel_size=PP, pipeline_schedule="GPipe", micro_batches=MICROBATCHES,
            reshard_after_forward=reshard_after_forward, optimizer="adamw", device_type="cpu",
        ).for_rank(rank)
        gc.collect()
        before = _live_storages()
        model = _stage_models(PP)[pp_rank]  # the other stage's modules are dropped here
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        pool = shared_resources().pool  # the modules' (held while they live)
        pool_before = pool.bytes_in_use()
        # Registered after fully_shard's own hooks: runs once the stage's forward has finished.
        after_forward: list[int] = []
        model.register_forward_hook(lambda *_: after_forward.append(pool.bytes_in_use() - pool_before))
        stage = PipelineStage(model, pp_rank, PP, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=_loss)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens, targets = make_batch(dp_rank, ROWS)
        schedule.step(tokens) if pp_rank == 0 else schedule.step(target=targets)
        optimizer.step()
        after_step = pool.bytes_in_use() - pool_before
        del schedule, stage, tokens, targets
        gc.collect()
        held = sum(nbytes for ptr, nbytes in _live_storages().items() if ptr not in before)
        results[reshard_after_forward] = dict(
            held=held, planned=plan.device_model_states + plan.host_model_states, stages=plan.stages,
            after_forward=after_forward, planned_between=plan.gathered_between_micro_batches, after_step=after_step,
        )
        del model, optimizer
    return results


@pytest.fixture(scope="module")
def held_and_planned() -> list[dict[bool, dict]]:
    return run_distributed(_held_and_planned, WORLD, timeout=300)


@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_planned_stage_model_states_equal_what_each_pipeline_rank_holds(held_and_planned, reshard_after_forward) -> None:
    wrong = []
    for rank, results in enumerate(held_and_planned):
        result = results[reshard_after_forward]
        assert result["stages"] == (rank // DP,), f"rank {rank} planned for stages {result['stages']}"
        if result["held"] != result["planned"]:
            wrong.append(f"rank {rank}: holds {result['held']} bytes, planned {result['planned']}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_planned_gathered_weights_follow_reshard_after_forward(held_and_planned, reshard_after_forward) -> None:
    """Under False every forward of the stage ends with all its units gathered (the first
    gathers them, the others find them so); under True with none. After the step's reduction
    (PipelineStage.perform_reduce_grad) nothing stays gathered either way."""
    for rank, results in enumerate(held_and_planned):
        result = results[reshard_after_forward]
        planned = result["planned_between"]
        assert (planned > 0) != reshard_after_forward, f"rank {rank}: planned {planned} bytes gathered between micro-batches"
        assert len(result["after_forward"]) >= MICROBATCHES, result["after_forward"]
        assert all(nbytes == planned for nbytes in result["after_forward"]), (
            f"rank {rank}: the pool held {result['after_forward']} bytes after the stage's forwards, planned {planned}")
        assert result["after_step"] == 0, f"rank {rank}: {result['after_step']} pool bytes still in use after the step"
