"""What one simulated rank allocated and sent, as numbers and as text."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from megatron_fsdp.simulate.compute import ComputeSegment
from megatron_fsdp.simulate.inventory import BucketRow
from megatron_fsdp.simulate.traffic import Collective, sent_in, step_collectives
from megatron_fsdp.simulate.world import MeshSizes

# The phases of a training step simulated (the wrap before them is "wrap"; a second step runs
# the same phases after "zero_grad"); under
# pipeline parallelism "schedule" holds the micro-batches' forwards and backwards as the
# schedule interleaves them, and the step's gradient reduction.
STEP_PHASES = ("forward", "backward", "schedule", "optimizer step")


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


def collective_lines(counts: Counter[tuple], sent: int, steps: int = 1) -> list[str]:
    """The step's collectives as a table: ``counts`` from :func:`traffic.step_collectives`."""
    same = ", the second step's the same" if steps == 2 else ""
    lines = [f"collectives in a step (the first{same}): {gib(sent)} sent by this rank",
             f"  {'op':<16}{'group':>6}{'dtype':>10}{'message bytes':>16}{'count':>7}"]
    for (op, size, dtype, nbytes), count in sorted(counts.items()):
        lines.append(f"  {op:<16}{size:>6}{dtype:>10}{nbytes:>16}{count:>7}")
    return lines


def bucket_lines(rows: list[BucketRow], title: str) -> list[str]:
    """The buckets (or FSDP2's parameter groups) as a table, their padding summed."""
    lines = [f"{title}: {len(rows)}, padding {sum(row.padding for row in rows)} elements in all",
             f"  {'unit':<28}{'dtype':>10}{'params':>7}{'numel':>14}{'padded':>14}{'shard':>12}{'group':>6}"]
    for row in rows:
        lines.append(f"  {row.unit[:28]:<28}{row.dtype:>10}{row.params:>7}{row.numel:>14}{row.padded_numel:>14}"
                     f"{row.shard_numel:>12}{row.group_size:>6}")
    return lines


class StepRecord:
    """What both sides' reports share (this file's and torch_fsdp2.py's): the rank and its mesh,
    ``model_states`` by kind after the last step, the ``steps`` simulated (2: a step with the
    optimizer state held from its start, as every step after the first), ``step_peak`` (the last
    step's peak: with 2 steps the steady state's, what a GPU needs from the second step on) and
    its kinds, ``first_step_peak`` and its kinds (the first step's, before the optimizer state
    exists), the ``collectives`` of the first step (traffic.py's record; the second's are checked
    to be the same) and the simulation's seconds."""

    rank: int
    mesh: MeshSizes
    model_states: dict[str, int]
    step_peak: int
    peak_breakdown: dict[str, int]
    first_step_peak: int
    first_step_breakdown: dict[str, int]
    steps: int
    collectives: list[Collective]
    seconds: float

    def peak_name(self) -> str:
        """Which step's peak ``step_peak`` is, in words."""
        if self.steps == 2:
            return "the second step's: the steady state, optimizer state held throughout"
        return "the first step's: before the optimizer state exists, so lower than every later step's"

    @property
    def model_state_bytes(self) -> int:
        return sum(self.model_states.values())

    def step_collectives(self) -> Counter[tuple]:
        """``(op, group size, dtype, message bytes) -> count`` over the training step."""
        return step_collectives(self.collectives, STEP_PHASES)

    def sent_per_step(self) -> int:
        """Bytes this rank sends in the step (ring algorithms; traffic.py's note)."""
        return sent_in(self.collectives, STEP_PHASES)

    def summary_dict(self, **own) -> dict:
        """The fields both reports have, ``own`` (the report's own) after the mesh."""
        mesh = self.mesh
        return {
            "rank": self.rank, "world_size": mesh.world_size, "pp": mesh.pp, "dp_outer": mesh.dp_outer,
            "dp_shard": mesh.dp_shard, "cp": mesh.cp, "tp": mesh.tp, **own, "model_states": self.model_states, "model_state_bytes": self.model_state_bytes,
            "steps": self.steps, "step_peak": self.step_peak, "step_peak_is": self.peak_name(),
            "peak_breakdown": self.peak_breakdown, "first_step_peak": self.first_step_peak,
            "first_step_breakdown": self.first_step_breakdown, "sent_per_step": self.sent_per_step(),
            "collectives": [
                {"op": op, "group_size": size, "dtype": dtype, "message_bytes": nbytes, "count": count}
                for (op, size, dtype, nbytes), count in sorted(self.step_collectives().items())
            ],
            "seconds": round(self.seconds, 3),
        }

    def summary_lines(self, what: str, peak: str) -> list[str]:
        """The text both reports start with: the rank, ``what`` simulated it, the model states by
        kind, the step's peak (``peak`` names its source) by kind and the collectives."""
        mesh = self.mesh
        lines = [f"rank {self.rank} of {mesh.world_size} ({' x '.join(f'{name} {size}' for name, size in mesh.shape())}), "
                 f"{what}; simulated in {self.seconds:.1f} s",
                 f"model states: {gib(self.model_state_bytes)}"]
        lines += [f"  {kind:<28}{gib(nbytes):>14}" for kind, nbytes in sorted(self.model_states.items())]
        lines.append(f"step peak: {gib(self.step_peak)}, {self.peak_name()} ({peak})")
        lines += [f"  {kind:<28}{gib(nbytes):>14}" for kind, nbytes in sorted(self.peak_breakdown.items())]
        if self.steps == 2:
            lines.append(f"first step's peak: {gib(self.first_step_peak)} (the optimizer state is made in its "
                         f"optimizer step; a job needs the larger of the two)")
            lines += [f"  {kind:<28}{gib(nbytes):>14}" for kind, nbytes in sorted(self.first_step_breakdown.items())]
        return lines + collective_lines(self.step_collectives(), self.sent_per_step(), self.steps)


