"""The bytes each rank will hold, computed from the engine's own layout before anything exists.

The model is on the meta device; nothing is allocated and no process group is needed. Units,
buckets, padding and shard ranges come from the code that builds them (units.py,
bucket_geometry.py), so the model states planned here are exactly what a wrapped model holds
after its first optimizer step (tests/test_memory_plan.py compares them with every live tensor
of each rank). The transient working set (gathered weights, gradient buffers in flight) depends
on the step's timing and is planned as an upper bound.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron_fsdp.engine.buckets.bucket_geometry import BucketGeometry
from megatron_fsdp.engine.config import FSDPSettings, ShardingStrategy
from megatron_fsdp.engine.params.dtensor_params import local_tensor
from megatron_fsdp.engine.planning.model_parallel import (
    IndivisibleMesh,
    LocalParams,
    ParallelSizes,
    RankPlace,
    TensorParallelPlan,
    place_of,
)
from megatron_fsdp.engine.planning.owner_plan import WholeMatrixPart, add_whole_matrix_state
from megatron_fsdp.engine.planning.pipeline_stages import PipelineSpec
from megatron_fsdp.engine.step.units import ROOT_UNIT_NAME, assign_params_to_units, bucket_groups, find_unit_modules

# The CUDA caching allocator and the bucket pool hand out multiples of this many bytes.
ALLOCATION_GRANULE = 512

# The root unit of a pipeline stage module sharded by FSDP2's door (megatron_fsdp.fsdp2): its
# parameters outside the layers make one bucket per dtype, not one per module as the wrapper's.
STAGE_ROOT_UNIT_NAME = "<stage root>"

DEVICE_CATEGORIES = ("compute weights", "main weights", "main grads", "optimizer state", "module buffers", "bookkeeping")
HOST_CATEGORIES = ("main weights", "main grads", "optimizer state", "offload staging")


@dataclass(frozen=True)
class OptimizerSpec:
    """What a torch optimizer keeps per parameter piece: ``states`` tensors shaped like it (in
    ``state_dtype``, or the main-parameter dtype when None) and, for Adam-like optimizers, a
    float32 step counter on the host. ``stepped_by_kernels``: torch's Adam, AdamW and SGD, which
    megatron_fsdp's C++ ops step when the main gradients are of a lower dtype than the main
    params (optim/kernel_step.py), reading them as they are: no cast copy, no foreach temporary."""

    name: str
    states: int
    state_dtype: torch.dtype | None = None
    step_counter: bool = True
    stepped_by_kernels: bool = False

    KINDS = {
        "adamw": (2, True), "adam": (2, True), "adamw_amsgrad": (3, True), "adam_amsgrad": (3, True),
        "sgd": (0, False), "sgd_momentum": (1, False), "none": (0, False),
    }

    @classmethod
    def parse(cls, optimizer: str | OptimizerSpec | torch.optim.Optimizer | None) -> OptimizerSpec:
        """From a name (``adamw``, ``adam``, ``adamw_amsgrad``, ``sgd``, ``sgd_momentum``,
        ``none``), a spec, or a torch optimizer whose defaults tell amsgrad and momentum."""
        if isinstance(optimizer, OptimizerSpec):
            return optimizer
        if optimizer is None:
            return cls("none", 0, step_counter=False)
        if isinstance(optimizer, torch.optim.Optimizer):
            return cls._from_instance(optimizer)
        if isinstance(optimizer, str) and optimizer.lower() in cls.KINDS:
            states, counter = cls.KINDS[optimizer.lower()]
            return cls(optimizer.lower(), states, step_counter=counter, stepped_by_kernels=optimizer.lower() != "none")
        raise ValueError(
            f"unknown optimizer {optimizer!r}: use one of {', '.join(cls.KINDS)}, 'muon+<one of those>', a torch "
            "optimizer (or a list: Muon and an elementwise one), or an OptimizerSpec(name, states, state_dtype) for "
            "another one"
        )

    @classmethod
    def _from_instance(cls, optimizer: torch.optim.Optimizer) -> OptimizerSpec:
        defaults = optimizer.defaults
        # The ops step exactly these classes, without capturable or differentiable updates.
        kernels = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD) and not any(
            group.get("capturable") or group.get("differentiable") for group in optimizer.param_groups)
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            amsgrad = bool(defaults.get("amsgrad"))
            name = type(optimizer).__name__.lower() + ("_amsgrad" if amsgrad else "")
            return cls(name, 3 if amsgrad else 2, stepped_by_kernels=kernels)
        if isinstance(optimizer, torch.optim.SGD):
            momentum = bool(defaults.get("momentum"))
            return cls("sgd_momentum" if momentum else "sgd", int(momentum), step_counter=False, stepped_by_kernels=kernels)
        raise ValueError(
            f"plan_memory does not know what {type(optimizer).__name__} keeps per parameter: pass "
            "optimizer=OptimizerSpec(name, states=<tensors per parameter>, state_dtype=...)"
        )


@dataclass(frozen=True)
class PlanOptions:
    """How the model is sharded: the settings a MegatronFSDP is built with, the mesh given as
    sizes, and what the plan cannot learn from those (the optimizer, micro-batches, the device).
    ``tensor_parallel_plan``: which parameters tensor parallelism splits on which dim
    (model_parallel.resolve_split_dims); None: Megatron-LM's split, found by module names."""

    world_size: int
    settings: FSDPSettings = field(default_factory=FSDPSettings)
    outer_strategy: ShardingStrategy = ShardingStrategy.NO_SHARD
    outer_size: int = 1
    parallel: ParallelSizes = field(default_factory=ParallelSizes)
    tensor_parallel_plan: TensorParallelPlan | None = None
    optimizer: OptimizerSpec = field(default_factory=lambda: OptimizerSpec.parse("adamw"))
    # A whole-matrix optimizer (Muon) over some parameters, ``optimizer`` over the rest
    # (owner_plan.py): each matrix's state on one owner rank.
    whole_matrix: WholeMatrixPart | None = None
    micro_batches: int = 1
    # How micro-batches before the last hold back (DEFERRED_REDUCTIONS).
    deferred_reduction: bool | str = False
    device_type: str = "cuda"
    # Pipeline parallelism (pipeline_stages.py): the world is pp x the mesh above, pp slowest.
    pipeline: PipelineSpec | None = None
    # FSDP2's reshard_after_forward for every unit; None: the door's default (units True, the
    # root False), except under pipeline parallelism: False, as torchtitan passes it there.
    reshard_after_forward: bool | None = None
    # What one micro-batch's activations take in one layer (kept for backward): the activation
    # estimate's unit. None: no estimate.
    activation_bytes_per_layer: int | None = None

    @property
    def shard_size(self) -> int:
        """The group dense parameters are sharded over: dp_shard x cp."""
        return self.parallel.data_parallel_ranks(self.world_size) // self.outer_size

    @property
    def expert_shard_size(self) -> int:
        """The group expert parameters are sharded over: the ranks holding the same experts."""
        return self.parallel.expert_data_parallel_size(self.world_size)

    def place(self, rank: int) -> RankPlace:
        return place_of(rank, self.world_size, self.outer_size, self.parallel)

    @property
    def stays_gathered(self) -> bool:
        """Whether units keep their weights gathered from forward into backward."""
        if self.reshard_after_forward is None:
            return self.pipeline is not None
        return not self.reshard_after_forward

    @property
    def accumulates_locally(self) -> bool:
        """Whether every bucket's un-reduced gradients stay between micro-batches. A pipeline
        stage (torch's PipelineStage) turns gradient sync off for every backward and reduces
        once a step, in ``perform_reduce_grad``."""
        if self.pipeline is not None:
            return True
        if self.micro_batches == 1 or not self.deferred_reduction:
            return False
        return self.deferred_reduction == "requires_gradient_sync" or not self.settings.strategy.shards_grads


