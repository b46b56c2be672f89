"""Every collective a simulated rank issues, read where torch dispatches it.

torch.distributed's collectives (the engine's, through engine/groups/collectives.py, and torch's
own: DeviceMesh, DTensor's functional collectives) reach the dispatcher as ``c10d`` and
``_c10d_functional`` ops carrying their process group. :class:`CollectiveLog` (shown every op by
observer.py's dispatch mode) records each: the op, its group's size, dtype, message bytes and the bytes this rank sends.

Bytes sent are the ring algorithms' (NCCL's, and its bus-bandwidth convention) for a message of
``n`` bytes over ``g`` ranks: all-gather (``n`` the gathered output) and reduce-scatter (``n``
the full input) send ``n (g-1)/g``; all-reduce ``2 n (g-1)/g``; all-to-all the input less the
rank's own chunk, ``n (g-1)/g`` when even; broadcast ``n``; point-to-point sends ``n``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from megatron_fsdp.simulate.memory import COLLECTIVE_NAMESPACES


@dataclass(frozen=True)
class Collective:
    """One collective as issued: ``op`` (all_gather, reduce_scatter, all_reduce, all_to_all,
    broadcast, ...), the phase of the step, its group's size, the dtype and the message bytes
    (all-gather: the gathered output; reduce-scatter: the full input; others: the tensor);
    ``group_ranks``: the group's global ranks (None: not known), which tell the step-time model
    how many nodes the group spans."""

    phase: str
    op: str
    group_size: int
    dtype: torch.dtype
    message_bytes: int
    sent_bytes: int
    group_ranks: tuple[int, ...] | None = None


def step_collectives(collectives: list[Collective], phases: tuple[str, ...]) -> Counter[tuple]:
    """``(op, group size, dtype, message bytes) -> count`` over the collectives issued in ``phases``."""
    return Counter(
        (c.op, c.group_size, str(c.dtype).removeprefix("torch."), c.message_bytes)
        for c in collectives if c.phase in phases
    )


def sent_in(collectives: list[Collective], phases: tuple[str, ...]) -> int:
    """The bytes sent by the collectives issued in ``phases`` (ring algorithms; the module's note)."""
    return sum(c.sent_bytes for c in collectives if c.phase in phases)


def count_difference(first: list[Collective], second: list[Collective], phases: tuple[str, ...]) -> str | None:
    """How two steps' collectives in ``phases`` differ, counted by (phase, op, group, dtype,
    bytes), in words; None when they are the same. Their order is not compared: from the second
    step on, the engine prefetches each unit's forward gather in the order it recorded in the step
    before (engine/step/schedule.py), so a gather may come before the tensor-parallel all-reduces
    of the unit before it, where the first step issues it after them."""
    def counted(collectives: list[Collective]) -> Counter[tuple]:
        return Counter((c.phase, c.op, c.group_ranks or c.group_size, str(c.dtype).removeprefix("torch."),
                        c.message_bytes) for c in collectives if c.phase in phases)

    one, two = counted(first), counted(second)
    if one == two:
        return None
    only = [f"{key[:2]} {key[3]} {key[4]} bytes: {one[key]} in the first step, {two[key]} in the second"
            for key in sorted(one.keys() | two.keys(), key=str) if one[key] != two[key]]
    return "; ".join(only[:3]) + (f" (and {len(only) - 3} more)" if len(only) > 3 else "")


# The dispatcher's name of each collective -> (our name, which tensor argument is the message).
_OPS = {
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", None),  # functional: the output is the message
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast_": ("broadcast", 0),
    "broadcast": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "scatter_": ("scatter", 0),
    "gather_": ("gather", 1),
    "barrier": ("barrier", None),
}


def sent_bytes(op: str, message_bytes: int, group_size: int) -> int:
    """What this rank sends for ``op`` over ``message_bytes`` (the module's note)."""
    if group_size <= 1 or op in ("recv", "barrier"):
        return 0
    if op in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        return message_bytes * (group_size - 1) // group_size
    if op == "all_reduce":
        return 2 * message_bytes * (group_size - 1) // group_size
    return message_bytes  # broadcast, send


def is_collective(func) -> bool:
    """Whether a dispatched op is one of torch.distributed's collectives."""
    return func.namespace in COLLECTIVE_NAMESPACES and func._opname in _OPS


def _process_group(args: tuple, kwargs: dict) -> dist.ProcessGroup:
    for arg in tree_flatten((args, kwargs))[0]:
        if isinstance(arg, dist.ProcessGroup):
            return arg
        if isinstance(arg, torch.ScriptObject):  # the dispatcher's boxed ProcessGroup (or Work, ReduceOp)
            try:
                return dist.ProcessGroup.unbox(arg)
            except RuntimeError:
                continue
    for arg in tree_flatten((args, kwargs))[0]:
        if isinstance(arg, str):  # a functional collective names its group
            try:
                return dist.distributed_c10d._resolve_process_group(arg)
            except (RuntimeError, ValueError):
                continue
    raise RuntimeError("a collective without a process group")


def _message(args: tuple, out, position: int | None) -> list[torch.Tensor]:
    source = tree_flatten(out)[0] if position is None else tree_flatten(args[position])[0]
    return [t for t in source if isinstance(t, torch.Tensor)]


class CollectiveLog:
    """Records the collectives among the ops it observes; ``phase`` names the part of the step."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.collectives: list[Collective] = []
        self._ranks: dict[str, tuple[int, ...]] = {}  # group name -> its global ranks, one tuple a group

    def observe(self, func, args: tuple, kwargs: dict, out) -> None:
        """After ``func(*args, **kwargs)`` returned ``out``: records it if it is a collective."""
        if not is_collective(func):
            return
        op, position = _OPS[func._opname]
        group = _process_group(args, kwargs)
        size = group.size()
        ranks = self._ranks.get(group.group_name)
        if ranks is None:
            ranks = self._ranks[group.group_name] = tuple(dist.get_process_group_ranks(group))
        tensors = _message(args, out, position)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        dtype = tensors[0].dtype if tensors else torch.uint8
        self.collectives.append(Collective(self.phase, op, size, dtype, nbytes, sent_bytes(op, nbytes, size), ranks))
