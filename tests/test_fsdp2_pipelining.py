"""torch's own pipelining (``torch.distributed.pipelining``) over stages sharded by
megatron_fsdp.fsdp2.fully_shard, against the same run over torch's ``fully_shard``: a 4-block
TinyGPT-like model cut into stages on a 2 x 2 ("pp", "dp") gloo mesh, each stage's blocks and the
stage sharded over "dp", ``PipelineStage`` driven by ``ScheduleGPipe``, ``Schedule1F1B`` (2 stages,
one a rank), ``ScheduleInterleaved1F1B`` and ``ScheduleLoopedBFS`` (4 stages, two a rank), 4 micro-batches a step, plain
AdamW built after sharding, the same data and seed.

Tolerance (fp32): losses and parameters after the steps within 1e-6 of each tensor's largest
entry. The two compute the same forward and backward on the same full weights and sum the same
two data-parallel gradients; what can differ is the order of those sums (our flat buckets against
FSDP2's per-parameter rows), last-bit rounding. A gradient not reduced over "dp", reduced twice
or scaled by the micro-batch count twice is O(1e-3) or more after one AdamW step. Measured: 0
(bit-equal) for every run below.

reshard_after_forward as torch's fully_shard honours it under pipelining: at the end of every stage
forward the same parameters are gathered (plain tensors, not DTensor shards) as under torch's,
all of the stage's under False and none under True.

Refused: a zero-bubble schedule (backward split into input and weight steps, which set ``.grad``
outside autograd's accumulation) raises our NotImplementedError naming the schedules that work,
on every rank, before any gradient reduction.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor

from _dist import run_distributed
from models import HIDDEN, VOCAB, Block, make_batch
from megatron_fsdp.fsdp2 import fully_shard

WORLD, PP, DP = 4, 2, 2
BLOCKS, MICROBATCHES, ROWS, STEPS, LR = 4, 4, 4, 2, 1e-2
RTOL = 1e-6
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
}
# Two stages a rank.
MULTI_STAGE = {"interleaved_1f1b", "looped_bfs"}


class StageModel(nn.Module):
    """Blocks ``first..last`` of the model; the first stage embeds tokens, the last ends in logits."""

    def __init__(self, blocks: list[Block], embeds: bool, ends: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN) if embeds else None
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(HIDDEN) if ends else None
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False) if ends else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def _stage_models(stages: int) -> list[StageModel]:
    """The same weights whatever the split: every module built once, in one order, from one seed."""
    torch.manual_seed(0)
    embed = nn.Embedding(VOCAB, HIDDEN)
    blocks = [Block() for _ in range(BLOCKS)]
    norm, head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
    per_stage = BLOCKS // stages
    models = []
    for index in range(stages):
        model = StageModel(blocks[index * per_stage : (index + 1) * per_stage], index == 0, index == stages - 1)
        if index == 0:
            model.embed = embed
        if index == stages - 1:
            model.norm, model.head = norm, head
        models.append(model)
    return copy.deepcopy(models)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _train(
    shard: Callable[..., nn.Module], schedule_name: str, reshard_after_forward: bool, mesh: DeviceMesh
) -> tuple[list[float], dict[str, torch.Tensor], list[tuple]]:
    """Losses, parameters after the steps, and at the end of each stage forward, which of the
    stage's parameters are gathered (plain tensors, not their DTensor shards)."""
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    interleaved = schedule_name in MULTI_STAGE
    stages = PP * 2 if interleaved else PP
    models = _stage_models(stages)
    local = [index for index in range(stages) if index % PP == pp_rank]
    pipeline_stages, optimizers, gathered = [], [], []
    for index in local:
        model = models[index]
        for block in model.blocks:
            shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        shard(model, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        model.register_forward_hook(lambda module, *_, index=index: gathered.append(
            (index, tuple(name for name, p in module.named_parameters() if not isinstance(p, DTensor)))))
        pipeline_stages.append(PipelineStage(model, index, stages, torch.device("cpu"), group=mesh["pp"].get_group()))
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=LR))
    schedule_cls = SCHEDULES[schedule_name]
    schedule = schedule_cls(
        pipeline_stages if interleaved else pipeline_stages[0], n_microbatches=MICROBATCHES, loss_fn=_loss
    )
    losses = []
    for step in range(STEPS):
        tokens, targets = make_batch(step * DP + dp_rank, ROWS)
        step_losses: list[torch.Tensor] = []
        if pp_rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=step_losses)
        losses += [loss.item() for loss in step_losses]
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    params = {}
    for index in local:
        for name, param in models[index].named_parameters():
            assert isinstance(param, DTensor), f"stage {index}'s {name} left unsharded after the step"
            params[f"{index}.{name}"] = param.full_tensor()
    return losses, params, gathered


