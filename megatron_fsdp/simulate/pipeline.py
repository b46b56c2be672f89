"""Pipeline parallelism in a simulated rank, as plan_memory plans it and torchtitan runs it: the
rank builds only its stages' modules (a Hugging Face causal LM cut as engine/planning/
pipeline_stages.py splits it: the embedding on the first stage, the final norm and the head on
the last, the layers dealt out as the pipeline's layer split says), shards each through the FSDP2 door (its layers, then
the stage module, ``reshard_after_forward`` False by default, as torchtitan passes it under
PP), and runs torch's own schedule (``torch.distributed.pipelining.Schedule<name>`` over
``PipelineStage``) for every micro-batch of the step: the forwards and backwards in the
schedule's order, its activation and gradient sends and receives over the pp dim, and its one
gradient reduction a step (``PipelineStage.perform_reduce_grad``, answered by
megatron_fsdp/fsdp2/pipelining.py). Every micro-batch is run, none is extrapolated.

Every stage keeps the model's rotary embedding (a buffer each stage's layers read; torchtitan
keeps its ``freqs_cis`` on every stage too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed.pipelining as pipelining
import torch.distributed.pipelining.stage as pipelining_stage
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from megatron_fsdp.engine.planning.pipeline_stages import PipelineSpec, outermost_layers, split_stages
from megatron_fsdp.engine.step.units import FSDPUnit, find_unit_modules
from megatron_fsdp.fsdp2.state import shared_resources
from megatron_fsdp.simulate.observer import StepObserver
from megatron_fsdp.simulate.doors import OPTIMIZERS, ShardedRank, apply_tensor_parallel, fsdp2_mesh, fsdp2_shard
from megatron_fsdp.simulate.world import MeshSizes


class CausalLMStage(nn.Module):
    """One pipeline stage of a Hugging Face causal LM (``causal_lm.model`` the decoder with
    ``layers``, ``causal_lm.lm_head`` the head), cut down to the stage's layers: the first
    stage takes token ids, the others the previous stage's hidden states; the last returns the
    logits, the others hidden states."""

    def __init__(self, causal_lm: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.first, self.last = first, last

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        decoder = self.causal_lm.model
        given = dict(input_ids=inputs) if self.first else dict(inputs_embeds=inputs)
        # A training step keeps no key/value cache.
        hidden = decoder(**given, use_cache=False).last_hidden_state
        return self.causal_lm.lm_head(hidden) if self.last else hidden


def _check_causal_lm(model: nn.Module) -> None:
    decoder = getattr(model, "model", None)
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm")) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"pipeline parallelism cuts a Hugging Face causal LM (model.embed_tokens, model.layers, model.norm, lm_head) "
            f"into stages; {type(model).__name__} is not one: simulate it with pp=1"
        )


def stage_modules(build_model: Callable[[], nn.Module], units: Sequence[type], spec: PipelineSpec,
                  pp_rank: int) -> list[CausalLMStage]:
    """Pipeline rank ``pp_rank``'s stage modules (stages ``pp_rank``, ``pp_rank + pp``, ...), each
    from a fresh meta model cut to its layers. Raises when what they hold is not what
    plan_memory's split says the rank holds."""
    probe = build_model()
    _check_causal_lm(probe)
    layers = find_unit_modules(probe, tuple(units), units_required=False, log_absent=False)
    held = split_stages(probe, layers, spec)[pp_rank]  # refuses layers the stages do not divide
    names = outermost_layers(layers)
    stage_of_layer = spec.stage_of_layers(len(names))
    stages = []
    for stage in held.stages:
        model = build_model()
        decoder = model.model
        decoder.layers = nn.ModuleList(model.get_submodule(n) for n, s in zip(names, stage_of_layer) if s == stage)
        first, last = stage == 0, stage == spec.stages - 1
        if not first:
            decoder.embed_tokens = None
        if not last:
            decoder.norm, model.lm_head = nn.Identity(), None
        stages.append(CausalLMStage(model, first, last))
    canonical = dict(probe.named_parameters())
    planned = sorted(canonical[name].numel() for name in held.params)
    built = sorted(p.numel() for stage in stages for p in stage.parameters())
    if built != planned:
        raise RuntimeError(
            f"pipeline rank {pp_rank}'s stage modules hold {len(built)} parameters ({sum(built)} elements) where "
            f"plan_memory's split gives it {len(planned)} ({sum(planned)}): the stage cut and the plan disagree"
        )
    return stages


@dataclass
class PipelineRank:
    """The rank's sharded stage modules and torch's schedule over them."""

    sharded: ShardedRank
    schedule: PipelineScheduleSingle | PipelineScheduleMulti