# What micro-batches before the last do (docs/sharding_strategies.md's accumulation table):
# False: each synchronises; True or "no_sync": they run inside no_sync() or with auto-sync off,
# so strategies 0/1 hold every bucket's un-reduced gradients and 2/3 reduce-scatter each time;
# "requires_gradient_sync": FSDP2's set_requires_gradient_sync(False) (megatron_fsdp.fsdp2),
# under which every strategy holds them.
DEFERRED_REDUCTIONS = (False, True, "no_sync", "requires_gradient_sync")


@dataclass
class RankMemory:
    """One rank's planned bytes. ``device``/``host``: model states by category, held from the
    first optimizer step on; ``gathered_weights``/``grad_buffers``: the transient working set at
    its peak (an upper bound); ``padding``: how much of the device model states is padding."""

    rank: int
    device: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DEVICE_CATEGORIES, 0))
    host: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HOST_CATEGORIES, 0))
    pinned_host: int = 0
    padding: int = 0
    allocator_bytes: int = 0  # the device model states as the CUDA caching allocator rounds each tensor
    gathered_weights: int = 0
    grad_buffers: int = 0
    # What the optimizer step allocates on top while it runs: torch's foreach Adam keeps one
    # temporary the size of its state (the square roots of the second moments).
    optimizer_step: int = 0
    # Pipeline stages this rank holds (empty without pipeline parallelism).
    stages: tuple[int, ...] = ()
    # Gathered weights held from one micro-batch to the next (reshard_after_forward=False:
    # every unit's; exact), and at the activations' peak, the end of a forward (an upper bound).
    gathered_between_micro_batches: int = 0
    gathered_at_activation_peak: int = 0
    # The activation estimate (activation_bytes_per_layer x layers x micro-batches in flight),
    # and one stage micro-batch's share of it; None: not estimated.
    activations: int | None = None
    stage_micro_batch_activations: int = 0
    # Matrices of a whole-matrix optimizer (Muon) this rank owns: steps whole and keeps the state of.
    owned_matrices: int = 0

    @property
    def device_model_states(self) -> int:
        return sum(self.device.values())

    @property
    def host_model_states(self) -> int:
        return sum(self.host.values())

    @property
    def working_set(self) -> int:
        return self.gathered_weights + self.grad_buffers

    @property
    def device_total(self) -> int:
        """Model states and the larger of the working set's peak and the optimizer step's
        temporaries: what the device needs besides activations (which the working set meets,
        in forward and backward)."""
        return self.allocator_bytes + max(self.working_set, self.optimizer_step)

    @property
    def step_peak(self) -> int:
        """An estimate of the step's peak with activations (``device_total`` when they are not
        estimated): model states, gradient buffers, and the larger of the activations' peak with
        the weights gathered then, and the whole gathered set once a backward has gathered it
        (one stage micro-batch's activations already freed)."""
        activations = self.activations or 0
        forward = activations + self.gathered_at_activation_peak
        backward = max(0, activations - self.stage_micro_batch_activations) + self.gathered_weights
        return self.allocator_bytes + max(self.optimizer_step, self.grad_buffers + max(forward, backward))

    def merge(self, other: RankMemory, times: int) -> None:
        """Adds ``times`` copies of ``other``'s model states (a bucket repeated in every layer)."""
        for category, nbytes in other.device.items():
            self.device[category] += nbytes * times
        for category, nbytes in other.host.items():
            self.host[category] += nbytes * times
        self.pinned_host += other.pinned_host * times
        self.optimizer_step += other.optimizer_step * times
        self.padding += other.padding * times
        self.allocator_bytes += other.allocator_bytes * times

    def add(self, location: str, category: str, nbytes: int, pinned: bool = False) -> None:
        """One tensor of ``nbytes``."""
        if location == "device":
            self.device[category] += nbytes
            self.allocator_bytes += _round_up(nbytes, ALLOCATION_GRANULE)
        else:
            self.host[category] += nbytes
            self.pinned_host += nbytes if pinned else 0


