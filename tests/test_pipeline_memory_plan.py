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
import json

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp.engine.planning.pipeline_stages import PipelineSpec, split_stages
from megatron_fsdp.engine.step.units import find_unit_modules
from megatron_fsdp.fsdp2 import fully_shard
from megatron_fsdp.fsdp2.state import shared_resources
from megatron_fsdp.plan_memory.command import main
from models import Block, make_batch, make_model
from test_fsdp2_pipelining import BLOCKS, DP, MICROBATCHES, PP, ROWS, WORLD, StageModel, _loss, _stage_models
from test_memory_plan import GPT_KWARGS, REPO, _live_storages, _meta_gpt


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


class _OrderOnlyStage:
    """What torch's multi-stage schedules read of a stage to order their actions: no process group."""

    def __init__(self, stage_index: int, stages: int, pp: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = stage_index, stages, pp, 0
        self.is_first, self.is_last = stage_index == 0, stage_index == stages - 1
        self.stage_index_to_group_rank = {index: index % pp for index in range(stages)}


def _torch_in_flight(schedule_cls: type, pp: int, virtual: int, micro_batches: int) -> list[int]:
    """Per pipeline rank, the most forwards not yet matched by their backward in torch's own order."""
    stages = [_OrderOnlyStage(k * pp, pp * virtual, pp) for k in range(virtual)]
    schedule = schedule_cls(stages, n_microbatches=micro_batches, loss_fn=_loss)
    peaks = []
    for rank in range(pp):
        outstanding = peak = 0
        for action in filter(None, schedule.pipeline_order[rank]):
            outstanding += {"F": 1, "B": -1}.get(action.computation_type.value, 0)
            peak = max(peak, outstanding)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("schedule_cls", [ScheduleInterleaved1F1B, ScheduleLoopedBFS], ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("pp, virtual, micro_batches", [(2, 2, 4), (2, 2, 6), (4, 2, 8), (4, 3, 4), (3, 2, 9)])
def test_multi_stage_schedules_keep_as_many_micro_batches_in_flight_as_torchs_order(
    schedule_cls: type, pp: int, virtual: int, micro_batches: int
) -> None:
    spec = PipelineSpec(pp, schedule_cls.__name__, micro_batches, virtual)
    assert [spec.in_flight(rank) for rank in range(pp)] == _torch_in_flight(schedule_cls, pp, virtual, micro_batches)


def test_single_stage_schedules_keep_all_or_pp_minus_rank_micro_batches_in_flight() -> None:
    assert [PipelineSpec(4, "GPipe", 6).in_flight(rank) for rank in range(4)] == [6, 6, 6, 6]
    assert [PipelineSpec(4, "Schedule1F1B", 6).in_flight(rank) for rank in range(4)] == [4, 3, 2, 1]


def test_layers_are_dealt_out_evenly_with_embeddings_first_and_the_head_last() -> None:
    """TinyGPT (position embedding a parameter of the root, head tied to the embedding): the
    first stage holds the embeddings, the last the final norm and the head, so the tied weight
    is held by both; interleaved stages go round the pipeline ranks."""
    with torch.device("meta"):
        model = make_model(layers=4)
    layers = find_unit_modules(model, (Block,), units_required=False)
    split = split_stages(model, layers, PipelineSpec(2, "1F1B", 2))
    outside = [sorted(n for n in held.params if not n.startswith("blocks.")) for held in split]
    assert outside == [["embed.weight", "pos"], ["embed.weight", "norm.bias", "norm.weight"]], outside
    assert [held.layers for held in split] == [("blocks.0", "blocks.1"), ("blocks.2", "blocks.3")]
    interleaved = split_stages(model, layers, PipelineSpec(2, "Interleaved1F1B", 2, virtual_stages=2))
    assert [(held.stages, held.layers) for held in interleaved] == [
        ((0, 2), ("blocks.0", "blocks.2")), ((1, 3), ("blocks.1", "blocks.3"))]


@pytest.mark.parametrize("layers, stages", [(126, 8), (32, 4), (80, 16), (61, 4), (3, 2)])
def test_the_torchtitan_split_deals_layers_as_torchtitan_does(layers: int, stages: int) -> None:
    """Against torchtitan's own default split (its stages' module names, counted)."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    theirs = [sum(name.startswith("layers.") for name in stage) for stage in _generate_llm_fqn_per_model_part(stages, layers)]
    assert list(PipelineSpec(stages, "GPipe", layer_split="torchtitan").layers_per_stage(layers)) == theirs


def test_an_uneven_split_gives_each_stage_its_layers_and_sizes_activations_by_the_largest() -> None:
    """Counts given for each stage: the layers go out in those runs, the ends as with an even
    split, and each rank's activations count its stage's layers (an interleaved rank's stage
    micro-batches each at its larger stage's)."""
    with torch.device("meta"):
        model = make_model(layers=6)
    layers = find_unit_modules(model, (Block,), units_required=False)
    split = split_stages(model, layers, PipelineSpec(2, "1F1B", 2, layer_split=(2, 4)))
    assert [(held.layers, held.stage_layers) for held in split] == [
        (("blocks.0", "blocks.1"), (2,)), (("blocks.2", "blocks.3", "blocks.4", "blocks.5"), (4,))]
    assert "embed.weight" in split[0].params and "norm.weight" in split[1].params
    with torch.device("meta"):
        model = StageModel([Block() for _ in range(6)], embeds=True, ends=True)
    plan = megatron_fsdp.plan_memory(model, 4, fsdp_unit_modules=[Block], pipeline_parallel_size=2,
                                     pipeline_schedule="Interleaved1F1B", micro_batches=2,
                                     pipeline_layer_split="1,2,2,1", activation_bytes_per_layer=1000)
    first, last = plan.for_rank(0), plan.for_rank(2)
    assert (first.stages, last.stages) == ((0, 2), (1, 3))
    assert first.stage_micro_batch_activations == last.stage_micro_batch_activations == 2 * 1000


class _Frequencies(nn.Module):
    """A module of buffers alone, outside the layers (a rotary embedding's), read by every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(16), persistent=False)


@pytest.mark.parametrize("schedule, virtual", [("1F1B", 1), ("Interleaved1F1B", 2)])
def test_every_stage_module_keeps_its_own_copy_of_buffers_outside_the_layers(schedule: str, virtual: int) -> None:
    """Registered after the head, the frequencies still go to every stage (each stage's layers
    read them; megatron_fsdp.simulate's stages hold them and torchtitan's keep their freqs_cis),
    once per stage module a rank holds: 64 bytes a stage."""
    with torch.device("meta"):
        model = StageModel([Block() for _ in range(BLOCKS)], embeds=True, ends=True)
        model.frequencies = _Frequencies()
    plan = megatron_fsdp.plan_memory(model, WORLD, fsdp_unit_modules=[Block], pipeline_parallel_size=PP,
                                     pipeline_schedule=schedule, micro_batches=PP, device_type="cpu")
    assert [plan.for_rank(rank).device["module buffers"] for rank in range(WORLD)] == [virtual * 16 * 4] * WORLD


def test_the_gathered_weights_and_the_activation_estimate_follow_the_policy_and_schedule() -> None:
    """False holds every unit gathered between micro-batches, True none; 1F1B's first stage
    keeps pp micro-batches of its layers' activations, the last one; GPipe all of them."""
    plans = {
        (schedule, raf): megatron_fsdp.plan_memory(
            _meta_model(), 8, fsdp_unit_modules=[Block], pipeline_parallel_size=2, pipeline_schedule=schedule,
            micro_batches=4, reshard_after_forward=raf, activation_bytes_per_layer=1000)
        for schedule in ("1F1B", "GPipe") for raf in (False, True)
    }
    first, last = (plans[("1F1B", False)].for_rank(rank) for rank in (0, 4))
    assert first.gathered_between_micro_batches == first.gathered_weights > 0
    assert plans[("1F1B", True)].for_rank(0).gathered_between_micro_batches == 0
    assert (first.activations, last.activations) == (2 * 2 * 1000, 1 * 2 * 1000)
    assert plans[("GPipe", False)].for_rank(4).activations == 4 * 2 * 1000
    assert plans[("1F1B", True)].for_rank(0).step_peak <= first.step_peak


@pytest.mark.parametrize("change, message", [
    (dict(pipeline_schedule="ZeroBubble"), "unknown pipeline schedule 'ZeroBubble': use one of GPipe, 1F1B"),
    (dict(pipeline_parallel_size=3, world_size=6), "3 x 1 = 3 stages do not divide the model's 4 layers evenly: pick "
     "sizes whose product divides 4, or deal them out unevenly"),
    (dict(pipeline_parallel_size=2, pipeline_layer_split=(1, 2)), r"layer split \[1, 2\] deals out 3 layers; the "
     "model has 4"),
    (dict(pipeline_parallel_size=2, pipeline_layer_split="4"), "give one count of at least 1 for each of the 2 stages"),
    (dict(pipeline_parallel_size=2, pipeline_layer_split="uneven"), "layer split 'uneven': give even or torchtitan"),
    (dict(pipeline_parallel_size=2, micro_batches=1), "Schedule1F1B needs at least as many micro-batches as stages"),
    (dict(pipeline_schedule="GPipe", virtual_stages=2), "ScheduleGPipe runs one stage a rank"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", micro_batches=5),
     "5 is not a multiple of its 2 rounds"),
    (dict(pipeline_parallel_size=3, pipeline_schedule="GPipe"), "world_size 8 is not divisible by pipeline_parallel_size 3"),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=3, tensor_parallel_plan={"blocks.*.up": "colwise"}),
     r"world_size 8 is not divisible by pipeline_parallel_size x tensor_parallel_size = 2 x 3 = 6 .*: "
     "tensor_parallel_size 1, 2 or 4"),
    (dict(pipeline_schedule="1F1B", pipeline_parallel_size=2, virtual_stages=0), "virtual_stages must be >= 1"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be >= 1"),
])
def test_bad_pipeline_choices_are_named_before_planning(change: dict, message: str) -> None:
    arguments = dict(world_size=8, fsdp_unit_modules=[Block], micro_batches=4) | change
    with pytest.raises(ValueError, match=message):
        megatron_fsdp.plan_memory(_meta_model(), **arguments)


def test_the_command_takes_pipeline_sizes_and_schedules(capsys) -> None:
    kwargs = json.dumps(GPT_KWARGS | {"layers": 4})
    common = ["--model", str(REPO / "examples/gpt_model.py") + ":gpt", "--model-kwargs", kwargs, "--units",
              "TransformerBlock", "--world-sizes", "8", "--strategies", "optim_grads_params", "--micro-batches", "4"]
    main(common + ["--pipeline-parallel-size", "1,2", "--pipeline-schedule", "Interleaved1F1B",
                   "--virtual-stages", "2", "--activation-mib-per-layer", "1", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    model, block = _meta_gpt(layers=4)
    for row in rows:
        plan = megatron_fsdp.plan_memory(model, 8, fsdp_unit_modules=[block], micro_batches=4, pipeline_parallel_size=row[
            "pp"], pipeline_schedule="Interleaved1F1B", virtual_stages=2, activation_bytes_per_layer=2**20)
        assert (row["model_states"], row["peak"]) == (plan.largest.device_model_states, plan.largest.step_peak), row
        assert (row["schedule"], row["virtual_stages"]) == ("Interleaved1F1B", 2), row
    with pytest.raises(SystemExit, match="unknown pipeline schedule 'dualpipe'"):
        main(common + ["--pipeline-parallel-size", "2", "--pipeline-schedule", "dualpipe"])
