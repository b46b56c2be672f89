"""Whole-matrix optimizers (torch's Muon) in the memory plan: which rank owns each matrix, what
it holds from the first step on, and what its step needs on top while it runs.

optim/whole_tensors.py steps each matrix on one *owner* rank of the group its pieces are sharded
over, chosen by engine/params/owner_assignment.py's rule from the shapes alone: the owner keeps
the matrix's momentum whole (in the main-parameter dtype), every other rank keeps nothing for it.
So ranks differ: the plan computes every rank's owned matrices with the same rule. What the step
adds (the owned matrices' weights and gradients whole, the exchange buffers of at most
``EXCHANGE_CHUNK_VALUES`` values an owner a run, Newton-Schulz's bf16 temporaries) is freed
when it ends: planned as an upper bound, like Adam's step temporaries. The split users run
(Muon on the layers' matrices, an elementwise optimizer on the rest) is given as a list of
torch optimizers over the meta model or by name (``"muon+adamw"``, :func:`split_optimizers`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megatron_fsdp.engine.buckets.bucket_geometry import BucketGeometry
from megatron_fsdp.engine.config import ShardingStrategy
from megatron_fsdp.engine.params.owner_assignment import EXCHANGE_CHUNK_VALUES, assign_owners, exchange_chunks
from megatron_fsdp.engine.step.units import assign_params_to_units, find_unit_modules

if TYPE_CHECKING:
    from megatron_fsdp.engine.planning.memory_plan import PlanOptions, RankMemory
    from megatron_fsdp.engine.planning.model_parallel import RankPlace

# The CUDA caching allocator and the bucket pool hand out multiples of this many bytes
# (memory_plan.ALLOCATION_GRANULE; that module imports this one).
_GRANULE = 512

# Whole-matrix optimizers the planner knows by name, and the per-element tensors each keeps of a
# matrix it owns (torch's Muon: its momentum buffer).
WHOLE_MATRIX_KINDS = {"muon": 1}


@dataclass(frozen=True)
class WholeMatrixPart:
    """The parameters a whole-matrix optimizer steps, by name in its param groups' order (the
    order owners are dealt in), and the per-element ``states`` it keeps of each on its owner."""

    name: str
    params: tuple[str, ...]
    states: int = 1


def split_optimizers(
    optimizer: Any, module: nn.Module, unit_classes: tuple[type, ...], needs_whole_tensors: Callable[[torch.optim.Optimizer], bool],
) -> tuple[Any, WholeMatrixPart | None]:
    """The elementwise optimizer (what memory_plan.OptimizerSpec.parse takes) and the whole-matrix
    part of ``optimizer``: ``"muon+<elementwise>"`` (Muon takes the 2-D trainable parameters of
    the ``unit_classes`` modules, the layers, and the elementwise one the rest: embeddings, norms,
    biases, the output layer), or a list of torch optimizers built over ``module``'s parameters
    (the meta model), one of them whole-matrix (``needs_whole_tensors``). Anything else is
    returned as it is, without a whole-matrix part."""
    if isinstance(optimizer, str) and optimizer.lower() in WHOLE_MATRIX_KINDS:
        raise ValueError(
            f"{optimizer} steps 2-D matrices only: name the optimizer of the other parameters too, e.g. "
            f"'{optimizer.lower()}+adamw' (Muon on the layers' 2-D matrices, AdamW on the rest), or pass "
            "[torch.optim.Muon(matrices), torch.optim.AdamW(rest)] built over the meta model"
        )
    if isinstance(optimizer, str) and "+" in optimizer:
        return _split_by_name(optimizer, module, unit_classes)
    if isinstance(optimizer, (list, tuple)):
        return _split_instances(list(optimizer), module, needs_whole_tensors)
    if isinstance(optimizer, torch.optim.Optimizer) and needs_whole_tensors(optimizer):
        return _split_instances([optimizer], module, needs_whole_tensors)
    return optimizer, None


def _split_by_name(optimizer: str, module: nn.Module, unit_classes: tuple[type, ...]) -> tuple[str, WholeMatrixPart]:
    whole, _, rest = optimizer.lower().partition("+")
    if whole not in WHOLE_MATRIX_KINDS or not rest or "+" in rest or rest in WHOLE_MATRIX_KINDS:
        raise ValueError(
            f"unknown optimizer split {optimizer!r}: give a whole-matrix optimizer ({', '.join(WHOLE_MATRIX_KINDS)}) "
            "and the elementwise one for the other parameters, e.g. 'muon+adamw'"
        )
    units = [m for _, m in find_unit_modules(module, unit_classes, units_required=False, log_absent=False)]
    in_layers = {name for unit, names in assign_params_to_units(module, units).items() if unit is not None for name in names}
    matrices = tuple(name for name, param in module.named_parameters()
                     if name in in_layers and param.requires_grad and param.dim() == 2)
    if not matrices:
        raise ValueError(
            f"{optimizer!r}: {whole} takes the 2-D parameters of the layers (the fsdp_unit_modules / --units modules), "
            f"and this model has none{'' if units else ' (no unit modules were found)'}: name the layer class, or pass "
            "[torch.optim.Muon(matrices), torch.optim.AdamW(rest)] built over the meta model"
        )
    return rest, WholeMatrixPart(whole, matrices, WHOLE_MATRIX_KINDS[whole])


def _split_instances(
    optimizers: list[Any], module: nn.Module, needs_whole_tensors: Callable[[torch.optim.Optimizer], bool],
) -> tuple[Any, WholeMatrixPart | None]:
    """A list of torch optimizers over the meta model: at most one whole-matrix optimizer (torch's
    Muon, or one declared with megatron_fsdp.whole_tensor_optimizer) and elementwise ones alike
    (one kind of state for every other parameter); every trainable parameter in exactly one."""
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise ValueError("optimizer as a list takes torch optimizers built over the meta model's parameters")
    names = {id(param): name for name, param in module.named_parameters()}
    taken: dict[str, str] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                name = names.get(id(param))
                if name is None:
                    raise ValueError(
                        f"{type(opt).__name__} holds a tensor of shape {tuple(param.shape)} that is not a parameter of the "
                        "planned model: build the optimizers over the parameters of the meta model you pass"
                    )
                if name in taken:
                    raise ValueError(f"parameter {name!r} is in two optimizers ({taken[name]} and {type(opt).__name__})")
                taken[name] = type(opt).__name__
    missing = [name for name, param in module.named_parameters() if param.requires_grad and name not in taken]
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameters are in no optimizer (e.g. {missing[0]!r}): megatron_fsdp would keep "
            "no optimizer state for them; add them to one, or mark them requires_grad=False"
        )
    wholes = [o for o in optimizers if needs_whole_tensors(o)]
    elementwise = [o for o in optimizers if not needs_whole_tensors(o)]
    if len(wholes) > 1:
        raise ValueError(
            f"{len(wholes)} whole-matrix optimizers: the plan takes one (owners are dealt per optimizer); put their "
            "matrices in one optimizer's param groups"
        )
    if len(elementwise) > 1 and len({(type(o), o.defaults.get("amsgrad"), bool(o.defaults.get("momentum"))) for o in elementwise}) > 1:
        raise ValueError(
            "the elementwise optimizers keep different state (" + ", ".join(type(o).__name__ for o in elementwise)
            + "): the plan takes one kind for every parameter outside the whole-matrix optimizer"
        )
    part = None
    if wholes:
        kind = type(wholes[0]).__name__.lower()
        params = tuple(names[id(p)] for group in wholes[0].param_groups for p in group["params"])
        part = WholeMatrixPart(kind, params, WHOLE_MATRIX_KINDS.get(kind, 1))
    return (elementwise[0] if elementwise else None), part


def check_whole_matrix_options(part: WholeMatrixPart, options: PlanOptions) -> None:
    """Refuses what the plan of owners does not cover yet, with what to do instead."""
    sizes = options.parallel
    parallel = [f"{name} {size}" for name, size in (("tensor_parallel_size", sizes.tensor),
                ("context_parallel_size", sizes.context), ("expert_parallel_size", sizes.expert)) if size > 1]
    if options.pipeline is not None:
        parallel.append(f"pipeline_parallel_size {options.pipeline.size}")
    if parallel:
        raise ValueError(
            f"{part.name}'s owners are planned over data parallelism (FSDP, HSDP, HFSDP) only, not with "
            f"{', '.join(parallel)}: plan the data-parallel mesh alone, or the same sizes with an elementwise optimizer"
        )
    if options.settings.cpu_offload and options.device_type == "cuda":
        raise ValueError(
            f"{part.name} with CPU offloading on a GPU gathers every matrix on every rank (host pieces take no "
            "exchange), which the plan does not cover: plan it without offloading"
        )


@dataclass(frozen=True)
class _Matrix:
    """One matrix of the part as this rank sees it: its values, owner, this rank's piece of its
    main weights, and the bytes of one value (the main-parameter dtype)."""

    numel: int
    rows: int
    owner: int
    piece: int
    itemsize: int


def owner_group(options: PlanOptions, place: RankPlace) -> tuple[int, int]:
    """The group a matrix's owner is one rank of, as its size and this rank's place in it: the
    ranks its main weights are split over (every rank under HFSDP, whose pieces split each shard
    over the replicas), else the shard group: each HSDP replica has its own owners."""
    if options.outer_strategy is ShardingStrategy.OPTIM and options.outer_size > 1:
        size = options.shard_size
        return size * options.outer_size, place.outer_rank * size + place.shard_rank
    return options.shard_size, place.shard_rank


def add_whole_matrix_state(
    memory: RankMemory,
    part: WholeMatrixPart,
    buckets: Iterable[tuple[Sequence[str], BucketGeometry]],
    module: nn.Module,
    options: PlanOptions,
    place: RankPlace,
    kernel_step: bool,
) -> None:
    """This rank's share of ``part``: each owned matrix's state (held from the first step), the
    count of matrices it owns, and the step's temporaries (``memory.optimizer_step``, the larger
    of them and the elementwise optimizer's, which steps after it). ``buckets``: every bucket's
    parameter names and geometry; ``kernel_step``: the elementwise optimizer reads low-precision
    main gradients as they are, so the whole-matrix step casts its pieces of them."""
    shapes = {name: tuple(param.shape) for name, param in module.named_parameters()}
    where: dict[str, tuple[BucketGeometry, int]] = {}
    for names, geometry in buckets:
        for index, name in enumerate(names):
            where[name] = geometry, index
    size, me = owner_group(options, place)
    owners = assign_owners([shapes[name] for name in part.params], size)
    by_dtype: dict[torch.dtype, list[_Matrix]] = defaultdict(list)
    for name, owner in zip(part.params, owners):
        geometry, index = where[name]
        lo, hi = geometry.main_pieces()[index]
        main = geometry.dtypes.main_params
        rows, numel = shapes[name][0], geometry.layout.slots[index].numel
        matrix = _Matrix(numel, rows, owner, hi - lo, main.itemsize)
        by_dtype[main].append(matrix)
        if owner == me:
            memory.owned_matrices += 1
            for _ in range(part.states):
                memory.add("host" if geometry.offloaded else "device", "optimizer state", numel * main.itemsize)
    geometries = [where[name][0] for name in part.params]
    if any(geometry.offloaded for geometry in geometries):
        return  # the step's temporaries are on the host
    whole_on_every_rank = options.settings.strategy is ShardingStrategy.NO_SHARD
    casts_grads = kernel_step and any(g.dtypes.grads_below_main_params for g in geometries)
    step = 0
    for matrices in by_dtype.values():
        step = max(step, _step_temporaries(matrices, size, me, whole_on_every_rank, casts_grads))
    memory.optimizer_step = max(memory.optimizer_step, step)


def _round(nbytes: int) -> int:
    return (nbytes + _GRANULE - 1) // _GRANULE * _GRANULE


def _step_temporaries(matrices: list[_Matrix], size: int, me: int, whole_on_every_rank: bool, casts_grads: bool) -> int:
    """An upper bound on what one mesh and dtype's step holds at once beyond the model states
    (whole_tensors.py's swap_in, the optimizer's step, swap_out): the larger of the gather (the
    owned wholes made so far, one run's send and receive buffers and the previous run's received
    one, the gradient pieces cast to the weights' dtype), the step (the owned weights and
    gradients whole, Newton-Schulz's temporaries for the largest owned matrix) and the scatter
    back (the owned weights whole and a run's buffers)."""
    itemsize = matrices[0].itemsize
    owned = [m for m in matrices if m.owner == me]
    wholes = sum(_round(m.numel * itemsize) for m in owned)
    # gather_to_owners: every weight, then every gradient, one route each.
    routes = matrices + matrices
    held = previous = gather = 0
    for run in exchange_chunks(routes, size, EXCHANGE_CHUNK_VALUES):
        members = [routes[i] for i in run]
        if whole_on_every_rank:  # the owner holds the whole already; nothing is sent
            sent = received = 0
        else:
            sent = sum(m.piece for m in members if m.owner != me)
            received = sum(m.numel - m.piece for m in members if m.owner == me)
        made = sum(_round(m.numel * itemsize) for m in members if m.owner == me)
        sent, received = _round(sent * itemsize), _round(received * itemsize)
        gather = max(gather, held + previous + sent + received, held + received + made)
        held, previous = held + made, received
    if casts_grads:
        gather += sum(_round(m.piece * itemsize) for m in matrices)
    step = 2 * wholes + max((_newton_schulz_bytes(m) for m in owned), default=0)
    previous = scatter = 0
    for run in exchange_chunks(matrices, size, EXCHANGE_CHUNK_VALUES):
        members = [matrices[i] for i in run]
        copies = (size - 1) if whole_on_every_rank else 1
        sent = sum((m.numel if whole_on_every_rank else m.numel - m.piece) * copies for m in members if m.owner == me)
        received = sum(m.numel if whole_on_every_rank else m.piece for m in members if m.owner != me)
        sent, received = _round(sent * itemsize), _round(received * itemsize)
        scatter = max(scatter, previous + sent + received)
        previous = received
    return max(gather, step, wholes + scatter)


def _newton_schulz_bytes(matrix: _Matrix) -> int:
    """torch's Muon on one ``m x n`` matrix (m <= n, N values): the Nesterov update and the
    update added to the weights, in the main dtype, and in bf16 the orthogonalised copy, the
    next one and two m x m Gram products."""
    small = min(matrix.rows, matrix.numel // max(matrix.rows, 1))
    return 2 * _round(matrix.numel * matrix.itemsize) + 2 * _round(matrix.numel * 2) + 2 * _round(small * small * 2)


def typical_rank(ranks: Sequence[RankMemory], alike: Sequence[int]) -> RankMemory:
    """The median rank of the world by device need (every rank counted, through the planned
    rank it holds alike with): what most ranks hold where owners make a few hold more."""
    by_rank = {memory.rank: memory for memory in ranks}
    world = sorted((by_rank[first] for first in alike), key=lambda m: (m.step_peak, m.host_model_states))
    return world[(len(world) - 1) // 2]

