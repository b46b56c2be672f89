"""The plan of every rank of the mesh: which ranks can differ, what each holds under tensor,
expert and pipeline parallelism, and the activation estimate (memory_plan.py plans one rank's
bytes; pipeline_stages.py splits the model into stages)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from megatron_fsdp.engine.buckets.float8_weights import float8_gathered_weights, float8_gathers_blocked_by
from megatron_fsdp.engine.config import ShardingStrategy
from megatron_fsdp.engine.planning.memory_plan import (
    STAGE_ROOT_UNIT_NAME,
    PlanOptions,
    RankMemory,
    check_options,
    plan_buckets,
    plan_rank,
)
from megatron_fsdp.engine.planning.model_parallel import (
    IndivisibleMesh,
    LocalParams,
    RankPlace,
    expert_names,
    local_params,
    megatron_style_plan,
    resolve_split_dims,
)
from megatron_fsdp.engine.planning.pipeline_stages import StageContents, outermost_layers, split_stages
from megatron_fsdp.engine.step.units import ROOT_UNIT_NAME, find_unit_modules


def alike_ranks(options: PlanOptions, experts: bool) -> list[int]:
    """For each rank, the first rank holding alike: whose shard rank (each holds other padding),
    under HFSDP outer rank (each steps another part of each shard) and, with ``experts``,
    expert-data-parallel rank and experts are its own. Tensor-parallel ranks hold alike (the
    sizes divide every split dim), and so do the outer ranks of plain HSDP."""
    hfsdp = options.outer_strategy is ShardingStrategy.OPTIM
    first: dict[RankPlace, int] = {}
    alike = []
    for rank in range(options.world_size):
        place = options.place(rank)
        key = RankPlace(place.outer_rank if hfsdp else 0, place.shard_rank,
                        place.expert_shard_rank if experts else 0, place.expert_rank if experts else 0)
        alike.append(first.setdefault(key, rank))
    return alike


def _split_dims(module: nn.Module, options: PlanOptions) -> dict[str, int]:
    sizes, plan = options.parallel, options.tensor_parallel_plan
    if plan is None and sizes.tensor == sizes.etp == 1:
        return {}
    dims = resolve_split_dims(module, plan if plan is not None else megatron_style_plan(module))
    if plan is None and not dims:
        raise ValueError(
            "tensor parallelism was asked for, but Megatron-LM's split (by module names, model_parallel.py) finds "
            "no module of this model to split: give tensor_parallel_plan, e.g. {'layers.*.mlp.up': 'colwise'}"
        )
    return dims


class PlanRefused(ValueError):
    """Why a plan cannot be made, each with its fix, in the order to fix them: ``mesh`` (sizes
    whose product does not divide the world), other ``structural`` problems (the model, what the
    engine cannot shard), then ``schedule`` ones (the pipeline schedule's micro-batches)."""

    def __init__(self, mesh: list[str], structural: list[str], schedule: list[str]) -> None:
        self.mesh, self.structural, self.schedule = mesh, structural, schedule
        problems = mesh + structural + schedule
        super().__init__(problems[0] if len(problems) == 1 else
                         f"{len(problems)} problems:\n" + "\n".join(f"- {problem}" for problem in problems))


def plan_model(
    module: nn.Module, unit_classes: tuple[type, ...], options: PlanOptions,
) -> tuple[RankMemory, list[RankMemory], list[int]]:
    """The largest rank's plan, every planned rank's, and for each rank the planned rank it
    holds alike with (:func:`alike_ranks`). Under pipeline parallelism each pipeline rank's
    ranks (a slice of ``world_size / pp`` consecutive ranks) are planned for its stages.
    Raises :class:`PlanRefused` naming the first problem of the mesh or model and the schedule's."""
    problem = options.pipeline.micro_batch_problem() if options.pipeline is not None else None
    schedule = [problem] if problem else []
    try:
        planned = _plan_model(module, unit_classes, options)
    except IndivisibleMesh as error:
        raise PlanRefused([str(error)], [], schedule) from error
    except ValueError as error:
        raise PlanRefused([], [str(error)], schedule) from error
    if schedule:
        raise PlanRefused([], [], schedule)
    return planned


def _plan_model(
    module: nn.Module, unit_classes: tuple[type, ...], options: PlanOptions,
) -> tuple[RankMemory, list[RankMemory], list[int]]:
    check_options(options)
    pipeline = options.pipeline
    if pipeline is not None:
        check_pipeline_door(module, options)
    slice_options = options if pipeline is None else replace(options, world_size=options.world_size // pipeline.size)
    layers = find_unit_modules(module, unit_classes, units_required=False, log_absent=False)
    if pipeline is None:
        ranks, alike = _plan_slice(module, unit_classes, slice_options, None, len(outermost_layers(layers)))
    else:
        ranks, alike = [], []
        for pp_rank, held in enumerate(split_stages(module, layers, pipeline)):
            offset = pp_rank * slice_options.world_size
            stage_ranks, stage_alike = _plan_slice(module, unit_classes, slice_options, held, max(held.stage_layers),
                                                   pp_rank)
            for memory in stage_ranks:
                memory.rank += offset
            ranks += stage_ranks
            alike += [rank + offset for rank in stage_alike]
    largest = max(ranks, key=lambda m: (m.step_peak, m.host_model_states))
    return largest, ranks, alike


def check_pipeline_door(module: nn.Module, options: PlanOptions) -> None:
    """Under pipeline parallelism each stage module is sharded by FSDP2's door
    (megatron_fsdp.fsdp2, or megatron_fsdp.experimental's for megatron_fsdp's precision policy),
    which shards weights, gradients and optimizer state (optim_grads_params), has no HFSDP, no
    double buffer, no NaN report and no expert mesh: what it cannot run is refused, with the fix."""
    settings, refused = options.settings, []
    if settings.strategy is not ShardingStrategy.OPTIM_GRADS_PARAMS:
        refused.append(f"zero_dp_strategy {settings.strategy.label!r} (give 'optim_grads_params')")
    if options.outer_strategy is ShardingStrategy.OPTIM:
        refused.append("outer_dp_sharding_strategy 'optim' (give 'no_shard': plain HSDP over a 2-D mesh)")
    if settings.fsdp_double_buffer:
        refused.append("fsdp_double_buffer (leave it False)")
    if settings.report_nan_in_param_grad:
        refused.append("report_nan_in_param_grad (leave it False)")
    if expert_names(module, options.parallel):
        refused.append("expert parameters sharded over an expert mesh (plan them without pipeline parallelism, or "
                       "with expert_parallel_size 1 and expert_tensor_parallel_size unset on unmarked experts)")
    if refused:
        raise ValueError(
            "pipeline parallelism shards each stage module with FSDP2's door (megatron_fsdp.fsdp2.fully_shard), which "
            "runs optim_grads_params only, without an expert mesh; it cannot run: " + "; ".join(refused)
        )


def _plan_slice(
    module: nn.Module, unit_classes: tuple[type, ...], options: PlanOptions, held: StageContents | None,
    stage_layers: int, pp_rank: int = 0,
) -> tuple[list[RankMemory], list[int]]:
    """The planned ranks of one pipeline rank's slice of the world (the whole world without
    pipeline parallelism), holding ``held`` (None: the whole model), and its ``alike`` list;
    ``stage_layers``: the layers one micro-batch runs through in a stage module (the whole
    model's; under pipeline parallelism the largest of the rank's stages')."""
    outer_shards_optimizer = options.outer_strategy is ShardingStrategy.OPTIM and options.outer_size > 1
    float8 = float8_gathered_weights(module, float8_gathers_blocked_by(options.settings.cpu_offload, outer_shards_optimizer))
    split_dims, experts = _split_dims(module, options), expert_names(module, options.parallel)
    if experts:
        options.parallel.check_expert_groups(options.world_size, options.outer_size)
    # What a rank holds depends on which experts it holds, not on its tensor-parallel rank.
    by_expert_rank: dict[int, tuple[LocalParams, list]] = {}
    alike = alike_ranks(options, bool(experts))
    ranks = []
    for rank in sorted(set(alike)):
        expert_rank = options.place(rank).expert_rank
        if expert_rank not in by_expert_rank:
            local = local_params(module, options.parallel, split_dims, experts, expert_rank)
            if held is not None:
                local = replace(local, numels={n: k for n, k in local.numels.items() if n in held.params})
            # A stage module is sharded by FSDP2's door, which torch's pipelining runs over.
            root = ROOT_UNIT_NAME if held is None else STAGE_ROOT_UNIT_NAME
            whole = frozenset(options.whole_matrix.params) if options.whole_matrix else frozenset()
            by_expert_rank[expert_rank] = local, plan_buckets(
                module, unit_classes, options.settings.strategy, float8, local, root, whole)
        local, buckets = by_expert_rank[expert_rank]
        memory = plan_rank(buckets, module, options, rank, local.other_experts, held.buffers if held else None)
        _add_activations(memory, options, stage_layers, pp_rank)
        if held is not None:
            memory.stages = held.stages
        ranks.append(memory)
    return ranks, alike


def _add_activations(memory: RankMemory, options: PlanOptions, stage_layers: int, pp_rank: int) -> None:
    """The activation estimate: ``stage_layers`` layers' worth a stage micro-batch, over the
    stage micro-batches the schedule keeps in flight (one micro-batch without pipeline
    parallelism). Where a rank's stages differ in layers, each counts as its largest: an upper
    bound."""
    per_layer = options.activation_bytes_per_layer
    if per_layer is None:
        return
    pipeline = options.pipeline
    memory.stage_micro_batch_activations = per_layer * stage_layers
    memory.activations = memory.stage_micro_batch_activations * (pipeline.in_flight(pp_rank) if pipeline else 1)
