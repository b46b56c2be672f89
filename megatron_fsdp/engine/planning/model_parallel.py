"""What one rank holds of each parameter under tensor, context and expert parallelism, computed
from a model on the meta device (pure arithmetic, for memory_plan.py).

Ranks are laid out as Megatron-LM lays them out, tensor-parallel fastest: dense ranks as
(dp_outer, dp_shard, cp, tp), expert ranks as (expert data parallel, ep, etp). Context
parallelism folds into the shard group (dp_shard x cp ranks share every shard, each CP rank
holding the whole parameter, as ``fully_shard`` over a flattened ``dp_cp`` dim shards it), so it
changes who shares a shard, not what a rank holds. A tensor-parallel plan says which parameters
are split and on which dim; each rank's local tensor is then what the engine shards
(docs/parallelism.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from megatron_fsdp.engine.params.dtensor_params import is_expert_param

# {module or parameter FQN pattern: how it is split}; see resolve_split_dims.
TensorParallelPlan = Mapping[str, "str | int | ParallelStyle"]

# Megatron-LM's split of a transformer, by the last name of the module (Hugging Face's names,
# torchtitan's and examples/gpt_model.py's): attention's query/key/value and the MLP's
# gate/up projections column-parallel, their output projections row-parallel, the input
# embedding split over the vocabulary (VocabParallelEmbedding) and so is the output layer
# (column-parallel); position embeddings and norms stay whole.
MEGATRON_COLWISE = frozenset({
    "q_proj", "k_proj", "v_proj", "qkv_proj", "qkv", "query_key_value", "wq", "wk", "wv",
    "gate_proj", "up_proj", "gate_up_proj", "gate_up", "w1", "w3", "fc1",
    "lm_head", "head", "output",
})
MEGATRON_ROWWISE = frozenset({"o_proj", "out_proj", "out", "wo", "down_proj", "down", "w2", "fc2"})
MEGATRON_VOCAB_EMBEDDINGS = frozenset({"embed_tokens", "embed", "tok_embeddings", "wte", "word_embeddings"})
# Grouped expert weights (experts x out x in, Hugging Face's fused MoE layout): the MLP's
# up projections split their output dim, the down projection its input dim.
MEGATRON_GROUPED_EXPERT_DIMS = {"gate_up_proj": 1, "up_proj": 1, "gate_proj": 1, "down_proj": 2}

_PER_EXPERT_MODULE = re.compile(r"^((?:.*\.)?experts)\.(\d+)\.")


class IndivisibleMesh(ValueError):
    """Sizes whose product does not divide the world (the message names the sizes that would)."""


@dataclass(frozen=True)
class ParallelSizes:
    """Megatron-LM's model-parallel sizes: ``tensor`` (``--tensor-model-parallel-size``),
    ``context`` (``--context-parallel-size``), ``expert`` (``--expert-model-parallel-size``)
    and ``expert_tensor`` (``--expert-tensor-parallel-size``; None: the tensor-parallel size,
    Megatron's default)."""

    tensor: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = None

    @property
    def etp(self) -> int:
        return self.tensor if self.expert_tensor is None else self.expert_tensor

    def data_parallel_ranks(self, world_size: int) -> int:
        """Ranks a dense parameter's local tensor is spread over: dp_outer x dp_shard x cp."""
        return world_size // self.tensor

    def expert_data_parallel_size(self, world_size: int) -> int:
        """Ranks holding the same experts, which expert parameters are sharded over."""
        return world_size // (self.expert * self.etp)

    def check(self) -> None:
        named = {"tensor_parallel_size": self.tensor, "context_parallel_size": self.context,
                 "expert_parallel_size": self.expert, "expert_tensor_parallel_size": self.etp}
        for name, size in named.items():
            if size < 1:
                raise ValueError(f"{name} must be >= 1, got {size}")

    def mesh_problem(self, world_size: int, outer_size: int, pipeline_size: int = 1) -> str | None:
        """Why ``world_size`` ranks hold no (pp, dp_outer, dp_shard, cp, tp) mesh of these sizes,
        with the values of each size that would fit, the others as given; None when they do."""
        named = {"pipeline_parallel_size": pipeline_size, "tensor_parallel_size": self.tensor,
                 "context_parallel_size": self.context, "dp_outer_size": outer_size}
        product = math.prod(named.values())
        if world_size % product == 0:
            return None
        fits = []
        for name, size in named.items():
            others = product // size
            if size > 1 and world_size % others == 0:
                room = world_size // others  # what this size may be: any divisor of it
                fits.append(f"{name} {_one_of(d for d in range(1, room + 1) if room % d == 0)}")
        fix = (f"sizes that divide it, the others as given: {'; '.join(fits)}" if fits else
               f"pick sizes whose product divides {world_size}")
        asked = {name: size for name, size in named.items() if size > 1}
        sizes = f"{' x '.join(asked)} = {' x '.join(map(str, asked.values()))} = {product}"
        if len(asked) == 1:
            sizes = f"{next(iter(asked))} {product}"
        return f"world_size {world_size} is not divisible by {sizes} (the mesh is (pp, dp_outer, dp_shard, cp, tp)): {fix}"

    @property
    def needs_expert_mesh(self) -> bool:
        """Whether the experts are laid out apart from the dense parameters, so fully_shard needs
        ``expt_device_mesh``: dealt out over EP ranks, or split by an ETP other than the TP size."""
        return self.expert > 1 or self.etp != self.tensor

    def check_expert_groups(self, world_size: int, outer_size: int = 1) -> None:
        """For a model with experts: the expert mesh must fit the world and the dense groups, as
        fully_shard checks it (mesh.resolve_expert_group: the expert-data-parallel size, within an
        HSDP replica, divides the dense data-parallel ranks)."""
        experts = self.expert * self.etp * outer_size
        if world_size % experts:
            raise IndivisibleMesh(
                f"world_size {world_size} is not divisible by expert_parallel_size x expert_tensor_parallel_size x "
                f"dp_outer_size = {self.expert} x {self.etp} x {outer_size} = {experts}: the expert mesh is "
                f"(dp_outer, expert data parallel, ep, etp), so pick sizes whose product divides {world_size}"
            )
        edp, dp = world_size // experts, self.data_parallel_ranks(world_size)
        if dp % edp:
            # dp / edp = outer x ep x etp / tp: ep must be a multiple of tp / gcd(tp, outer x etp).
            step = self.tensor // math.gcd(self.tensor, outer_size * self.etp)
            ep = -(-self.expert // step) * step
            raise ValueError(
                f"the expert-data-parallel size {edp} (world / (ep x etp x dp_outer) = {world_size} / ({self.expert} x "
                f"{self.etp} x {outer_size})) does not divide the {dp} data-parallel ranks (world / tp = {world_size} / "
                f"{self.tensor}): fully_shard refuses such an expert mesh. expert_parallel_size x "
                f"expert_tensor_parallel_size x dp_outer_size must be a multiple of tensor_parallel_size {self.tensor}: "
                f"e.g. expert_parallel_size {ep} with expert_tensor_parallel_size {self.etp}, or "
                f"expert_tensor_parallel_size {self.tensor} (the default, as Megatron-LM)"
            )


def _one_of(values) -> str:
    """``1, 2 or 4``."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


@dataclass(frozen=True)
class RankPlace:
    """Where a global rank sits: its HSDP outer rank and rank in the shard group (dp_shard x cp),
    its rank in the expert-data-parallel group, and in the expert-parallel one (which experts)."""

    outer_rank: int
    shard_rank: int
    expert_shard_rank: int
    expert_rank: int


def place_of(rank: int, world_size: int, outer_size: int, sizes: ParallelSizes) -> RankPlace:
    data_parallel_rank = rank // sizes.tensor
    shard_size = sizes.data_parallel_ranks(world_size) // outer_size
    outer_rank, shard_rank = divmod(data_parallel_rank, shard_size)
    expert_shard_rank, within = divmod(rank, sizes.expert * sizes.etp)
    return RankPlace(outer_rank, shard_rank, expert_shard_rank, within // sizes.etp)


def _matching(pattern: str, names: Mapping[str, object]) -> list[str]:
    """parallelize_module's matching: name by name between the dots, each with fnmatch (an exact
    name, as megatron_style_plan gives, is looked up: a large model has thousands)."""
    if not any(c in pattern for c in "*?["):
        return [pattern] if pattern in names else []
    parts = pattern.split(".")
    return [n for n in names if len(n.split(".")) == len(parts) and all(map(fnmatchcase, n.split("."), parts))]


def _module_split_dims(module: nn.Module, style: str) -> dict[str, int]:
    """parallelize_module's placements for a Linear or an Embedding, by its parameter names."""
    if isinstance(module, nn.Linear):
        return {"weight": 0, "bias": 0} if style == "colwise" else {"weight": 1}
    if isinstance(module, nn.Embedding):
        return {"weight": 1 if style == "colwise" else 0}
    raise ValueError(
        f"'{style}' applies to nn.Linear and nn.Embedding (as parallelize_module's styles), not to "
        f"{type(module).__name__}: give its parameters' split dims instead, e.g. {{'<name>.weight': 0}}"
    )


def _style_of(pattern: str, value: object) -> str | int:
    if isinstance(value, ColwiseParallel):
        return "colwise"
    if isinstance(value, RowwiseParallel):
        return "rowwise"
    if isinstance(value, ParallelStyle):
        return "whole"  # SequenceParallel, PrepareModule*: parameters stay whole on every TP rank
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if value in ("colwise", "rowwise"):
        return value
    raise ValueError(
        f"tensor_parallel_plan[{pattern!r}] = {value!r}: use 'colwise' or 'rowwise' (or torch's ColwiseParallel/"
        "RowwiseParallel) for a Linear or Embedding module, or a dim (int) for a parameter"
    )


def resolve_split_dims(model: nn.Module, plan: TensorParallelPlan) -> dict[str, int]:
    """Each split parameter's canonical name -> the dim tensor parallelism splits. Keys are
    module FQN patterns ('colwise'/'rowwise', or torch's styles) or parameter FQN patterns (a
    dim), matched as parallelize_module matches them; the rest stays whole on every TP rank."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    dims: dict[str, int] = {}

    def split(name: str, dim: int, why: str) -> None:
        param = params[name]
        if dim >= param.dim():
            raise ValueError(f"{why}: {name} has {param.dim()} dims, so it has no dim {dim} to split")
        key = canonical[id(param)]
        if dims.setdefault(key, dim) != dim:
            raise ValueError(f"{why}: {key} (tied as {name}) is split on dim {dims[key]} by another entry")

    for pattern, value in plan.items():
        style = _style_of(pattern, value)
        if isinstance(style, int):
            matched = _matching(pattern, params)
            for name in matched:
                split(name, style, f"tensor_parallel_plan[{pattern!r}]")
        else:
            matched = _matching(pattern, modules)
            for name in matched if style != "whole" else ():
                for param_name, dim in _module_split_dims(modules[name], style).items():
                    full_name = f"{name}.{param_name}" if name else param_name
                    if full_name in params:
                        split(full_name, dim, f"tensor_parallel_plan[{pattern!r}] ({style})")
        if not matched:
            kind = "parameter" if isinstance(style, int) else "module"
            raise ValueError(f"tensor_parallel_plan key {pattern!r} matches no {kind} of the model")
    return dims


def megatron_style_plan(model: nn.Module) -> dict[str, str | int]:
    """The tensor-parallel plan Megatron-LM would apply, found by module names (MEGATRON_*):
    exact FQNs, so it can be printed or edited and passed back."""
    plan: dict[str, str | int] = {}
    for name, module in model.named_modules():
        last = name.rpartition(".")[2]
        if isinstance(module, nn.Linear) and last in MEGATRON_COLWISE:
            plan[name] = "colwise"
        elif isinstance(module, nn.Linear) and last in MEGATRON_ROWWISE:
            plan[name] = "rowwise"
        elif isinstance(module, nn.Embedding) and last in MEGATRON_VOCAB_EMBEDDINGS:
            plan[name] = "rowwise"  # split over the vocabulary
    for name, param in model.named_parameters():
        owner, _, last = name.rpartition(".")
        if param.dim() == 3 and owner.rpartition(".")[2] == "experts" and last in MEGATRON_GROUPED_EXPERT_DIMS:
            plan[name] = MEGATRON_GROUPED_EXPERT_DIMS[last]
    return plan


def expert_names(model: nn.Module, sizes: ParallelSizes) -> set[str]:
    """The expert parameters, as fully_shard finds them given ``expt_device_mesh``: marked
    ``allreduce = False``, or, without a mark, every parameter under an ``experts`` module
    (mark_experts_by_name). Without an expert mesh (EP 1 and ETP = TP) unmarked experts are
    dense parameters, split by TP as the plan says; with one they are found by name."""
    named = dict(model.named_parameters())
    marked = {n for n, p in named.items() if is_expert_param(p)}
    if marked or not sizes.needs_expert_mesh:
        return marked
    found = {n for n in named if ".experts." in f".{n}"}
    if not found:
        asked = (f"expert_parallel_size={sizes.expert}" if sizes.expert > 1 else
                 f"expert_tensor_parallel_size={sizes.etp} (not the tensor_parallel_size {sizes.tensor})")
        raise ValueError(
            f"{asked} but the model has no expert parameter: mark them as fully_shard reads them "
            "(param.allreduce = False) or keep them under a module named 'experts'; for a model without experts "
            "leave expert_parallel_size 1 and expert_tensor_parallel_size unset"
        )
    return found


@dataclass(frozen=True)
class LocalParams:
    """One rank's local tensors: ``numels`` (canonical name -> elements) of the parameters it
    holds, ``experts`` among them, and ``other_experts``: the modules of experts held by other
    expert-parallel ranks (their buffers are not here either)."""

    numels: dict[str, int]
    experts: frozenset[str]
    other_experts: tuple[str, ...]


def local_params(
    model: nn.Module, sizes: ParallelSizes, split_dims: Mapping[str, int], experts: set[str], expert_rank: int,
) -> LocalParams:
    """What expert-parallel rank ``expert_rank`` holds of each parameter (every TP rank alike:
    the sizes must divide each split dim). Experts in a ModuleList (``experts.<i>.``) are dealt
    out in contiguous blocks; any other expert parameter is a grouped tensor split on dim 0."""
    per_expert: dict[str, set[int]] = {}
    for name in experts:
        if match := _PER_EXPERT_MODULE.match(name):
            per_expert.setdefault(match.group(1), set()).add(int(match.group(2)))
    other_experts = []
    for prefix, indices in per_expert.items():
        if len(indices) % sizes.expert:
            raise ValueError(
                f"expert_parallel_size {sizes.expert} does not divide the {len(indices)} experts of {prefix}: "
                "every expert-parallel rank holds the same number of experts"
            )
        per_rank = len(indices) // sizes.expert
        mine = range(expert_rank * per_rank, (expert_rank + 1) * per_rank)
        other_experts += [f"{prefix}.{index}" for index in sorted(indices) if index not in mine]
    numels = {}
    for name, param in model.named_parameters():
        if any(name.startswith(f"{prefix}.") for prefix in other_experts):
            continue
        numel, expert = param.numel(), name in experts
        if expert and not _PER_EXPERT_MODULE.match(name) and sizes.expert > 1:
            if param.shape[0] % sizes.expert:
                raise ValueError(
                    f"expert_parallel_size {sizes.expert} does not divide the {param.shape[0]} experts of {name} "
                    "(a grouped expert weight, split over experts on dim 0)"
                )
            if split_dims.get(name) == 0:
                raise ValueError(f"{name}: dim 0 holds its experts (split by expert parallelism); split another dim")
            numel //= sizes.expert
        if name in split_dims:
            size, flag = (sizes.etp, "expert_tensor_parallel_size") if expert else (sizes.tensor, "tensor_parallel_size")
            dim = split_dims[name]
            if param.shape[dim] % size:
                raise ValueError(
                    f"{flag} {size} does not divide dim {dim} ({param.shape[dim]}) of {name}, which the "
                    "tensor-parallel plan splits: pick a size that divides it, or a plan that leaves it whole "
                    "(Megatron-LM pads a vocabulary to a multiple of the TP size)"
                )
            numel //= size
        numels[name] = numel
    return LocalParams(numels, frozenset(experts), tuple(other_experts))