def shard_stages(stages: list[CausalLMStage], device_mesh: DeviceMesh, mesh: MeshSizes, spec: PipelineSpec,
                 pp_rank: int, *, fsdp_unit_modules: Sequence[type], compute_dtype: torch.dtype, optimizer: str,
                 tensor_parallel_plan: dict[str, str] | None, reshard_after_forward: bool,
                 micro_batch: tuple[int, int], hidden_size: int, vocab_size: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> PipelineRank:
    """``stages`` (meta, float32) made fake CPU tensors, split by ``tensor_parallel_plan``, each
    sharded through the FSDP2 door over the shard dim, under torch's schedule of ``spec``
    (:func:`stage_schedule`), with one optimizer over them all.
    ``micro_batch``: (sequences, tokens) a micro-batch on this rank."""
    units: list[FSDPUnit] = []
    for stage_module in stages:
        stage_module.to_empty(device="cpu")
        apply_tensor_parallel(stage_module.causal_lm, device_mesh, mesh, tensor_parallel_plan)
        units += fsdp2_shard(stage_module, fsdp2_mesh(device_mesh, mesh), fsdp_unit_modules, compute_dtype,
                             reshard_after_forward)
    schedule = stage_schedule(stages, device_mesh, spec, pp_rank, compute_dtype=compute_dtype, micro_batch=micro_batch,
                              hidden_size=hidden_size, vocab_size=vocab_size, loss_fn=loss_fn)
    holder = nn.ModuleList(stages)
    optim = OPTIMIZERS[optimizer](holder.parameters())
    sharded = ShardedRank(holder, holder, optim, units, shared_resources().pool)
    return PipelineRank(sharded, schedule)


def stage_schedule(stages: list[CausalLMStage], device_mesh: DeviceMesh, spec: PipelineSpec, pp_rank: int, *,
                   compute_dtype: torch.dtype, micro_batch: tuple[int, int], hidden_size: int, vocab_size: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """Torch's schedule of ``spec`` over ``stages`` (sharded by either FSDP2: ours' door or
    torch's own), each wrapped in a ``PipelineStage`` over the pp dim of ``device_mesh``.
    ``micro_batch``: (sequences, tokens) a micro-batch on this rank."""
    group = device_mesh["pp"].get_group()
    pipeline_stages = []
    for stage_module, stage_index in zip(stages, spec.stages_of(pp_rank)):
        # Every shape given, so the stage infers none (which would exchange metadata objects).
        hidden = torch.empty(*micro_batch, hidden_size, dtype=compute_dtype)
        inputs = torch.zeros(micro_batch, dtype=torch.long) if stage_module.first else hidden
        outputs = torch.empty(*micro_batch, vocab_size, dtype=compute_dtype) if stage_module.last else hidden
        pipeline_stages.append(pipelining.PipelineStage(
            stage_module, stage_index, spec.stages, torch.device("cpu"), input_args=inputs, output_args=outputs,
            output_grads=None if stage_module.last else hidden, input_grads=None if stage_module.first else hidden,
            group=group))
    schedule_class = getattr(pipelining, f"Schedule{spec.schedule}")
    multi = spec.virtual_stages > 1
    schedule = schedule_class(pipeline_stages if multi else pipeline_stages[0], n_microbatches=spec.micro_batches,
                              loss_fn=loss_fn)
    _skip_warmup_vote(schedule, pipeline_stages)
    return schedule


def _skip_warmup_vote(schedule, stages: list) -> None:
    """torch 2.13's schedules open with a vote over P2P on whether every stage's shapes are
    static, read with ``.item()``, which a fake tensor cannot answer. Every stage here is given
    all its shapes, so the vote's answer is known: static. (Older torch has no vote.)"""
    mode = getattr(pipelining_stage, "InferenceMode", None)
    if mode is None or not hasattr(schedule, "_warmup_p2p"):
        return
    for stage in stages:
        stage._inference_mode = mode.STATIC
    schedule._warmup_p2p = lambda *args, **kwargs: None


def run_schedule(schedule: PipelineScheduleSingle | PipelineScheduleMulti, first: bool, last: bool,
                 tokens: torch.Tensor) -> None:
    """One step of the schedule: the first stage is fed the tokens, the last the targets (the
    tokens themselves, as a causal LM's loss takes its labels)."""
    if first and last:
        schedule.step(tokens, target=tokens)
    elif first:
        schedule.step(tokens)
    elif last:
        schedule.step(target=tokens)
    else:
        schedule.step()


def pipeline_step(schedule: PipelineScheduleSingle | PipelineScheduleMulti, stages: Sequence[CausalLMStage],
                  tokens: torch.Tensor, optimizer: torch.optim.Optimizer, observer: StepObserver) -> None:
    """A training step of the rank's ``stages``: torch's schedule over every micro-batch, then the
    optimizer's step, each phase named to ``observer``."""
    observer.start_phase("schedule")
    run_schedule(schedule, any(s.first for s in stages), any(s.last for s in stages), tokens)
    observer.start_phase("optimizer step")
    optimizer.step()


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the last stage's logits (in float32, as Hugging Face's loss upcasts)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
