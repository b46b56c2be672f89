"""One rank of a simulated world: the real wrap (``megatron_fsdp.fully_shard``, the whole-model
door) and two real training steps (forward, backward, optimizer step; the second after
``optimizer.zero_grad()``, the optimizer state held from its start, as every later step) under
torch's fake process group and ``FakeTensorMode``, with its allocations and collectives logged as
they happen."""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_fsdp.engine.planning.pipeline_stages import PipelineSpec
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.simulate.compute import ComputeLog
from megatron_fsdp.simulate.doors import OPTIMIZERS, TP_STYLES, ShardedRank, apply_tensor_parallel, check_door, shard
from megatron_fsdp.simulate.inventory import bucket_rows, categories, model_states
from megatron_fsdp.simulate.memory import POOL_LABEL, AllocationLog
from megatron_fsdp.simulate.observer import StepObserver
from megatron_fsdp.simulate import pipeline
from megatron_fsdp.simulate.pipeline import causal_lm_loss, shard_stages, stage_modules
from megatron_fsdp.simulate.report import STEP_PHASES, RankReport
from megatron_fsdp.simulate.traffic import CollectiveLog, count_difference
from megatron_fsdp.simulate.world import MeshSizes, build_expert_mesh, build_mesh, fake_world

logger = logging.getLogger(__name__)

def check_choices(optimizer: str, tensor_parallel_plan: dict[str, str] | None, mesh: MeshSizes) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: the simulator builds {', '.join(OPTIMIZERS)}")
    if mesh.tp > 1 and not tensor_parallel_plan:
        raise ValueError(f"tp={mesh.tp} needs a tensor_parallel_plan ({{module pattern: 'colwise'|'rowwise'}})")
    for pattern, style in (tensor_parallel_plan or {}).items():
        if style not in TP_STYLES:
            raise ValueError(f"tensor_parallel_plan[{pattern!r}] = {style!r}: use 'colwise' or 'rowwise'")


def check_steps(steps: int) -> None:
    if steps not in (1, 2):
        raise ValueError(f"steps={steps}: simulate 2 (the second step's peak is every later step's) or 1 (the first "
                         f"step only, before the optimizer state exists: its peak is lower)")


def default_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's own loss on ``tokens`` (as labels too); any other model's
    output (a tensor, or an object with ``.loss``) averaged."""
    module = getattr(model, "module", model)  # the whole-model door's wrapper holds the user's model
    if hasattr(module, "config") and hasattr(module, "generate"):
        return model(input_ids=tokens, labels=tokens).loss
    out = model(tokens)
    return out.loss if hasattr(out, "loss") else out.float().mean()


def expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module named ``experts``, as (name, module): its own parameters are the grouped
    expert weights (Hugging Face's fused layout, dim 0 the experts)."""
    return ((name, module) for name, module in model.named_modules() if name.rpartition(".")[2] == "experts")


