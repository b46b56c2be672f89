"""A conversion as data: steps that read some source tensors and write some target tensors.

A mapping table (``hf_names``, ``megatron_gpt``, ``megatron_layouts``) turns a source's tensor
names and shapes into a :class:`Plan`; the runner executes its steps one at a time (so what is in
memory is one step's tensors), each rank a disjoint share of them. Everything here is pure: the
checks that name an unknown, missing or mis-shaped tensor run on names and shapes alone, before a
byte is read or written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.sources import Region, TensorInfo


@dataclass(frozen=True)
class Read:
    """A source tensor, or a box of it (slices of its leading dimensions), reshaped to ``shape``
    when given (a parameter's piece of a flat buffer)."""

    name: str
    region: Region | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Write:
    """A target tensor, or the box of it at ``offsets`` (None: the whole tensor)."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Step:
    """``build`` turns the tensors of ``reads`` (in order) into those of ``writes`` (in order)."""

    reads: tuple[Read, ...]
    writes: tuple[Write, ...]
    build: Callable[[list[torch.Tensor]], list[torch.Tensor]]

    @property
    def label(self) -> str:
        return ", ".join(read.name for read in self.reads)


def same(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A step that copies its one tensor as it is."""
    return tensors


@dataclass
class Plan:
    """Every target tensor (global shape and dtype) and the steps that write them."""

    targets: dict[str, TensorInfo] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    # Non-tensor items the target format carries (Megatron-LM's ``args``, ``iteration``).
    objects: dict[str, object] = field(default_factory=dict)

    def add(self, reads: Sequence[Read], writes: Sequence[tuple[str, TensorInfo]], build: Callable) -> None:
        """One step writing whole target tensors."""
        for name, info in writes:
            self.targets[name] = info
        self.steps.append(Step(tuple(reads), tuple(Write(name, info.shape) for name, info in writes), build))

    def copy(self, source: str, target: str, info: TensorInfo) -> None:
        self.add([Read(source)], [(target, info)], same)


def expect_shape(name: str, found: TensorInfo, expected: tuple[int, ...], why: str) -> None:
    """Raises when the source tensor ``name`` does not have the shape the target config implies."""
    if tuple(found.shape) != tuple(expected):
        raise ConversionError(
            f"{name} has shape {list(found.shape)}, but {why} makes it {list(expected)}: the config given "
            f"(or read from the checkpoint's args) is not the one this checkpoint was trained with; fix the config "
            f"(--config / the model dimensions) to match the checkpoint"
        )


def refuse_unknown(names: Sequence[str], what: str, fix: str) -> None:
    """Raises naming the source tensors no rule of the mapping consumed."""
    if names:
        shown = ", ".join(sorted(names)[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        raise ConversionError(f"{what} does not know {len(names)} tensor(s) of the checkpoint: {shown}. {fix}")


def require(source_tensors: dict[str, TensorInfo], names: Sequence[str], what: str) -> None:
    """Raises naming the tensors a mapping needs that the checkpoint lacks."""
    missing = [name for name in names if name not in source_tensors]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ConversionError(
            f"the checkpoint lacks {len(missing)} tensor(s) that {what} needs: {shown}. Check that the config "
            f"(layers, experts, tied embeddings) is the checkpoint's, and that the checkpoint is complete"
        )


def share_of(steps: list[Step], targets: dict[str, TensorInfo], rank: int, world: int) -> list[Step]:
    """The steps rank ``rank`` of ``world`` runs: whole steps, balanced by bytes written (largest
    first to the least loaded rank), the same answer on every rank."""
    loads = [0] * world
    mine: list[tuple[int, Step]] = []

    def size(step: Step) -> int:
        return sum(TensorInfo(write.shape, targets[write.name].dtype).nbytes for write in step.writes)

    order = sorted(range(len(steps)), key=lambda index: (-size(steps[index]), index))
    for index in order:
        owner = min(range(world), key=lambda candidate: (loads[candidate], candidate))
        loads[owner] += size(steps[index])
        if owner == rank:
            mine.append((index, steps[index]))
    return [step for _, step in sorted(mine, key=lambda pair: pair[0])]
