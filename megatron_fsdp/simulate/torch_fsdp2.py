"""Torch's own FSDP2 (``torch.distributed.fsdp.fully_shard``) as one rank of a simulated world,
under the same fake process group, fake tensors, model, mesh and optimizer as ours.

Its memory is read by torch's ``FSDPMemTracker`` (``torch.distributed._tools``, a private module,
present in torch 2.13; imported only here, with a clear error where it is missing). The allocation
log ours is measured by (memory.py) cannot see FSDP2's memory: FSDP2 frees a gathered parameter by
resizing its storage to nothing, and the tracker hooks those resizes. The collectives are read by
the same dispatch-level log as ours (traffic.py), so both sides' records are one type.

FSDP2 is called as torchtitan calls it: ``fully_shard`` on every unit, then the root; the
parameters held in the main-weight dtype (what the optimizer steps),
``MixedPrecisionPolicy(param_dtype=<the model's dtype>, reduce_dtype=<ours' gradient
communication dtype>)``; HSDP is a 2-D (dp_outer, dp_shard) mesh, tensor parallelism torch's
``parallelize_module`` over the tp dim before it. A unit's grouped expert weights (an MoE at
expert-parallel degree 1) are sharded on dim 1 where the FSDP mesh outnumbers the experts, as
torchtitan places them (:func:`expert_placement`). Under pipeline parallelism the rank builds
its stage modules as ours does (pipeline.py's cut and torch's schedule; only the ``fully_shard``
differs), each stage sharded as torchtitan shards it under PP: every layer, then the stage
module, ``reshard_after_forward=False``. Expert parallelism above 1 and several stages a rank
are not covered (refused).
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.simulate.compute import ComputeLog, ComputeSegment
from megatron_fsdp.simulate.doors import OPTIMIZERS, apply_tensor_parallel, fsdp2_mesh
from megatron_fsdp.simulate.inventory import BucketRow
from megatron_fsdp.simulate.observer import StepObserver
from megatron_fsdp.simulate.pipeline import causal_lm_loss, pipeline_step, stage_modules, stage_schedule
from megatron_fsdp.simulate.report import StepRecord, bucket_lines
from megatron_fsdp.simulate.runner import (
    check_choices, check_steps, default_loss, expert_modules, pipeline_spec, run_step, second_step, vocab_size,
)
from megatron_fsdp.simulate.traffic import Collective, CollectiveLog
from megatron_fsdp.simulate.world import MeshSizes, build_mesh, fake_world

@dataclass
class TorchFSDP2Report(StepRecord):
    """One rank of torch's FSDP2 after the wrap and ``steps`` training steps (StepRecord says
    which peak is which step's).

    ``model_states``: FSDPMemTracker's bytes by kind still live after the last step (``Sharded
    Param``, ``Sharded Grad``, ``OptState``, ``Buffer``); ``shard_bytes``: the same kinds summed
    from the tensors themselves (each DTensor's local storage, its padding included), the
    tracker's reference; ``step_peak`` and ``peak_breakdown``: the tracker's peak over the last
    step (the tracker entered again for it) and its kinds
    (``Unsharded Param``, ``All Gather``, ``Reduce Scatter``, ``Activation``, ``Temp``, ...);
    ``collectives``: every collective issued (traffic.py's record, as ours); ``groups``: FSDP2's
    parameter groups as bucket rows (a group's padded numel: every parameter's sharded dim, dim 0
    or a grouped expert weight's dim 1, padded to a multiple of the shard group); ``compute``: the
    compute between the collectives (compute.py, as ours), for the step-time model."""

    rank: int
    mesh: MeshSizes
    model_states: dict[str, int]
    shard_bytes: dict[str, int]
    step_peak: int
    peak_breakdown: dict[str, int]
    first_step_peak: int
    first_step_breakdown: dict[str, int]
    steps: int
    collectives: list[Collective] = field(repr=False)
    groups: list[BucketRow] = field(repr=False)
    seconds: float = 0.0
    compute: list[ComputeSegment] = field(default_factory=list, repr=False)

    def model_states_as_ours(self) -> dict[str, int]:
        """The model states under :class:`RankReport`'s kind names, for step_time.optimizer_bytes:
        FSDP2's sharded parameters are the main weights its optimizer steps (it keeps no compute
        copy: it casts as it gathers) and its sharded gradients, in the parameters' dtype, the main
        gradients the optimizer reads."""
        kinds = {"main weights": "Sharded Param", "main grads": "Sharded Grad", "optimizer state": "OptState",
                 "module buffers": "Buffer"}
        return {ours: self.shard_bytes.get(theirs, 0) for ours, theirs in kinds.items()}

    def to_dict(self) -> dict:
        return self.summary_dict(door="torch_fsdp2", shard_bytes=self.shard_bytes,
                                 groups=[row.__dict__ | {"padding": row.padding} for row in self.groups])

    def __str__(self) -> str:
        lines = self.summary_lines("torch's FSDP2 (memory by FSDPMemTracker)", "FSDPMemTracker's peak snapshot")
        lines += bucket_lines(self.groups, "parameter groups")
        return "\n".join(lines)


def torch_policy(policy: MixedPrecisionPolicy | None, compute_dtype: torch.dtype) -> tuple[torch.dtype, TorchMixedPrecisionPolicy]:
    """Ours' precision as FSDP2 takes it: (the parameters' storage dtype, its policy). FSDP2
    keeps gradients in the parameters' dtype, so ours' main-gradient dtype has no counterpart."""
    dtypes = (policy or MixedPrecisionPolicy()).resolve(compute_dtype)
    return dtypes.main_params, TorchMixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=dtypes.comm)


def _memory_tracker():
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    except ImportError as error:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker (a private "
            f"module, checked on torch 2.13): simulating torch's FSDP2 needs a torch that has it"
        ) from error
    return FSDPMemTracker


@contextmanager
def _propagation_in_a_fake_mode_of_its_own() -> Iterator[None]:
    """DTensor works out an op's output shape by running it on fake tensors of the global shape,
    in the fake mode already active when there is one (torch 2.13's ``_sharding_prop``). Under
    the simulation's mode FSDPMemTracker then counts those global-shape tensors as memory (every
    optimizer step on a sharded parameter briefly 'allocates' the whole parameter: 6.5 GB of
    phantom optimizer state at 2 layers of 8B). The tracker skips work done in another fake mode,
    so here DTensor gets a fresh one. Private to torch: where the hook is absent, nothing changes."""
    from torch.distributed.tensor import _sharding_prop

    original = getattr(_sharding_prop, "detect_fake_mode", None)
    if original is None:
        yield
        return
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


def expert_placement(unit: nn.Module, fsdp_ranks: int) -> Callable[[nn.Parameter], Shard | None] | None:
    """torchtitan's ``shard_placement_fn`` for a unit at expert-parallel degree 1: where the FSDP
    mesh's ranks (all of them, the replicas' too under HSDP, as torchtitan counts) outnumber an
    ``experts`` module's experts, its grouped weights are sharded on dim 1, so that dim 0 (the
    experts) is not padded up to the group; every other parameter keeps FSDP2's ``Shard(0)``.
    None (a plain ``fully_shard``) where nothing would be sharded on dim 1."""
    on_dim1 = {id(param) for _, experts in expert_modules(unit) for param in experts.parameters(recurse=False)
               if fsdp_ranks > getattr(experts, "num_experts", param.shape[0])}
    if not on_dim1:
        return None
    return lambda param: Shard(1) if id(param) in on_dim1 else None


def shard_module(module: nn.Module, units: Sequence[type], device_mesh, mesh: MeshSizes,
                 policy: TorchMixedPrecisionPolicy, reshard_after_forward: bool | None = None) -> list[nn.Module]:
    """``fully_shard`` on every unit (grouped experts placed by :func:`expert_placement`), then
    the root, with ``reshard_after_forward`` (None: FSDP2's default); returns them in that order."""
    fsdp_mesh = fsdp2_mesh(device_mesh, mesh)
    sharded = [m for m in module.modules() if isinstance(m, tuple(units))]
    for unit in sharded:
        placement = expert_placement(unit, fsdp_mesh.size())
        try:
            fully_shard(unit, mesh=fsdp_mesh, mp_policy=policy, shard_placement_fn=placement,
                        reshard_after_forward=reshard_after_forward)
        except NotImplementedError as error:
            if placement is None:
                raise
            raise ValueError(
                f"{type(unit).__name__}: the FSDP mesh's {fsdp_mesh.size()} ranks outnumber its experts, so its grouped "
                f"expert weights are sharded on dim 1 (as torchtitan places them), which torch {torch.__version__}'s "
                f"FSDP2 shards only evenly ({error}): pick a shard group that divides the experts' dim 1"
            ) from error
    fully_shard(module, mesh=fsdp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return [*sharded, module]


def _local_storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def shard_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The model states summed from the tensors (FSDPMemTracker's kinds): each parameter's and
    gradient's local storage (FSDP2's padded shard) and the optimizer's state tensors; kinds
    holding nothing left out, as the tracker's snapshot leaves them."""
    params = list(module.parameters())
    states = [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]
    found = {
        "Sharded Param": _local_storage_bytes(params),
        "Sharded Grad": _local_storage_bytes([p.grad for p in params if p.grad is not None]),
        "OptState": _local_storage_bytes(states),
        "Buffer": _local_storage_bytes(list(module.buffers())),
    }
    return {kind: nbytes for kind, nbytes in found.items() if nbytes}


def _unsharded_numel(param: DTensor, fsdp_dims: int) -> int:
    """A parameter's elements on this rank's tensor-parallel slice: its global numel divided by
    the sizes of the mesh dims (after FSDP2's ``fsdp_dims``) that shard it."""
    numel = param.numel()
    for size, placement in zip(param.device_mesh.shape[fsdp_dims:], param.placements[fsdp_dims:]):
        if isinstance(placement, Shard):
            numel //= size
    return numel


def parameter_groups(sharded: list[nn.Module], mesh: MeshSizes) -> list[BucketRow]:
    """FSDP2's parameter groups (each unit, then the root's own), read from the sharded
    parameters: a group's padded numel is its local shards' storage times the shard group."""
    fsdp_dims = 2 if mesh.dp_outer > 1 else 1
    rows, claimed = [], set()
    for module in sharded:
        params = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in params)
        shard_numel = sum(p.to_local().untyped_storage().nbytes() // p.element_size() for p in params)
        rows.append(BucketRow(
            unit="<root>" if module is sharded[-1] else type(module).__name__,
            dtype=str(params[0].dtype).removeprefix("torch.") if params else "-", params=len(params),
            numel=sum(_unsharded_numel(p, fsdp_dims) for p in params), padded_numel=shard_numel * mesh.dp_shard,
            shard_numel=shard_numel, group_size=mesh.dp_shard,
        ))
    return rows


def _lazy_init_before_tracking(root: nn.Module) -> None:
    """FSDP2's lazy init (at the first forward) pads each shard again unless its storage is the
    padded one, which it can tell only of a plain tensor: on fake tensors every parameter FSDP2
    pads (its sharded dim not a multiple of the shard group) gets a new storage there, which FSDPMemTracker
    would file under 'Activation' (and the shards under 'Sharded Param' short by as much). A real
    run does not do this, so it is done here, before the tracker starts. Private to torch, as the
    tracker is (it calls the same ``_get_fsdp_state``)."""
    root._get_fsdp_state()._lazy_init()


def _by_kind(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot's bytes by kind name (its keys are an enum and a "Total"), zeros left out."""
    return {getattr(kind, "value", kind): n for kind, n in snapshot.items() if kind != "Total" and n}


def simulate_torch_fsdp2(
    build_model: Callable[[], nn.Module],
    mesh: MeshSizes,
    rank: int = 0,
    *,
    fsdp_unit_modules: Sequence[type],
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    optimizer: str = "adamw",
    tensor_parallel_plan: dict[str, str] | None = None,
    batch_size: int | None = None,
    seq_len: int = 4096,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = default_loss,
    pipeline_schedule: str = "1F1B",
    micro_batches: int | None = None,
    virtual_stages: int | None = None,
    pipeline_layer_split: str | Sequence[int] = "even",
    reshard_after_forward: bool | None = None,
    steps: int = 2,
) -> TorchFSDP2Report:
    """Rank ``rank`` of ``mesh.world_size`` under torch's FSDP2 (the module's note): the same
    model, mesh, optimizer and step as :func:`simulate_rank`'s, FSDP2's ZeRO-3 (reshard after
    forward; HSDP replicas hold whole shards). ``mixed_precision_policy`` is ours, mapped by
    :func:`torch_policy`. ``mesh.pp`` > 1: the rank's stages of a Hugging Face causal LM under
    torch's schedule, with the pipeline options and defaults :func:`simulate_rank` takes
    (``reshard_after_forward`` False unless given; ``loss_fn`` unused: the last stage's
    cross-entropy). Raises ValueError for expert and context parallelism and for several stages
    a rank, which are not covered."""
    check_choices(optimizer, tensor_parallel_plan, mesh)
    check_steps(steps)
    if mesh.ep > 1:
        raise ValueError("torch's FSDP2 is simulated without expert parallelism: use ep=1")
    if mesh.cp > 1:
        # Ours runs 1/cp of each sequence a rank; this side would run all of it, silently unlike.
        raise ValueError("torch's FSDP2 is simulated without context parallelism: use cp=1")
    spec = pipeline_spec(mesh, pipeline_schedule, micro_batches, virtual_stages, pipeline_layer_split, batch_size)
    if spec is not None and spec.virtual_stages > 1:
        raise ValueError(f"virtual_stages={spec.virtual_stages}: FSDPMemTracker tracks one root module and a rank of "
                         f"{spec.schedule} holds {spec.virtual_stages} stage roots; simulate torch's FSDP2 with one "
                         f"stage a rank (a single-stage schedule: 1F1B, GPipe)")
    batch_size = batch_size or (spec.micro_batches if spec else 1)
    tracker_class = _memory_tracker()
    started = time.perf_counter()
    with fake_world(rank, mesh.world_size), _propagation_in_a_fake_mode_of_its_own():
        device_mesh = build_mesh(mesh)
        traffic, compute = CollectiveLog(), ComputeLog()
        observer = StepObserver(None, traffic, compute)
        roots = [build_model()] if spec is None else stage_modules(build_model, fsdp_unit_modules, spec, mesh.pp_rank(rank))
        compute_dtype = next(roots[0].parameters()).dtype
        params_dtype, policy = torch_policy(mixed_precision_policy, compute_dtype)
        # FSDP2's default (None: the root stays gathered, the units reshard) unless under PP.
        reshard = reshard_after_forward if reshard_after_forward is not None or spec is None else False
        sharded = []
        for root in roots:
            root.to(params_dtype)
            # Split and sharded on the meta device, as torchtitan does: FSDP2 makes a view of
            # every parameter for each rank of its group, a Python object each as fake tensors
            # (minutes at 4,096 ranks), far less on meta; and it joins its mesh to the
            # tensor-parallel one by locating this rank in a mesh tensor, which must be real.
            apply_tensor_parallel(root.causal_lm if spec else root, device_mesh, mesh, tensor_parallel_plan)
            sharded += shard_module(root, fsdp_unit_modules, device_mesh, mesh, policy, reshard)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode, observer.observing():
            observer.start_phase("model")
            for root in roots:
                root.to_empty(device="cpu")  # FSDP2 moves each shard to the new storage
                _lazy_init_before_tracking(root)
            module = roots[0] if spec is None else nn.ModuleList(roots)
            optim = OPTIMIZERS[optimizer](module.parameters())
            if spec is None:
                tokens = torch.randint(0, vocab_size(module), (batch_size, seq_len))
                step = functools.partial(run_step, module, optim, tokens, loss_fn, observer)
            else:
                config = roots[0].causal_lm.config
                tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len))
                # Held by the step alone: its receive buffers and last outputs go with it.
                schedule = stage_schedule(
                    roots, device_mesh, spec, mesh.pp_rank(rank), compute_dtype=compute_dtype,
                    micro_batch=(batch_size // spec.micro_batches, seq_len), hidden_size=config.hidden_size,
                    vocab_size=config.vocab_size, loss_fn=causal_lm_loss)
                step = functools.partial(pipeline_step, schedule, roots, tokens, optim, observer)
                del schedule
            tracker = tracker_class(roots[0], optim)
            with tracker, _micro_batches_tracked(tracker, roots[0]):
                step()
                gc.collect()
            first_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
            if steps == 2:
                tracker.reset_mod_stats()  # its per-module records refuse a second iteration otherwise
                with tracker, _micro_batches_tracked(tracker, roots[0]):  # its peak starts from the bytes live now
                    second_step(optim, step, observer, traffic)
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
            del tokens, step
            gc.collect()
            current = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
            report = TorchFSDP2Report(
                rank=rank, mesh=mesh,
                model_states=_by_kind(current), shard_bytes=shard_bytes(module, optim), step_peak=peak["Total"],
                peak_breakdown=_by_kind(peak), first_step_peak=first_peak["Total"],
                first_step_breakdown=_by_kind(first_peak), steps=steps,
                collectives=traffic.collectives, groups=parameter_groups(sharded, mesh),
                compute=compute.segments, seconds=time.perf_counter() - started,
            )
            del sharded, module, roots, optim
    _check_collectives_seen(report)
    return report


@contextmanager
def _micro_batches_tracked(tracker, root: nn.Module) -> Iterator[None]:
    """FSDPMemTracker's per-module records (which this simulator does not read: it reads the
    tracker's byte counts) refuse a root module's second forward within one tracked iteration,
    taking it for the next iteration; a pipeline stage's root runs one forward a micro-batch.
    So the root's record is dropped before each of its forwards (the record kept is the last
    micro-batch's, as ``reset_mod_stats`` keeps none); the byte counts are untouched. Entered
    inside the tracker, so this hook runs before the tracker's own (both prepended)."""
    def drop_record(module: nn.Module, args) -> None:
        tracker.memory_tracking.pop(module, None)

    handle = root.register_forward_pre_hook(drop_record, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def _check_collectives_seen(report: TorchFSDP2Report) -> None:
    """Some torch versions' FSDPMemTracker replaced ``dist.all_gather_into_tensor`` under fake
    tensors and issued nothing: the step's traffic would read as zero, silently."""
    if report.mesh.dp_shard > 1 and not any(c.op == "all_gather" for c in report.collectives):
        raise RuntimeError(
            f"torch {torch.__version__}: FSDP2's all-gathers never reached the dispatcher under FSDPMemTracker, so its "
            "traffic cannot be read here; simulate torch's FSDP2 with a torch whose tracker dispatches them (2.13 does)"
        )