def keep_local_experts(model: nn.Module, ep: int) -> None:
    """What an expert-parallel rank holds: of every module named ``experts``, 1/ep of the experts
    (its grouped weights' dim 0, Hugging Face's fused layout, as plan_memory deals them out), its
    ``num_experts`` set to match. On the meta device, before anything is allocated."""
    found = False
    for name, module in expert_modules(model):
        for key, param in list(module.named_parameters(recurse=False)):
            if param.dim() != 3 or param.shape[0] % ep:
                raise ValueError(f"{name}.{key} {tuple(param.shape)}: expert parallelism {ep} needs grouped expert "
                                 f"weights whose dim 0 (experts) it divides")
            shape = (param.shape[0] // ep, *param.shape[1:])
            setattr(module, key, nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta")))
        if hasattr(module, "num_experts"):
            module.num_experts //= ep
        found = True
    if not found:
        raise ValueError(f"ep={ep}: the model has no module named 'experts' to deal out")


def vocab_size(module: nn.Module) -> int:
    embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise ValueError("the model has no nn.Embedding to draw tokens for: pass loss_fn and build its inputs there")
    return embedding.num_embeddings


def simulate_rank(
    build_model: Callable[[], nn.Module],
    mesh: MeshSizes,
    rank: int = 0,
    *,
    fsdp_unit_modules: Sequence[type],
    zero_dp_strategy: str = "optim_grads_params",
    outer_dp_sharding_strategy: str = "no_shard",
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    optimizer: str = "adamw",
    tensor_parallel_plan: dict[str, str] | None = None,
    batch_size: int | None = None,
    seq_len: int = 4096,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = default_loss,
    door: str = "whole_model",
    pipeline_schedule: str = "1F1B",
    micro_batches: int | None = None,
    virtual_stages: int | None = None,
    pipeline_layer_split: str | Sequence[int] = "even",
    reshard_after_forward: bool | None = None,
    steps: int = 2,
) -> RankReport:
    """Rank ``rank`` of ``mesh.world_size``: builds ``build_model()`` (a model on the meta device)
    as fake tensors on the CPU, splits what ``tensor_parallel_plan`` names over the tp dim
    (``{module FQN pattern: 'colwise' | 'rowwise'}``, torch's parallelize_module), shards it
    through ``door`` (``"whole_model"``: ``fully_shard`` with the given strategy and precision;
    ``"fsdp2"``: megatron_fsdp's FSDP2 door; doors.py) with a torch optimizer (``adamw`` default,
    ``adam``, ``sgd``, ``sgd_momentum``), and runs forward, backward and ``optimizer.step()`` on a
    batch of ``batch_size`` (default 1) sequences of ``seq_len`` tokens (``loss_fn(model,
    tokens)``); under context parallelism (``mesh.cp`` > 1) the rank runs ``seq_len / cp`` of
    each. ``mesh.ep`` > 1 keeps 1/ep of every ``experts`` module's experts
    (:func:`keep_local_experts`) and gives ``fully_shard`` the expert mesh.

    ``mesh.pp`` > 1 (the FSDP2 door; pipeline.py): the rank builds its stages of a Hugging Face
    causal LM and runs torch's ``Schedule<pipeline_schedule>`` over ``micro_batches`` (default:
    the fewest the schedule runs) micro-batches of the ``batch_size`` (default: one a
    micro-batch) sequences, with ``virtual_stages`` stages a rank, the layers dealt out to them
    as ``pipeline_layer_split`` says (plan_memory's: ``"even"``, ``"torchtitan"`` or a count a
    stage), and FSDP2's
    ``reshard_after_forward`` (default False, as torchtitan passes it under PP); the loss is
    the last stage's cross-entropy.

    ``steps`` 2 (default): the step runs twice, ``optimizer.zero_grad()`` between, and the
    report's ``step_peak`` is the second's (the steady state's), ``first_step_peak`` the
    first's; the collectives and compute reported are the first step's, the second's checked
    to be the same (:func:`second_step`). ``steps`` 1: the first step only, its peak short of
    the optimizer state. Returns what the rank allocated and sent (:class:`RankReport`); a
    layout the engine refuses raises its error."""
    check_choices(optimizer, tensor_parallel_plan, mesh)
    check_steps(steps)
    check_door(door, mesh, zero_dp_strategy, outer_dp_sharding_strategy)
    if seq_len % mesh.cp:
        raise ValueError(f"seq_len {seq_len}: context parallelism {mesh.cp} gives each rank 1/{mesh.cp} of every "
                         f"sequence; pick a seq_len divisible by {mesh.cp}")
    spec = pipeline_spec(mesh, pipeline_schedule, micro_batches, virtual_stages, pipeline_layer_split, batch_size)
    batch_size = batch_size or (spec.micro_batches if spec else 1)
    local_seq = seq_len // mesh.cp
    started = time.perf_counter()
    with fake_world(rank, mesh.world_size):
        device_mesh = build_mesh(mesh)
        memory, traffic, compute = AllocationLog(), CollectiveLog(), ComputeLog()
        observer = StepObserver(memory, traffic, compute)
        # Built before the modes: meta tensors, nothing to log.
        if spec is not None:
            stages = stage_modules(build_model, fsdp_unit_modules, spec, mesh.pp_rank(rank))
            compute_dtype = next(stages[0].parameters()).dtype
            for stage in stages:
                stage.float()  # FSDP2's parameters are what the optimizer steps (doors.py)
            prepare = functools.partial(
                _pipeline_rank, stages, spec, device_mesh, mesh, rank, observer, fsdp_unit_modules=fsdp_unit_modules,
                compute_dtype=compute_dtype, optimizer=optimizer, tensor_parallel_plan=tensor_parallel_plan,
                reshard_after_forward=bool(reshard_after_forward), batch_size=batch_size, local_seq=local_seq)
        else:
            meta_model = build_model()
            if mesh.ep > 1:
                keep_local_experts(meta_model, mesh.ep)
            compute_dtype = next(meta_model.parameters()).dtype
            if door != "whole_model":
                meta_model.float()  # FSDP2's parameters are what the optimizer steps (doors.py)
            shard_options = dict(fsdp_unit_modules=fsdp_unit_modules, optimizer=optimizer, compute_dtype=compute_dtype,
                                 expert_mesh=build_expert_mesh(mesh) if mesh.ep > 1 else None)
            if door == "whole_model":
                shard_options |= dict(zero_dp_strategy=zero_dp_strategy, outer_dp_sharding_strategy=outer_dp_sharding_strategy,
                                      mixed_precision_policy=mixed_precision_policy)
            prepare = functools.partial(_model_rank, meta_model, device_mesh, mesh, observer, door, tensor_parallel_plan,
                                        loss_fn, (batch_size, local_seq), shard_options)
        with FakeTensorMode(allow_non_fake_inputs=True), observer.observing():
            sharded, step = prepare()
            step()
            first_peak = _peak_at(memory, _named_now(sharded))
            if steps == 2:
                second_step(sharded.optimizer, step, observer, traffic)
            del step, prepare  # the pipeline schedule's receive buffers with it: no model state
            report = _report(rank, mesh, door, zero_dp_strategy, outer_dp_sharding_strategy, sharded, memory, traffic,
                             compute, started, first_peak, steps)
            del sharded
    return report


def _model_rank(meta_model: nn.Module, device_mesh, mesh: MeshSizes, observer: StepObserver, door: str,
                tensor_parallel_plan: dict[str, str] | None, loss_fn, batch_shape: tuple[int, int],
                shard_options: dict) -> tuple[ShardedRank, Callable[[], None]]:
    """The whole model wrapped through ``door``, and a training step of it to run."""
    sharded = _wrap(meta_model, device_mesh, mesh, observer, door=door, tensor_parallel_plan=tensor_parallel_plan,
                    **shard_options)
    tokens = torch.randint(0, vocab_size(sharded.module), batch_shape)
    return sharded, functools.partial(run_step, sharded.model, sharded.optimizer, tokens, loss_fn, observer)


def _pipeline_rank(stages: list, spec: PipelineSpec, device_mesh, mesh: MeshSizes, rank: int, observer: StepObserver, *,
                   batch_size: int, local_seq: int, **shard_options) -> tuple[ShardedRank, Callable[[], None]]:
    """The rank's stage modules sharded (pipeline.py), and a training step to run: torch's
    schedule over them, then the optimizer's step."""
    config = stages[0].causal_lm.config
    observer.start_phase("wrap")
    pipe = shard_stages(stages, device_mesh, mesh, spec, mesh.pp_rank(rank),
                        micro_batch=(batch_size // spec.micro_batches, local_seq), hidden_size=config.hidden_size,
                        vocab_size=config.vocab_size, loss_fn=causal_lm_loss, **shard_options)
    stages.clear()
    tokens = torch.randint(0, config.vocab_size, (batch_size, local_seq))

    step = functools.partial(pipeline.pipeline_step, pipe.schedule, pipe.sharded.module, tokens, pipe.sharded.optimizer,
                             observer)
    return pipe.sharded, step


def pipeline_spec(mesh: MeshSizes, schedule: str, micro_batches: int | None, virtual_stages: int | None,
                  layer_split: str | Sequence[int], batch_size: int | None) -> PipelineSpec | None:
    """The pipeline as plan_memory takes it (None without pipeline parallelism); what the
    schedule cannot run raises with the planner's own words."""
    if mesh.pp == 1:
        return None
    spec = PipelineSpec(mesh.pp, schedule, 1, virtual_stages, layer_split)
    spec = PipelineSpec(mesh.pp, schedule, micro_batches or spec.fewest_micro_batches(), virtual_stages, layer_split)
    if problem := spec.micro_batch_problem():
        raise ValueError(problem)
    if batch_size is not None and batch_size % spec.micro_batches:
        raise ValueError(f"batch_size {batch_size}: the schedule splits it into {spec.micro_batches} micro-batches; "
                         f"give a multiple of {spec.micro_batches}")
    return spec


def _named_now(sharded: ShardedRank) -> dict[int, str]:
    """The model states' storages by category, what is garbage collected first."""
    gc.collect()
    return categories(sharded.units, sharded.module, sharded.optimizer)


def _peak_at(memory: AllocationLog, named: dict[int, str]) -> tuple[int, dict[str, int]]:
    """The step just run: its peak and what was live at it (:func:`_breakdown`)."""
    peak, at_peak = memory.live_at_peak(STEP_PHASES)
    return peak, _breakdown(at_peak, memory, named)


def second_step(optimizer: torch.optim.Optimizer, step: Callable[[], None], observer: StepObserver,
                first: CollectiveLog) -> None:
    """``optimizer.zero_grad()`` (set to None, torch's default, as a training loop calls it) and
    ``step`` again: the step every later one repeats, the optimizer state held from its start.
    Its collectives and compute are recorded apart; its collectives must be the first step's
    (counted: their order differs under forward prefetch, traffic.count_difference says why)."""
    with observer.recording_apart() as (second, _):
        observer.start_phase("zero_grad")
        optimizer.zero_grad()
        step()
    difference = count_difference(first.collectives, second.collectives, (*STEP_PHASES, "zero_grad"))
    if difference is not None:
        raise RuntimeError(f"the second simulated step issued other collectives than the first ({difference}): "
                           f"one step's record would not stand for every step; report this with the layout")


def _report(rank: int, mesh: MeshSizes, door: str, strategy: str, outer_strategy: str, sharded: ShardedRank,
            memory: AllocationLog, traffic: CollectiveLog, compute: ComputeLog, started: float,
            first_peak: tuple[int, dict[str, int]], steps: int) -> RankReport:
    """What the rank holds after the last step (model states by category), that step's peak and
    the first's, and the first step's collectives."""
    named = _named_now(sharded)
    peak, breakdown = _peak_at(memory, named)
    return RankReport(
        rank=rank, mesh=mesh, door=door, strategy=strategy, outer_strategy=outer_strategy,
        model_states=model_states(memory.live(), named), step_peak=peak, peak_breakdown=breakdown,
        first_step_peak=first_peak[0], first_step_breakdown=first_peak[1], steps=steps,
        pool_peak=sharded.pool.high_water_mark(),
        wrap_peak=memory.peak("wrap"), collectives=traffic.collectives, buckets=bucket_rows(sharded.units),
        compute=compute.segments, seconds=time.perf_counter() - started,
    )


def _wrap(meta_model: nn.Module, device_mesh, mesh: MeshSizes, observer: StepObserver, *, door: str,
          tensor_parallel_plan: dict[str, str] | None, **shard_options) -> ShardedRank:
    observer.start_phase("model")
    module = meta_model.to_empty(device="cpu")
    apply_tensor_parallel(module, device_mesh, mesh, tensor_parallel_plan)
    observer.start_phase("wrap")
    sharded = shard(door, module, device_mesh, mesh, **shard_options)
    gc.collect()
    return sharded


def run_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, loss_fn,
             observer: StepObserver) -> None:
    """Forward, backward and ``optimizer.step()``, each phase named to ``observer``."""
    def enter(phase: str) -> None:
        observer.start_phase(phase)
        logger.info("simulating the %s", phase)

    enter("forward")
    loss = loss_fn(model, tokens)
    enter("backward")
    loss.backward()
    del loss
    enter("optimizer step")
    optimizer.step()


def _breakdown(at_peak, memory: AllocationLog, named: dict[int, str]) -> dict[str, int]:
    """What was live at the step's peak: model states by category (those still held at the end),
    the pool's blocks by key, and the rest (activations and temporaries)."""
    live_now = memory.live()
    ids = {id(allocation): key for key, allocation in live_now.items()}
    breakdown: dict[str, int] = {}
    for allocation in at_peak:
        key = ids.get(id(allocation))
        if key is not None and key in named:
            kind = named[key]
        elif allocation.label.startswith(POOL_LABEL):
            kind = "pool " + allocation.label[len(POOL_LABEL):]
        else:
            kind = "activations and temporaries"
        breakdown[kind] = breakdown.get(kind, 0) + allocation.nbytes
    return breakdown