def _pipelined_runs(rank: int, world: int, runs: list[tuple[str, bool]]) -> dict:
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    return {
        (name, raf, which): _train(shard, name, raf, mesh)
        for name, raf in runs
        for which, shard in (("ours", fully_shard), ("torch", torch_fully_shard))
    }


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


# Torchtitan's policy under PP (weights gathered between a stage's micro-batches) for every
# schedule; FSDP2's default (reshard after each forward) once.
RUNS = [("gpipe", False), ("1f1b", False), ("interleaved_1f1b", False), ("looped_bfs", False), ("1f1b", True)]


@pytest.fixture(scope="module")
def pipelined() -> list[dict]:
    return run_distributed(_pipelined_runs, WORLD, RUNS)


@pytest.mark.parametrize("schedule_name,reshard_after_forward", RUNS)
def test_pipeline_schedule_over_our_stages_matches_torch_fully_shard(
    pipelined: list[dict], schedule_name: str, reshard_after_forward: bool
) -> None:
    for rank, results in enumerate(pipelined):
        our_losses, our_params, our_gathered = results[(schedule_name, reshard_after_forward, "ours")]
        torch_losses, torch_params, torch_gathered = results[(schedule_name, reshard_after_forward, "torch")]
        # reshard_after_forward as FSDP2 honours it under pipelining: the same parameters
        # gathered at the end of every stage forward (False: all of them from the first on).
        assert our_gathered == torch_gathered, f"rank {rank}: gathered after forwards {our_gathered} vs {torch_gathered}"
        expected = {(index, () if reshard_after_forward else tuple(
            n.partition(".")[2] for n in our_params if n.startswith(f"{index}."))) for index, _ in our_gathered}
        assert len(our_gathered) >= MICROBATCHES and set(our_gathered) == expected, (
            f"rank {rank}: gathered after forwards {our_gathered}")
        assert len(our_losses) == len(torch_losses)
        loss_error = _relative_error(torch.tensor(our_losses), torch.tensor(torch_losses)) if our_losses else 0.0
        assert loss_error <= RTOL, f"rank {rank}: losses {our_losses} vs torch's {torch_losses}"
        assert our_params.keys() == torch_params.keys()
        errors = {name: _relative_error(our_params[name], torch_params[name]) for name in our_params}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= RTOL, f"rank {rank}: {worst} differs from torch's by {errors[worst]:.3g} (relative)"


def _split_backward_run(rank: int, world: int) -> str:
    """A zero-bubble schedule over two stages on each rank (a pipeline group of one: no
    point-to-point traffic to leave waiting): the error each rank raises."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    models = _stage_models(2)
    stages = []
    for index, model in enumerate(models):
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
        stages.append(PipelineStage(model, index, 2, torch.device("cpu"), group=mesh["pp"].get_group()))
    schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=2, loss_fn=_loss)
    tokens, targets = make_batch(rank, 2)
    try:
        schedule.step(tokens, target=targets)
    except NotImplementedError as error:
        return str(error)
    return "no error"


def test_split_backward_schedule_is_refused_on_every_rank_before_reducing() -> None:
    messages = run_distributed(_split_backward_run, 2)
    for rank, message in enumerate(messages):
        assert "gave none of its parameters a gradient" in message and "ScheduleInterleaved1F1B" in message, (
            f"rank {rank}: {message}"
        )