@dataclass(frozen=True)
class _BucketPlan:
    """One bucket as planned: its unit, its parameters' sizes, dtype and trainability."""

    unit: str
    numels: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    # torchao Float8Linear weights gathered in float8 (engine/buckets/float8_bucket.py).
    float8: bool = False
    # Expert parameters, sharded over the expert-data-parallel group.
    expert: bool = False
    # Per parameter: stepped by the whole-matrix optimizer (owner_plan.py), which keeps no state
    # of its pieces; empty: none is.
    whole_matrix: tuple[bool, ...] = ()
    names: tuple[str, ...] = field(default=(), compare=False)

    @property
    def shape(self) -> _BucketShape:
        """What its plan depends on: alike buckets (the same bucket of every layer) share it."""
        return self.numels, self.dtype, self.requires_grad, self.float8, self.expert, self.whole_matrix


_BucketShape = tuple[tuple[int, ...], torch.dtype, bool, bool, bool, tuple[bool, ...]]


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def check_meta_model(module: nn.Module) -> None:
    not_meta = [name for name, p in module.named_parameters() if not p.is_meta]
    if not_meta:
        raise ValueError(
            f"plan_memory needs a model on the meta device ({len(not_meta)} parameters are not, e.g. {not_meta[0]}): "
            "build it under `with torch.device('meta'):` so nothing is allocated"
        )