@dataclass
class RankReport(StepRecord):
    """One rank after the wrap and ``steps`` training steps (StepRecord says which is which).

    ``model_states``: bytes by category (plan_memory's: compute weights, main weights, main
    grads, optimizer state, module buffers, bookkeeping) of every storage still live after the
    last step; ``step_peak``: the most bytes live at once during the last step and
    ``peak_breakdown`` what they were (model states by category, ``pool <key>``: the bucket pool's gathered weights and
    gradient buffers by role, the rest activations and temporaries); ``pool_peak``: the bucket
    pool's high-water mark; ``wrap_peak``: the most live during ``fully_shard`` (the unsharded
    model included: it is built whole, as fake tensors, before the wrap); ``collectives``: every
    collective issued, in order; ``buckets``: the layout; ``compute``: the compute between the
    collectives, its model FLOPs and the collective each piece waits for (compute.py)."""

    rank: int
    mesh: MeshSizes
    door: str
    strategy: str
    outer_strategy: str
    model_states: dict[str, int]
    step_peak: int
    peak_breakdown: dict[str, int]
    first_step_peak: int
    first_step_breakdown: dict[str, int]
    steps: int
    pool_peak: int
    wrap_peak: int
    collectives: list[Collective] = field(repr=False)
    buckets: list[BucketRow] = field(repr=False)
    seconds: float = 0.0
    compute: list[ComputeSegment] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return self.summary_dict(door=self.door, strategy=self.strategy, outer_strategy=self.outer_strategy,
                                 pool_peak=self.pool_peak, wrap_peak=self.wrap_peak,
                                 buckets=[row.__dict__ | {"padding": row.padding} for row in self.buckets])

    def __str__(self) -> str:
        outer = f", outer {self.outer_strategy}" if self.mesh.dp_outer > 1 else ""
        lines = self.summary_lines(f"{self.door} door, {self.strategy}{outer}",
                                   f"bucket pool high-water mark {gib(self.pool_peak)}")
        lines += bucket_lines(self.buckets, "buckets")
        return "\n".join(lines)
