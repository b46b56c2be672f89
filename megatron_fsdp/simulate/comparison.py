"""Ours and torch's FSDP2 side by side: the same rank of the same world, model, mesh, precision,
optimizer and step, each simulated in a world of its own (runner.py, torch_fsdp2.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.simulate.report import RankReport
from megatron_fsdp.simulate.runner import simulate_rank
from megatron_fsdp.simulate.torch_fsdp2 import TorchFSDP2Report, simulate_torch_fsdp2
from megatron_fsdp.simulate.world import MeshSizes

# Ours' model-state categories under FSDP2's tracker kinds (ours keeps compute and main weights
# apart where they differ in dtype; FSDP2 keeps only the main ones and casts as it gathers).
_OURS_AS_FSDP2 = {
    "weights": ("compute weights", "main weights"),
    "gradients": ("main grads",),
    "optimizer state": ("optimizer state",),
    "buffers and bookkeeping": ("module buffers", "bookkeeping"),
}
_FSDP2_KINDS = {"weights": "Sharded Param", "gradients": "Sharded Grad", "optimizer state": "OptState",
                "buffers and bookkeeping": "Buffer"}


def _size(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least one."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3f} {unit}"
    return f"{nbytes} B"


def message_bytes(counts: Counter[tuple], op: str) -> int:
    """The bytes of every ``op`` message in ``counts`` (``step_collectives()``): for all-gathers
    the gathered bytes, for reduce-scatters the bytes reduced."""
    return sum(nbytes * count for (name, _, _, nbytes), count in counts.items() if name == op)


@dataclass
class Comparison:
    """``ours`` (:class:`RankReport`) and ``torch_fsdp2`` (:class:`TorchFSDP2Report`) for one rank."""

    ours: RankReport
    torch_fsdp2: TorchFSDP2Report

    def rows(self) -> list[tuple[str, int, int]]:
        """(what, ours, FSDP2's): model states by kind (bytes after the step), the step's peak
        (the second step's: the steady state) and the first step's,
        the bytes gathered and reduce-scattered in the step, the bytes this rank sends, and each
        side's padding in elements."""
        ours, theirs = self.ours, self.torch_fsdp2
        rows = [(what, sum(ours.model_states.get(k, 0) for k in kinds), theirs.model_states.get(_FSDP2_KINDS[what], 0))
                for what, kinds in _OURS_AS_FSDP2.items()]
        rows.append(("model states", ours.model_state_bytes, theirs.model_state_bytes))
        rows.append(("step peak", ours.step_peak, theirs.step_peak))  # both the last step's (StepRecord)
        if ours.steps == 2:
            rows.append(("first step's peak", ours.first_step_peak, theirs.first_step_peak))
        for op, what in (("all_gather", "all-gathered per step"), ("reduce_scatter", "reduce-scattered per step")):
            rows.append((what, message_bytes(ours.step_collectives(), op), message_bytes(theirs.step_collectives(), op)))
        rows.append(("sent per step", ours.sent_per_step(), theirs.sent_per_step()))
        rows.append(("padding (elements)", sum(r.padding for r in ours.buckets), sum(r.padding for r in theirs.groups)))
        return rows

    def to_dict(self) -> dict:
        return {"rank": self.ours.rank, "world_size": self.ours.mesh.world_size,
                "rows": [{"what": what, "ours": a, "torch_fsdp2": b} for what, a, b in self.rows()],
                "ours": self.ours.to_dict(), "torch_fsdp2": self.torch_fsdp2.to_dict()}

    def __str__(self) -> str:
        mesh = self.ours.mesh
        lines = [f"rank {self.ours.rank} of {mesh.world_size} (dp_outer {mesh.dp_outer} x dp_shard {mesh.dp_shard} x "
                 f"tp {mesh.tp}{f' x pp {mesh.pp}' if mesh.pp > 1 else ''}): ours ({self.ours.door} door, {self.ours.seconds:.1f} s) and torch's FSDP2 "
                 f"({self.torch_fsdp2.seconds:.1f} s)",
                 f"  {'':<28}{'ours':>14}{'FSDP2':>14}"]
        for what, ours, theirs in self.rows():
            if what.startswith("padding"):
                lines.append(f"  {what:<28}{ours:>14}{theirs:>14}")
            else:
                lines.append(f"  {what:<28}{_size(ours):>14}{_size(theirs):>14}")
        return "\n".join(lines)


def compare_with_torch_fsdp2(build_model: Callable[[], nn.Module], mesh: MeshSizes, rank: int = 0, *,
                             door: str = "whole_model", **options) -> Comparison:
    """Rank ``rank`` simulated twice: ours (``door``, ZeRO-3, HSDP replicas unsharded: what
    FSDP2 does) and torch's FSDP2, with the same keyword ``options``: those
    :func:`torch_fsdp2.simulate_torch_fsdp2` takes (``fsdp_unit_modules``, required;
    ``mixed_precision_policy``, ours, which torch's FSDP2 takes as ``torch_policy`` maps it; with
    ``door`` "fsdp2", which ignores it (doors.py), torch's FSDP2 too is given the door's float32
    parameters and float32 gradient reduction; ``optimizer``, ``tensor_parallel_plan``,
    ``batch_size``, ``seq_len``, ``loss_fn``, ``steps``, and under ``mesh.pp`` > 1 the pipeline's:
    ``pipeline_schedule``, ``micro_batches``, ``pipeline_layer_split``, ``reshard_after_forward``;
    ours then through the FSDP2 door). Expert parallelism is refused."""
    if door == "fsdp2":  # ours' FSDP2 door ignores the policy: FSDP2's side takes the door's precision (doors.py)
        options = options | dict(mixed_precision_policy=MixedPrecisionPolicy(torch.float32, grad_comm_dtype=torch.float32))
    theirs = simulate_torch_fsdp2(build_model, mesh, rank, **options)
    ours = simulate_rank(build_model, mesh, rank, door=door, **options)
    return Comparison(ours, theirs)