def check_options(options: PlanOptions) -> None:
    if options.world_size < 1 or options.outer_size < 1:
        raise ValueError(f"world_size and dp_outer_size must be >= 1, got {options.world_size} and {options.outer_size}")
    options.parallel.check()
    pipeline = options.pipeline.size if options.pipeline is not None else 1
    if problem := options.parallel.mesh_problem(options.world_size, options.outer_size, pipeline):
        raise IndivisibleMesh(problem)
    if options.outer_strategy is ShardingStrategy.OPTIM and options.outer_size == 1:
        raise ValueError("outer_dp_sharding_strategy='optim' needs dp_outer_size > 1")
    if options.micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {options.micro_batches}")
    if options.activation_bytes_per_layer is not None and options.activation_bytes_per_layer < 0:
        raise ValueError(f"activation_bytes_per_layer must be >= 0, got {options.activation_bytes_per_layer}")
    if not (isinstance(options.deferred_reduction, bool) or options.deferred_reduction in DEFERRED_REDUCTIONS):
        raise ValueError(
            f"deferred_reduction must be one of {', '.join(map(repr, DEFERRED_REDUCTIONS))}, got {options.deferred_reduction!r}"
        )


def plan_buckets(
    module: nn.Module,
    unit_classes: tuple[type, ...],
    strategy: ShardingStrategy,
    float8_dtypes: Mapping[nn.Parameter, torch.dtype] | None = None,
    local: LocalParams | None = None,
    root_unit: str = ROOT_UNIT_NAME,
    whole_matrix: frozenset[str] = frozenset(),
) -> list[_BucketPlan]:
    """The buckets fully_shard would build, unit by unit (the root unit first); ``float8_dtypes``:
    the weights it would gather in float8 (float8_weights.float8_gathered_weights); ``local``:
    what one rank holds of each parameter under tensor and expert parallelism (without it, each
    parameter's local tensor, and expert buckets planned over the dense group: the wrap-time
    check's approximation); ``root_unit``: the root unit's name (STAGE_ROOT_UNIT_NAME: FSDP2's
    door's buckets); ``whole_matrix``: the parameters a whole-matrix optimizer steps."""
    unit_modules = find_unit_modules(module, unit_classes, units_required=strategy.shards_weights, log_absent=False)
    assignment = assign_params_to_units(module, [m for _, m in unit_modules])
    names = {m: name for name, m in unit_modules}
    named = dict(module.named_parameters())
    numels = local.numels if local is not None else {n: local_tensor(p).numel() for n, p in named.items()}
    experts = {named[n] for n in local.experts} if local is not None else None
    buckets = []
    for owner, param_names in assignment.items():
        unit = root_unit if owner is None else names[owner]
        held = [(n, named[n]) for n in param_names if n in numels]
        for key, members in bucket_groups(unit, held, float8_dtypes or {}, experts).items():
            sizes = tuple(numels[n] for n, _ in members)
            expert = key.expert and local is not None
            whole = tuple(n in whole_matrix for n, _ in members) if whole_matrix else ()
            buckets.append(_BucketPlan(unit, sizes, key.dtype, key.requires_grad, key.float8 is not None, expert, whole,
                                       tuple(n for n, _ in members)))
    return buckets


def _geometry(shape: _BucketShape, options: PlanOptions, place: RankPlace) -> BucketGeometry:
    numels, dtype, requires_grad, float8, expert, _ = shape
    settings = options.settings
    rank, size, outer_size, outer_rank = place.shard_rank, options.shard_size, options.outer_size, place.outer_rank
    if expert:  # the expert-data-parallel group; under HSDP within each outer replica (distributed_index.py)
        size = options.expert_shard_size // outer_size
        outer_rank, rank = divmod(place.expert_shard_rank, size)
    return BucketGeometry.build(
        numels, dtype.itemsize, settings.alignment_bytes, rank, size, settings.strategy,
        settings.mixed_precision.resolve(dtype), requires_grad, settings.cpu_offload,
        outer_size=outer_size, outer_rank=outer_rank,
        outer_shards_optimizer=options.outer_strategy is ShardingStrategy.OPTIM, float8_weights=float8,
    )


