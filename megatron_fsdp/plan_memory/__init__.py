"""Know before you launch: the bytes each rank will hold, for any strategy, mesh and world size.

``plan_memory(model, world_size, ...)`` takes a model on the meta device and fully_shard's
choices (the mesh given as sizes, tensor-, context-, expert- and pipeline-parallel ones included)
and returns the largest rank's plan: model states by category on the device and the host,
padding, the working set's peak and, given the activations a layer keeps, an estimate of the
step's peak. Model states are exact (the engine's own layout); the working set is an upper
bound. No GPU and no process group needed.

``python -m megatron_fsdp.plan_memory`` prints the same as a table (command.py);
docs/memory_planning.md explains every column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import OffloadPolicy

from megatron_fsdp.engine.config import FSDPSettings, ShardingStrategy
from megatron_fsdp.engine.planning.memory_plan import (
    OptimizerSpec,
    PlanOptions,
    RankMemory,
    check_meta_model,
    describe,
)
from megatron_fsdp.engine.planning.model_parallel import ParallelSizes, TensorParallelPlan
from megatron_fsdp.engine.planning.model_plan import plan_model
from megatron_fsdp.engine.planning.owner_plan import check_whole_matrix_options, split_optimizers, typical_rank
from megatron_fsdp.engine.planning.pipeline_stages import PipelineSpec
from megatron_fsdp.engine.planning.plan import check_outer_strategy, resolve_offload
from megatron_fsdp.engine.step.units import resolve_unit_classes
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.optim.whole_tensors import needs_whole_tensors


@dataclass(frozen=True)
class MemoryPlan:
    """``largest``: the rank needing the most device memory (``step_peak``; with a whole-matrix
    optimizer, the most loaded owner); ``ranks``: every rank planned (ranks that cannot differ
    from one of them are left out); ``alike``: for each rank, the planned rank it holds alike
    with."""

    options: PlanOptions
    largest: RankMemory
    ranks: list[RankMemory]
    alike: tuple[int, ...]

    def for_rank(self, rank: int) -> RankMemory:
        """Global ``rank``'s plan (the planned rank it holds alike with: under plain HSDP, an
        outer rank holds what the first one holds; tensor-parallel ranks hold alike)."""
        if not 0 <= rank < self.options.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.options.world_size}")
        return next(memory for memory in self.ranks if memory.rank == self.alike[rank])

    @property
    def typical(self) -> RankMemory:
        """The median rank of the world by device need: under a whole-matrix optimizer (Muon),
        whose owners hold more than the others, what most ranks hold; else alike ``largest``."""
        return typical_rank(self.ranks, self.alike)

    def __str__(self) -> str:
        return describe(self.largest)


def plan_memory(
    module: nn.Module,
    world_size: int,
    *,
    dp_outer_size: int = 1,
    tensor_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    tensor_parallel_plan: TensorParallelPlan | None = None,
    fsdp_unit_modules: Sequence[type | str] | None = None,
    zero_dp_strategy: int | str = "optim_grads_params",
    outer_dp_sharding_strategy: int | str = "no_shard",
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    optimizer: str | OptimizerSpec | torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = "adamw",
    overlap_param_gather: bool = True,
    fsdp_double_buffer: bool = False,
    nccl_ub: bool = False,
    cpu_offload: bool = False,
    offload_policy: OffloadPolicy | None = None,
    report_nan_in_param_grad: bool = False,
    micro_batches: int = 1,
    deferred_reduction: bool | str = False,
    pipeline_parallel_size: int = 1,
    pipeline_schedule: str = "1F1B",
    virtual_stages: int | None = None,
    pipeline_layer_split: str | Sequence[int] = "even",
    reshard_after_forward: bool | None = None,
    activation_bytes_per_layer: int | None = None,
    device_type: str = "cuda",
) -> MemoryPlan:
    """The bytes each rank holds when ``module`` (on the meta device) is sharded by
    ``fully_shard`` with these arguments over ``world_size`` ranks, ``dp_outer_size`` of them
    replicas (HSDP; the mesh is ``(dp_outer, dp_shard)``). ``optimizer``: what keeps state per
    parameter (a name such as ``"adamw"``, a torch optimizer, or an :class:`OptimizerSpec`), or
    a whole-matrix optimizer with an elementwise one for the other parameters: ``"muon+adamw"``
    (torch's Muon on the 2-D parameters of the ``fsdp_unit_modules`` modules, AdamW on the rest)
    or a list of torch optimizers built over ``module``'s parameters, e.g.
    ``[torch.optim.Muon(matrices), torch.optim.AdamW(rest)]``; each matrix's momentum is then
    planned on its owner rank only (``MemoryPlan.largest`` is the most loaded owner,
    ``MemoryPlan.typical`` the median rank, ``RankMemory.owned_matrices`` each rank's count);
    ``device_type``: ``"cuda"`` or ``"cpu"`` (where step counters and pinned buffers live).
    ``micro_batches`` backward passes make one optimizer step; ``deferred_reduction=True`` (or
    ``"no_sync"``): all but the last run inside ``model.no_sync()`` or with
    ``set_model_auto_sync(False)``, so strategies 0/1 hold every bucket's un-reduced gradients
    between them (2/3 reduce-scatter every micro-batch either way);
    ``"requires_gradient_sync"``: FSDP2's ``set_requires_gradient_sync(False)``
    (``megatron_fsdp.fsdp2``), under which every strategy holds them
    (docs/sharding_strategies.md has the table).

    Model parallelism, Megatron-LM's sizes (ranks laid out tensor-parallel fastest; the world
    holds ``world_size / (tensor_parallel_size x context_parallel_size)`` data-parallel ranks):
    ``tensor_parallel_size`` splits the parameters ``tensor_parallel_plan`` names, which is
    ``{module FQN pattern: 'colwise' | 'rowwise' | ColwiseParallel() | RowwiseParallel()}`` for
    Linear and Embedding modules, as parallelize_module takes it, or ``{parameter FQN pattern:
    dim}``; patterns match name by name between the dots, with ``*``. Default (None):
    Megatron-LM's split by module names (attention q/k/v and MLP gate/up column-parallel, their
    output projections row-parallel, the token embedding and the output layer split over the
    vocabulary, the rest whole; ``model_parallel.megatron_style_plan``). The size must divide
    every split dim. ``context_parallel_size`` folds into the shard group (dp_shard x cp ranks
    share each shard; the parameters are whole on every CP rank). ``expert_parallel_size``:
    expert parameters (marked ``allreduce = False``, else those under an ``experts`` module)
    are dealt out over it, a ModuleList of experts in blocks, a grouped weight over its dim 0,
    and sharded over the ``world_size / (expert_parallel_size x expert_tensor_parallel_size)``
    ranks holding the same experts; ``expert_tensor_parallel_size`` (None: the tensor-parallel
    size, as Megatron-LM) splits the plan's expert parameters.

    Pipeline parallelism, as torch.distributed.pipelining runs it over stage modules each sharded
    by ``megatron_fsdp.fsdp2.fully_shard`` (pipeline ranks slowest: the world is pp x the mesh
    above): ``pipeline_parallel_size`` > 1 splits the layers (the outermost modules of
    ``fsdp_unit_modules``) over ``pipeline_parallel_size x virtual_stages`` stages, consecutive
    runs of them, what comes before the first layer going to the first stage and what comes
    after the last to the last (engine/planning/pipeline_stages.py); ``pipeline_layer_split``:
    ``"even"`` (default, as Megatron-LM), ``"torchtitan"`` (torchtitan's default: the embedding and
    the head count as a layer each, so 126 layers over 8 stages go 15, 16, ..., 16, 15), or a
    layer count for each stage; ``pipeline_schedule``: ``"GPipe"``, ``"1F1B"``
    (default), ``"Interleaved1F1B"`` or ``"LoopedBFS"`` (torch's ``Schedule<name>``) over
    ``micro_batches`` micro-batches; ``virtual_stages``: stages a rank (None: 1, or 2 for the
    interleaved schedules). Each planned rank holds its stages' model states (exact); every
    backward keeps the un-reduced gradients until the step's reduction, as PipelineStage asks.
    ``reshard_after_forward``: FSDP2's, for every unit (None: False under pipeline parallelism,
    as torchtitan passes it, else the door's default); False keeps a stage's weights gathered
    between its micro-batches. ``activation_bytes_per_layer``: what one micro-batch's
    activations take in one layer; given, each rank's plan estimates the activations the
    schedule keeps in flight and the step's peak (``RankMemory.activations``, ``step_peak``)."""
    pipeline = None
    if pipeline_parallel_size != 1 or virtual_stages not in (None, 1) or pipeline_schedule != "1F1B":
        pipeline = PipelineSpec(pipeline_parallel_size, pipeline_schedule, micro_batches, virtual_stages,
                                pipeline_layer_split)
    check_meta_model(module)
    strategy = ShardingStrategy.parse(zero_dp_strategy)
    outer = check_outer_strategy(outer_dp_sharding_strategy, strategy, "dp_outer" if dp_outer_size > 1 else None)
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    settings = FSDPSettings(
        strategy=strategy, mixed_precision=mixed_precision_policy or MixedPrecisionPolicy(),
        overlap_param_gather=overlap_param_gather, fsdp_double_buffer=fsdp_double_buffer or nccl_ub, nccl_ub=nccl_ub,
        report_nan_in_param_grad=report_nan_in_param_grad, **resolve_offload(cpu_offload, offload_policy),
    )
    unit_classes = resolve_unit_classes(fsdp_unit_modules)
    elementwise, whole_matrix = split_optimizers(optimizer, module, unit_classes, needs_whole_tensors)
    parallel = ParallelSizes(tensor_parallel_size, context_parallel_size, expert_parallel_size, expert_tensor_parallel_size)
    options = PlanOptions(
        world_size=world_size, settings=settings, outer_strategy=outer, outer_size=dp_outer_size,
        parallel=parallel, tensor_parallel_plan=tensor_parallel_plan,
        optimizer=OptimizerSpec.parse(elementwise), whole_matrix=whole_matrix, micro_batches=micro_batches,
        deferred_reduction=deferred_reduction, device_type=device_type, pipeline=pipeline,
        reshard_after_forward=reshard_after_forward, activation_bytes_per_layer=activation_bytes_per_layer,
    )
    if whole_matrix is not None:
        check_whole_matrix_options(whole_matrix, options)
    largest, ranks, alike = plan_model(module, unit_classes, options)
    return MemoryPlan(options, largest, ranks, tuple(alike))
