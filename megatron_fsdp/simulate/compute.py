"""The compute a simulated rank issues between its collectives, and which collective each piece of
compute waits for: the step's schedule as the step-time model (step_time.py) reads it.

Every op the simulation runs is shown to :class:`ComputeLog` (observer.py). The ops issued
between two collectives form one :class:`ComputeSegment`, with their model FLOPs: matrix
products (``mm``, ``addmm``, ``bmm``, ``baddbmm``: ``2 m k n``) and scaled-dot-product attention
(``4 b h s_q s_k d`` forward, halved when causal, twice that backward), the convention of
examples/gpt_model.py's ``training_flops_per_token`` and of MFU; elementwise ops, norms and
embedding lookups count nothing.

Which collective a segment waits for is read from the data: each collective's outputs are marked
with its position in the step's list of collectives, every other op passes the newest mark among
its inputs on to its outputs (a gathered bucket copied into parameters keeps its gather's mark),
and a segment ``needs`` the newest mark any of its FLOP-counting ops reads: the gather whose
weights it multiplies, or tensor parallelism's all-reduce whose activations it takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_fsdp.engine.params.dtensor_params import local_tensor
from megatron_fsdp.simulate.traffic import is_collective


@dataclass
class ComputeSegment:
    """The ops issued after the step's first ``after`` collectives and before the next one, in
    ``phase``: their model ``flops`` and ``needs``, the position of the newest collective whose
    output they read (None: none)."""

    phase: str
    after: int
    flops: int = 0
    needs: int | None = None


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (an op's arguments; cheaper than pytree's
    flatten, which would cost every op of the simulation a good deal more)."""
    found, pending = [], [tree]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list)):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
    return found


def _storage(tensor: torch.Tensor) -> int:
    return local_tensor(tensor).untyped_storage()._cdata


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(local_tensor(tensor).shape)


def _bound(func, args: tuple, kwargs: dict) -> dict:
    """The op's arguments by their schema names."""
    names = [argument.name for argument in func._schema.arguments]
    return dict(zip(names, args)) | kwargs


def _attention_flops(func, args: tuple, kwargs: dict) -> int:
    arguments = _bound(func, args, kwargs)
    batch, heads, query_len, head_dim = _shape(arguments["query"])
    key_len = _shape(arguments["key"])[-2]
    flops = 4 * batch * heads * query_len * key_len * head_dim  # q k^T and the weighted sum of v
    if arguments.get("is_causal", False):
        flops //= 2
    return 2 * flops if func._opname.endswith("_backward") else flops


def model_flops(func, args: tuple, kwargs: dict) -> int:
    """The model FLOPs of one aten op (the module's note); 0 for any other op."""
    name = func._opname
    if name == "mm":
        (m, k), n = _shape(args[0]), _shape(args[1])[1]
        return 2 * m * k * n
    if name == "addmm":
        (m, k), n = _shape(args[1]), _shape(args[2])[1]
        return 2 * m * k * n
    if name in ("bmm", "baddbmm"):
        first, second = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        (b, m, k), n = _shape(first), _shape(second)[2]
        return 2 * b * m * k * n
    if name.startswith("_scaled_dot_product_"):
        return _attention_flops(func, args, kwargs)
    return 0


def _written_arguments(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The arguments an op's schema marks as written (in place, or ``out=``)."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if position < len(args):
            written += _tensors(args[position])
        elif argument.name in kwargs:
            written += _tensors(kwargs[argument.name])
    return written


class ComputeLog:
    """Segments of compute between collectives, their FLOPs and what they wait for; ``phase``
    names the part of the step (a new phase starts a new segment)."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.segments: list[ComputeSegment] = []
        self._collectives = 0
        self._mark: dict[int, int] = {}  # storage -> position of the newest collective it derives from
        self._current: ComputeSegment | None = None

    def start_phase(self, phase: str) -> None:
        self.phase = phase
        self._current = None

    def observe(self, func, args: tuple, kwargs: dict, out) -> None:
        """After ``func(*args, **kwargs)`` returned ``out``."""
        written = _written_arguments(func, args, kwargs)
        if is_collective(func):
            for key in map(_storage, written + _tensors(out)):
                self._mark[key] = self._collectives
            self._collectives += 1
            self._current = None
            return
        inputs = set(map(_storage, _tensors((args, kwargs))))
        newest = max((self._mark[key] for key in inputs if key in self._mark), default=None)
        if newest is not None:  # written in place: what it held before still counts
            for key in map(_storage, written):
                self._mark[key] = max(self._mark.get(key, newest), newest)
        for key in set(map(_storage, _tensors(out))) - inputs:
            # A new storage (perhaps where a freed one was): marked by its inputs alone.
            if newest is None:
                self._mark.pop(key, None)
            else:
                self._mark[key] = newest
        flops = model_flops(func, args, kwargs)
        if not flops:
            return
        if self._current is None:
            self._current = ComputeSegment(self.phase, self._collectives)
            self.segments.append(self._current)
        self._current.flops += flops
        if newest is not None:
            self._current.needs = max(newest, -1 if self._current.needs is None else self._current.needs)
