"""One rank of a simulated world: the real wrap (``megatron_fsdp.fully_shard``, the whole-model
door) and one real training step (forward, backward, optimizer step) under torch's fake process
group and ``FakeTensorMode``, with its allocations and collectives logged as they happen."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.simulate.doors import OPTIMIZERS, ShardedRank, check_door, shard
from megatron_fsdp.simulate.inventory import bucket_rows, categories, model_states
from megatron_fsdp.simulate.memory import POOL_LABEL, AllocationLog
from megatron_fsdp.simulate.observer import StepObserver
from megatron_fsdp.simulate.report import STEP_PHASES, RankReport
from megatron_fsdp.simulate.traffic import CollectiveLog
from megatron_fsdp.simulate.world import MeshSizes, build_expert_mesh, build_mesh, fake_world

logger = logging.getLogger(__name__)

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def check_choices(optimizer: str, tensor_parallel_plan: dict[str, str] | None, mesh: MeshSizes) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: the simulator builds {', '.join(OPTIMIZERS)}")
    if mesh.tp > 1 and not tensor_parallel_plan:
        raise ValueError(f"tp={mesh.tp} needs a tensor_parallel_plan ({{module pattern: 'colwise'|'rowwise'}})")
    for pattern, style in (tensor_parallel_plan or {}).items():
        if style not in _STYLES:
            raise ValueError(f"tensor_parallel_plan[{pattern!r}] = {style!r}: use 'colwise' or 'rowwise'")


def default_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's own loss on ``tokens`` (as labels too); any other model's
    output (a tensor, or an object with ``.loss``) averaged."""
    module = getattr(model, "module", model)  # the whole-model door's wrapper holds the user's model
    if hasattr(module, "config") and hasattr(module, "generate"):
        return model(input_ids=tokens, labels=tokens).loss
    out = model(tokens)
    return out.loss if hasattr(out, "loss") else out.float().mean()


def keep_local_experts(model: nn.Module, ep: int) -> None:
    """What an expert-parallel rank holds: of every module named ``experts``, 1/ep of the experts
    (its grouped weights' dim 0, Hugging Face's fused layout, as plan_memory deals them out), its
    ``num_experts`` set to match. On the meta device, before anything is allocated."""
    found = False
    for name, module in model.named_modules():
        if name.rpartition(".")[2] != "experts":
            continue
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
    batch_size: int = 1,
    seq_len: int = 4096,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = default_loss,
    door: str = "whole_model",
) -> RankReport:
    """Rank ``rank`` of ``mesh.world_size``: builds ``build_model()`` (a model on the meta device)
    as fake tensors on the CPU, splits what ``tensor_parallel_plan`` names over the tp dim
    (``{module FQN pattern: 'colwise' | 'rowwise'}``, torch's parallelize_module), shards it
    through ``door`` (``"whole_model"``: ``fully_shard`` with the given strategy and precision;
    ``"fsdp2"``: megatron_fsdp's FSDP2 door; doors.py) with a torch optimizer (``adamw`` default,
    ``adam``, ``sgd``, ``sgd_momentum``), and runs forward, backward and ``optimizer.step()`` on a
    batch of ``batch_size`` x ``seq_len`` tokens (``loss_fn(model, tokens)``). ``mesh.ep`` > 1
    keeps 1/ep of every ``experts`` module's experts (:func:`keep_local_experts`) and gives
    ``fully_shard`` the expert mesh. Returns what the rank allocated and sent (:class:`RankReport`);
    a layout the engine refuses raises its error."""
    check_choices(optimizer, tensor_parallel_plan, mesh)
    check_door(door, mesh, zero_dp_strategy, outer_dp_sharding_strategy)
    started = time.perf_counter()
    with fake_world(rank, mesh.world_size):
        device_mesh = build_mesh(mesh)
        memory, traffic = AllocationLog(), CollectiveLog()
        observer = StepObserver(memory, traffic)
        meta_model = build_model()  # before the modes: meta tensors, nothing to log
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
        with FakeTensorMode(allow_non_fake_inputs=True), observer.observing():
            sharded = _wrap(meta_model, device_mesh, mesh, observer, door=door,
                            tensor_parallel_plan=tensor_parallel_plan, **shard_options)
            tokens = torch.randint(0, vocab_size(sharded.module), (batch_size, seq_len))
            run_step(sharded.model, sharded.optimizer, tokens, loss_fn, observer)
            del tokens
            gc.collect()
            named = categories(sharded.units, sharded.module, sharded.optimizer)
            peak, at_peak = memory.live_at_peak(STEP_PHASES)
            report = RankReport(
                rank=rank, mesh=mesh, door=door, strategy=zero_dp_strategy, outer_strategy=outer_dp_sharding_strategy,
                model_states=model_states(memory.live(), named), step_peak=peak,
                peak_breakdown=_breakdown(at_peak, memory, named),
                pool_peak=sharded.pool.high_water_mark(),
                wrap_peak=memory.peak("wrap"), collectives=traffic.collectives, buckets=bucket_rows(sharded.units),
                seconds=time.perf_counter() - started,
            )
            del sharded
    return report


def _wrap(meta_model: nn.Module, device_mesh, mesh: MeshSizes, observer: StepObserver, *, door: str,
          tensor_parallel_plan: dict[str, str] | None, **shard_options) -> ShardedRank:
    observer.start_phase("model")
    module = materialize(meta_model, device_mesh, mesh, tensor_parallel_plan)
    observer.start_phase("wrap")
    sharded = shard(door, module, device_mesh, mesh, **shard_options)
    gc.collect()
    return sharded


def materialize(meta_model: nn.Module, device_mesh, mesh: MeshSizes, tensor_parallel_plan: dict[str, str] | None) -> nn.Module:
    """``meta_model`` as fake CPU tensors (under the caller's ``FakeTensorMode``), what
    ``tensor_parallel_plan`` names split over the mesh's tp dim."""
    module = meta_model.to_empty(device="cpu")
    if mesh.tp > 1:
        split_tensor_parallel(module, device_mesh, tensor_parallel_plan)
    return module


def split_tensor_parallel(module: nn.Module, device_mesh, tensor_parallel_plan: dict[str, str]) -> None:
    """torch's ``parallelize_module`` over the mesh's tp dim, as ``tensor_parallel_plan`` names."""
    styles = {pattern: _STYLES[style]() for pattern, style in tensor_parallel_plan.items()}
    parallelize_module(module, device_mesh["tp"], styles)


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