def _compute_itemsize(geometry: BucketGeometry) -> int:
    """Bytes per compute-weight element: one for float8 weights."""
    return 1 if geometry.float8_weights else geometry.dtypes.compute.itemsize


def _add_bucket(
    memory: RankMemory, geometry: BucketGeometry, options: PlanOptions, kernel_step: bool, whole_matrix: tuple[bool, ...] = (),
) -> None:
    """The bucket's persistent tensors on this rank, as buffer.py and bucket_weights.py allocate
    them; ``kernel_step``: the C++ ops step the optimizer, reading low-precision main gradients as
    they are; ``whole_matrix``: the parameters whose state owner_plan.py plans instead."""
    dtypes = geometry.dtypes
    compute = _compute_itemsize(geometry)
    main, grads = dtypes.main_params.itemsize, dtypes.main_grads.itemsize
    if geometry.float8_weights:
        # A float32 scale per weight, and the one element the parameters expand as their stand-in.
        memory.add("device", "bookkeeping", 4 * len(geometry.layout.slots) + dtypes.compute.itemsize)
    weights = geometry.weight_range
    if weights is not None:
        memory.add("device", "compute weights", (weights[1] - weights[0]) * compute)
        memory.padding += geometry.padding_numel(*weights) * compute
    if options.settings.report_nan_in_param_grad:
        memory.add("device", "bookkeeping", len(geometry.layout.slots))  # one bool flag per parameter
    if not geometry.requires_grad:
        return
    main_start, main_end = geometry.main_range
    main_numel = main_end - main_start
    pinned = options.device_type == "cuda" and options.settings.offload_pin_memory
    if geometry.offloaded:
        memory.add("host", "main weights", main_numel * main)
        memory.add("host", "main grads", main_numel * main, pinned=pinned)
    else:
        if not geometry.main_params_alias_weights:
            memory.add("device", "main weights", main_numel * main)
            memory.padding += geometry.padding_numel(main_start, main_end) * main
        grad_start, grad_end = geometry.grad_range
        memory.add("device", "main grads", (grad_end - grad_start) * grads)
        memory.padding += geometry.padding_numel(grad_start, grad_end) * grads
        if geometry.splits_shard:
            memory.add("device", "main grads", main_numel * grads)  # the outer-reduced gradients
        if dtypes.main_grads != dtypes.main_params and not kernel_step:
            memory.add("device", "main grads", main_numel * main)  # what the optimizer reads, cast
    spec = options.optimizer
    state = spec.state_dtype.itemsize if spec.state_dtype is not None else main
    location = "host" if geometry.offloaded else "device"
    pieces = [piece for index, piece in enumerate(geometry.main_pieces()) if not whole_matrix or not whole_matrix[index]]
    if spec.step_counter and spec.states >= 2 and not geometry.offloaded and not kernel_step:
        memory.optimizer_step += sum(hi - lo for lo, hi in pieces) * state
    for lo, hi in pieces:
        for _ in range(spec.states):
            memory.add(location, "optimizer state", (hi - lo) * state)
        if spec.step_counter:
            # A float32 scalar on the host (torch's optimizers keep it there unless capturable or fused).
            memory.add("device" if options.device_type == "cpu" else "host", "optimizer state", 4)


