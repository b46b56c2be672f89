"""Pipeline parallelism for the memory plan (pure arithmetic, for memory_plan.py): which
parameters each pipeline rank holds, and how many micro-batches' activations torch's schedules
keep in flight on it.

The split, as torch.distributed.pipelining's manual split and torchtitan cut a model into stage
modules: the layers (the outermost modules of the unit classes, in registration order) are
dealt out in consecutive runs, ``layers / (pp x virtual stages)`` a stage (``"even"``, Megatron-LM's
default), as torchtitan deals them by default (``"torchtitan"``: the embedding and the head count
as a layer each, so the first and last stage take one layer fewer; ``torchtitan_layer_counts``),
or as many as the caller gives for each stage. What lies outside
the layers goes to the first stage when registered before the first layer (token and position
embeddings, and the root module's own parameters) and to the last stage when registered after
the last one (final norm, output layer); a module registered between two layers goes with the
layer before it. A weight tied across the first and last stage (a head tied to the embedding)
is held by both, as each stage module holds its own copy; so are the buffers of a module outside
the layers that has no parameters of its own (a rotary embedding's frequencies, which every
stage's layers read, as torchtitan keeps its ``freqs_cis`` on every stage). Stage ``s`` runs on pipeline rank
``s % pp`` (the "loop" order of torch's interleaved schedules), so rank ``r`` holds stages
``r, r + pp, r + 2 pp, ...``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

# torch.distributed.pipelining's schedule classes (``Schedule<name>``) the plan knows, keyed by
# a lower-case name; the value says whether a rank runs several stages (a list of stages).
SCHEDULES = {"gpipe": ("GPipe", False), "1f1b": ("1F1B", False), "interleaved1f1b": ("Interleaved1F1B", True),
             "loopedbfs": ("LoopedBFS", True)}
# How the layers are dealt out to the stages, by name (PipelineSpec.layers_per_stage).
LAYER_SPLITS = ("even", "torchtitan")


def _schedule_key(name: str) -> str:
    key = name.lower().replace("_", "").replace("-", "")
    return key.removeprefix("schedule")


@dataclass(frozen=True)
class PipelineSpec:
    """Pipeline parallelism as torch.distributed.pipelining runs it: ``size`` pipeline ranks,
    ``schedule`` (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``: torch's class names,
    with or without ``Schedule``, any case), ``micro_batches`` a step, ``virtual_stages``
    stage modules a rank (None: 1 for GPipe and 1F1B, 2 for the interleaved schedules) and
    ``layer_split``: how many layers each stage takes (``"even"``, ``"torchtitan"``, or a count
    for every stage, as a sequence or comma-separated; :meth:`layers_per_stage`). Whether the schedule runs that many
    micro-batches is :meth:`micro_batch_problem`'s to say (the plan checks the mesh and the
    model first)."""

    size: int
    schedule: str = "1F1B"
    micro_batches: int = 1
    virtual_stages: int | None = None
    layer_split: str | Sequence[int] = "even"

    def __post_init__(self) -> None:
        key = _schedule_key(self.schedule)
        if key not in SCHEDULES:
            known = ", ".join(name for name, _ in SCHEDULES.values())
            raise ValueError(f"unknown pipeline schedule {self.schedule!r}: use one of {known} (torch's Schedule<name>)")
        name, multi = SCHEDULES[key]
        if self.size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.size}")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        virtual = self.virtual_stages if self.virtual_stages is not None else (2 if multi else 1)
        if virtual < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {virtual}")
        if virtual > 1 and not multi:
            raise ValueError(
                f"virtual_stages={virtual}: Schedule{name} runs one stage a rank; give 1, or use Interleaved1F1B or "
                "LoopedBFS for several"
            )
        object.__setattr__(self, "schedule", name)
        object.__setattr__(self, "virtual_stages", virtual)
        if self.layer_split not in LAYER_SPLITS:
            counts = _layer_counts(self.layer_split)
            if len(counts) != self.stages or any(count < 1 for count in counts):
                raise ValueError(
                    f"layer split {list(counts)}: give one count of at least 1 for each of the {self.stages} stages "
                    f"(pipeline_parallel_size x virtual_stages = {self.size} x {virtual})"
                )
            object.__setattr__(self, "layer_split", counts)

    def micro_batch_problem(self, micro_batches: int | None = None) -> str | None:
        """Why the schedule cannot run ``micro_batches`` (default: this spec's) a step, with the
        fix; None when it can. torch's own conditions: Schedule1F1B needs at least as many as
        stages, ScheduleInterleaved1F1B a multiple of its rounds of ``size``."""
        count = self.micro_batches if micro_batches is None else micro_batches
        if self.schedule == "1F1B" and count < self.size:
            return (f"Schedule1F1B needs at least as many micro-batches as stages: {count} micro-batch"
                    f"{'es' if count > 1 else ''} for "
                    f"{self.size} stages; raise micro_batches to {self.size} or more")
        rounds = max(1, count // self.size)
        if self.schedule == "Interleaved1F1B" and count % rounds:
            return (f"ScheduleInterleaved1F1B runs micro-batches in rounds of {self.size} (pipeline_parallel_size): "
                    f"{count} is not a multiple of its {rounds} rounds; use a multiple of {self.size}")
        return None

    def fewest_micro_batches(self) -> int:
        """The fewest micro-batches a step the schedule runs (its own conditions, above)."""
        return next(count for count in itertools.count(1) if self.micro_batch_problem(count) is None)

    @property
    def stages(self) -> int:
        return self.size * self.virtual_stages

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        return tuple(range(pp_rank, self.stages, self.size))

    def layers_per_stage(self, layers: int) -> tuple[int, ...]:
        """How many of the model's ``layers`` each stage takes, in stage order; raises, naming
        the fix, when this split cannot deal them out."""
        if self.layer_split == "torchtitan":
            return torchtitan_layer_counts(layers, self.stages)
        if self.layer_split == "even":
            if layers % self.stages:
                raise ValueError(
                    f"pipeline_parallel_size x virtual_stages = {self.size} x {self.virtual_stages} = {self.stages} "
                    f"stages do not divide the model's {layers} layers evenly: pick sizes whose product divides "
                    f"{layers}, or deal them out unevenly (layer split 'torchtitan', or a count for each stage)"
                )
            return (layers // self.stages,) * self.stages
        if sum(self.layer_split) != layers:
            raise ValueError(f"layer split {list(self.layer_split)} deals out {sum(self.layer_split)} layers; the model "
                             f"has {layers}: give counts that add up to {layers}")
        return self.layer_split

    def stage_of_layers(self, layers: int) -> list[int]:
        """The stage of each of ``layers`` layers, in order."""
        return [stage for stage, count in enumerate(self.layers_per_stage(layers)) for _ in range(count)]

    def in_flight(self, pp_rank: int) -> int:
        """The most stage micro-batches (one stage module's forward of one micro-batch) whose
        activations pipeline rank ``pp_rank`` holds at once under this schedule, as torch orders
        its actions: GPipe runs every forward before any backward; 1F1B runs ``size - pp_rank``
        forwards before its first backward; Interleaved1F1B ``(virtual - 1) x micro-batches a
        round + 2 (size - 1 - pp_rank)`` (at most all of them), then one more forward before each
        backward; LoopedBFS every forward of every local stage first."""
        total = self.micro_batches * self.virtual_stages
        if self.schedule == "GPipe":
            return self.micro_batches
        if self.schedule == "1F1B":
            return min(self.micro_batches, self.size - pp_rank)
        if self.schedule == "LoopedBFS":
            return total
        per_round = self.micro_batches // max(1, self.micro_batches // self.size)
        warmup = min((self.virtual_stages - 1) * per_round + 2 * (self.size - 1 - pp_rank), total)
        return warmup + 1 if warmup < total else warmup


def _layer_counts(split: str | Sequence[int]) -> tuple[int, ...]:
    """A split given as counts: a sequence, or a command line's comma-separated string."""
    try:
        return tuple(int(item) for item in (split.split(",") if isinstance(split, str) else split))
    except ValueError:
        raise ValueError(f"layer split {split!r}: give {' or '.join(LAYER_SPLITS)}, or a layer count for each stage "
                         "(comma-separated on a command line, e.g. 15,16,16,15)") from None


def torchtitan_layer_counts(layers: int, stages: int, first_stage_less_layers: int = 1,
                            last_stage_less_layers: int = 1) -> tuple[int, ...]:
    """torchtitan's default split of ``layers`` over ``stages``: the embedding counts as
    ``first_stage_less_layers`` layers and the final norm with the head as
    ``last_stage_less_layers`` (its ``parallelism.pipeline_parallel_first/last_stage_less_layers``,
    1 each); the weighted total is dealt out evenly, the remainder one more to each of the first
    stages. Llama-3 405B's 126 layers over 8 stages: 15, 16, 16, 16, 16, 16, 16, 15."""
    if stages == 1:
        return (layers,)
    weighted = layers + first_stage_less_layers + last_stage_less_layers
    base, extra = divmod(weighted, stages)
    counts = [base + (stage < extra) for stage in range(stages)]
    counts[0] -= first_stage_less_layers
    counts[-1] -= last_stage_less_layers
    if any(count < 1 for count in counts):
        raise ValueError(f"torchtitan's split of {layers} layers over {stages} stages leaves a stage without layers "
                         f"({counts}): use fewer stages, or give a count for each stage")
    return tuple(counts)


@dataclass(frozen=True)
class StageContents:
    """What one pipeline rank holds: its stages, their layers (module names) and how many each
    stage has, the canonical names of its parameters, and the names of its buffers with the
    copies it holds of each (one a stage module holding it)."""

    stages: tuple[int, ...]
    layers: tuple[str, ...]
    stage_layers: tuple[int, ...]
    params: frozenset[str]
    buffers: Mapping[str, int]


def outermost_layers(layers: Sequence[tuple[str, nn.Module]]) -> list[str]:
    """The names of the unit modules no other unit module holds: the model's layers."""
    names = [name for name, _ in layers]
    return [n for n in names if not any(n.startswith(f"{other}.") for other in names)]


def split_stages(module: nn.Module, layers: Sequence[tuple[str, nn.Module]], spec: PipelineSpec) -> list[StageContents]:
    """Each pipeline rank's share of ``module`` (module docstring); ``layers``: the unit modules
    found in it (units.find_unit_modules), of which the outermost are the layers dealt out."""
    names = outermost_layers(layers)
    if not names:
        raise ValueError(
            "pipeline parallelism deals the model's layers out to its stages, and fsdp_unit_modules names none of "
            "its modules: name its block class (e.g. fsdp_unit_modules=[TransformerBlock])"
        )
    counts = spec.layers_per_stage(len(names))
    stage_of_layer = dict(zip(names, spec.stage_of_layers(len(names))))
    canonical = {id(p): n for n, p in module.named_parameters()}
    params: list[set[str]] = [set() for _ in range(spec.stages)]
    buffers: list[set[str]] = [set() for _ in range(spec.stages)]
    stage = 0  # the root's own parameters, and what comes before the first layer: the first stage
    for name, child in module.named_modules(remove_duplicate=False):
        layer = next((n for n in names if name == n or name.startswith(f"{n}.")), None)
        if layer is not None:
            stage = stage_of_layer[layer]  # outside the layers, ``stage`` stays the last layer's
        own_params = [canonical[id(p)] for p in child._parameters.values() if p is not None]
        params[stage].update(own_params)
        own_buffers = {f"{name}.{b}" if name else b for b, t in child._buffers.items() if t is not None}
        # Outside the layers, a module of buffers alone (a rotary embedding's frequencies) is
        # what every stage's layers read: each stage module keeps its own copy.
        for held in buffers if layer is None and not own_params else [buffers[stage]]:
            held.update(own_buffers)
    return [
        StageContents(
            spec.stages_of(rank),
            tuple(n for n in names if stage_of_layer[n] in spec.stages_of(rank)),
            tuple(counts[s] for s in spec.stages_of(rank)),
            frozenset().union(*(params[s] for s in spec.stages_of(rank))),
            Counter(name for s in spec.stages_of(rank) for name in buffers[s]),
        )
        for rank in range(spec.size)
    ]