def _working_set(memory: RankMemory, plans: list[tuple[_BucketPlan, BucketGeometry]], options: PlanOptions) -> None:
    """The transient peak: gathered units (optim_grads_params) and gradient buffers in flight."""
    if options.settings.strategy.shards_weights:
        held: dict[str, int] = defaultdict(int)  # each unit's gathered buckets
        copies: dict[str, int] = defaultdict(int)  # the shard copies its gathers start from, freed after
        for bucket, geometry in plans:
            compute = _compute_itemsize(geometry)
            held[bucket.unit] += _round_up(geometry.layout.padded_numel * compute, ALLOCATION_GRANULE)
            if geometry.gathers_from_main and geometry.layout.world_size > 1:
                copies[bucket.unit] += _round_up(geometry.layout.shard_numel * compute, ALLOCATION_GRANULE)
        per_unit = {unit: held[unit] + copies[unit] for unit in held}
        root = per_unit.pop(ROOT_UNIT_NAME, 0) + per_unit.pop(STAGE_ROOT_UNIT_NAME, 0)
        in_flight = 2 if options.settings.overlap_param_gather else 1
        forward = root + sum(sorted(per_unit.values(), reverse=True)[:in_flight])
        everything = sum(held.values()) + max(copies.values(), default=0)
        # A pipeline stage leaves its units gathered after each backward but the step's last
        # (set_reshard_after_backward(False)), whatever reshard_after_forward says.
        memory.gathered_weights = everything if options.stays_gathered or options.pipeline else forward
        memory.gathered_at_activation_peak = everything if options.stays_gathered else forward
        if options.stays_gathered and options.pipeline:
            memory.gathered_between_micro_batches = sum(held.values())
    pending = options.settings.max_reductions_in_flight if options.settings.overlap_grad_reduce else 0
    # An expert bucket's gradients are divided by the dense data-parallel size within an HSDP
    # replica (units.py; the replicas divide by their own count).
    dense = options.parallel.data_parallel_ranks(options.world_size) // options.outer_size
    reductions = [_ReductionBytes.of(geometry, dense if bucket.expert else geometry.layout.world_size)
                  for bucket, geometry in plans]
    if options.accumulates_locally:
        # Every bucket's un-reduced gradients stay from the first micro-batch to the last one,
        # which reduces them bucket by bucket: a reduction adds what it holds beyond them.
        held = sum(r.unreduced for r in reductions)
        memory.grad_buffers = held + _peak_of_reductions(
            [max(0, r.starting - r.unreduced) for r in reductions], [max(0, r.in_flight - r.unreduced) for r in reductions], pending)
        return
    # The reductions in flight, and the next bucket filled and starting its reduction.
    memory.grad_buffers = _peak_of_reductions([r.starting for r in reductions], [r.in_flight for r in reductions], pending)


def _peak_of_reductions(starting: list[int], in_flight: list[int], pending: int) -> int:
    """The most held at once by one bucket starting its reduction (``starting[i]``) while the
    ``pending`` largest other reductions are still in flight (``in_flight[j]``, j != i)."""
    ranked = sorted(range(len(in_flight)), key=in_flight.__getitem__, reverse=True)[: pending + 1]
    best = 0
    for i, start in enumerate(starting):
        others = [j for j in ranked if j != i][:pending]
        best = max(best, start + sum(in_flight[j] for j in others))
    return best


@dataclass(frozen=True)
class _ReductionBytes:
    """One bucket's pooled gradient buffers over its reduction (bucket_grads.py's _grad_buffer
    and start_reduction): ``unreduced``, the gradients before it (in the communication dtype under
    strategies 2/3, which reduce every micro-batch, in the main-gradient dtype under 0/1, which
    may accumulate them); ``starting``, the peak while it starts (a cast copy in the
    communication dtype beside them, then the copy and what receives the result);
    ``in_flight``, what it holds until it finishes."""

    unreduced: int = 0
    starting: int = 0
    in_flight: int = 0

    @classmethod
    def of(cls, geometry: BucketGeometry, grad_divisor: int) -> _ReductionBytes:
        if not geometry.requires_grad or geometry.reduces_in_place(grad_divisor):
            return cls()  # reduced in place: planned over the dense group
        dtypes, layout = geometry.dtypes, geometry.layout
        unreduced_dtype = dtypes.comm if geometry.strategy.shards_grads else dtypes.main_grads
        unreduced = _round_up(layout.padded_numel * unreduced_dtype.itemsize, ALLOCATION_GRANULE)
        sent = unreduced
        copy = 0
        if unreduced_dtype != dtypes.comm:
            sent = copy = _round_up(layout.padded_numel * dtypes.comm.itemsize, ALLOCATION_GRANULE)
        received = 0
        if dtypes.promotes_reduction:
            received = _round_up(layout.padded_numel * dtypes.comm.itemsize, ALLOCATION_GRANULE)
            if geometry.strategy is ShardingStrategy.NO_SHARD:  # this rank's sum, before it is gathered
                received += _round_up(layout.shard_numel * dtypes.main_grads.itemsize, ALLOCATION_GRANULE)
        elif geometry.strategy is not ShardingStrategy.NO_SHARD and layout.world_size > 1:
            received = _round_up(layout.shard_numel * dtypes.comm.itemsize, ALLOCATION_GRANULE)
        return cls(unreduced, max(unreduced + copy, sent + received), sent + received)


def plan_rank(
    buckets: Sequence[_BucketPlan],
    module: nn.Module,
    options: PlanOptions,
    rank: int,
    other_experts: Sequence[str] = (),
    buffers: Mapping[str, int] | None = None,
) -> RankMemory:
    """Global ``rank``'s bytes (ranks laid out as model_parallel.place_of says). Buckets alike (the
    same bucket of every layer) are planned once and counted as often as they occur;
    ``other_experts``: modules of experts this rank does not hold, nor their buffers;
    ``buffers``: the module buffers it holds, with the copies of each (pipeline stage modules
    each keep their own; None: one of each but those)."""
    memory = RankMemory(rank)
    counts = Counter(b.shape for b in buckets)
    place = options.place(rank)
    geometries = {shape: _geometry(shape, options, place) for shape in counts}
    kernel_step = _stepped_by_kernels(list(geometries.values()), options)
    for shape, count in counts.items():
        one = RankMemory(rank)
        _add_bucket(one, geometries[shape], options, kernel_step, shape[-1])
        memory.merge(one, count)
    for name, buffer in module.named_buffers():
        copies = 1 if buffers is None else buffers.get(name, 0)
        if copies and not any(name.startswith(f"{prefix}.") for prefix in other_experts):
            memory.add("device", "module buffers", copies * buffer.numel() * buffer.element_size())
    plans = [(b, geometries[b.shape]) for b in buckets]
    if options.whole_matrix is not None:
        add_whole_matrix_state(memory, options.whole_matrix, [(b.names, g) for b, g in plans], module, options, place, kernel_step)
    _add_offload_staging(memory, plans, options)
    _working_set(memory, plans, options)
    return memory


def _stepped_by_kernels(geometries: list[BucketGeometry], options: PlanOptions) -> bool:
    """Whether the C++ ops step the optimizer on the device because main gradients there are of a
    lower dtype than fp32 main params (optim/kernel_step.py's reads_main_grads_as_they_are)."""
    trainable = [g for g in geometries if g.requires_grad]
    low = [g for g in trainable if not g.offloaded and g.dtypes.grads_below_main_params]
    fp32_main = all(g.dtypes.main_params == torch.float32 for g in trainable)
    return bool(low) and fp32_main and options.optimizer.stepped_by_kernels


def _add_offload_staging(memory: RankMemory, plans: list[tuple[_BucketPlan, BucketGeometry]], options: PlanOptions) -> None:
    """On a GPU, offloading keeps two pinned staging buffers per compute dtype for new weights
    and, when micro-batches accumulate on the host, two landing buffers for gradients, each as
    large as the largest bucket range (offload.py)."""
    if not options.settings.cpu_offload or options.device_type != "cuda":
        return
    largest: dict[torch.dtype, int] = defaultdict(int)
    largest_grads = 0
    for _, geometry in plans:
        if geometry.offloaded:
            start, end = geometry.main_range
            largest[geometry.dtypes.compute] = max(largest[geometry.dtypes.compute], end - start)
            largest_grads = max(largest_grads, (end - start) * geometry.dtypes.main_params.itemsize)
    pinned = options.settings.offload_pin_memory
    for dtype, numel in largest.items():
        for _ in range(2):
            memory.add("host", "offload staging", numel * dtype.itemsize, pinned=pinned)
    if options.micro_batches > 1:
        for _ in range(2):
            memory.add("host", "offload staging", largest_grads, pinned=pinned)


def gib(nbytes: int) -> float:
    return nbytes / 2**30


def describe(memory: RankMemory) -> str:
    """A few lines: each non-zero category in GiB, on the device and on the host."""
    lines = [f"rank {memory.rank}: device model states {gib(memory.device_model_states):.3f} GiB "
             f"(+ working set up to {gib(memory.working_set):.3f} GiB)"]
    for where, categories in (("device", memory.device), ("host", memory.host)):
        for name, nbytes in categories.items():
            if nbytes:
                lines.append(f"  {where:6} {name:18} {gib(nbytes):10.3f} GiB")
    if memory.padding:
        lines.append(f"  of which padding {gib(memory.padding):.3f} GiB")
    if memory.owned_matrices:
        lines.append(f"  owns {memory.owned_matrices} whole matrices (their state, and the step's "
                     f"{gib(memory.optimizer_step):.3f} GiB of temporaries)")
    return "\n".join(lines)


def biggest(memory: RankMemory) -> tuple[str, int]:
    name = max(memory.device, key=memory.device.get)
    return name, memory.device[name]
