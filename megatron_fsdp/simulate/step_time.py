"""How long a simulated rank's training step takes on a GPU cluster: its compute at a measured
rate, its collectives at NCCL's bus bandwidths and ring latencies, overlapped as the schedule
issues them (docs/scaling.md, "Step time").

The input is the step as the simulator recorded it (any door, any front end that fills the same
records): the collectives in issue order (traffic.py's :class:`Collective`: op, group ranks,
message bytes) and the compute between them (compute.py's :class:`ComputeSegment`: model FLOPs,
the collective each segment waits for), plus the bytes the optimizer step streams through memory.

The rules, one GPU's two streams:

- compute runs in issue order, each segment for ``flops / achieved_flops_per_s``, and starts once
  the previous segment has ended and the collective it reads from has landed;
- collectives run one at a time in issue order on a communication stream (NCCL's kernels share
  the links, so two at once would each go at half speed), each starting once the compute issued
  before it has ended (CUDA's stream order: a reduce-scatter waits for the backward that made its
  gradients) or, for an all-gather of weights a later segment reads, once the segment before its
  reader has *started*: the engine's one-unit-ahead prefetch, as every step after the first
  issues it (unit ``i+1``'s gather under unit ``i``'s compute). What no compute hides is exposed:
  the first gathers, the last reduce-scatters and the HSDP all-reduces issued behind them;
- the optimizer step starts after every collective of forward and backward has landed (the
  engine finishes its reductions first) and takes ``optimizer_bytes / hbm_bytes_per_s``: AdamW is
  bound by memory, not FLOPs; the optimizer step's own collectives (ZeRO-1/2's gathers of the
  stepped weights) follow it, exposed.

A collective of ``n`` message bytes over ``g`` ranks takes ``latency + n * factor / bus_bandwidth``,
NCCL's bus-bandwidth convention (nccl-tests' doc/PERFORMANCE.md): ``factor`` is ``(g-1)/g`` for
all-gather and reduce-scatter (and all-to-all), ``2(g-1)/g`` for all-reduce, 1 for broadcast and
point-to-point. The bus bandwidth is the intra-node one when the group sits in one node; across
nodes, NCCL's rings leave each node through one NIC per ring, so a group with ``k`` ranks in each
node gets ``min(intra, k * nic)``. The latency is NCCL's ring model (src/graph/tuning.cc, Simple
protocol): a base plus a per-step latency for each of the ``g-1`` steps (``2(g-1)`` for all-reduce),
the network's for the steps that cross nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_fsdp.simulate.compute import ComputeSegment
from megatron_fsdp.simulate.traffic import Collective

# The phases timed, in order; the optimizer step is the last.
TIMED_PHASES = ("forward", "backward", "optimizer step")
OPTIMIZER_PHASE = "optimizer step"


@dataclass(frozen=True)
class Cluster:
    """The GPUs and links a step runs on. Defaults: 8-GPU H200 SXM nodes, 8 x 400 Gb/s InfiniBand.

    - ``achieved_tflops``: model TFLOP/s one GPU sustains in forward and backward (not the peak):
      510, fitted from our own 1 x H200 step of a Llama-3-8B-shaped GPT at batch 1 x 4,096 (487 ms,
      of which the optimizer's memory traffic is 62 ms: benchmarks/results/
      2026-11-29_h200x1_scaling_8B_mbs1_seq4096.json, fitted by benchmarks/step_time_validation.py).
    - ``hbm_bytes_per_s``: what a streaming kernel reaches in device memory: 4.03e12 on an H200
      (torch's copy_, benchmarks/results/2026-11-23_h200_op_bandwidth.json; 2.86e12 on an H100,
      2026-11-24_h100x1_op_bandwidth.json).
    - ``intra_node_bus_bytes_per_s``: NCCL bus bandwidth within a node: 450 GB/s, NVLink 4's
      unidirectional bandwidth per H100/H200 SXM GPU, which nccl-tests reaches on 8-GPU nodes.
    - ``nic_bytes_per_s``: one 400 Gb/s InfiniBand NIC per GPU (DGX/HGX H100 and H200), 50 GB/s.
    - ``base_latency_s``, ``intra_node_step_latency_s``, ``inter_node_step_latency_s``: NCCL's ring
      latencies for its Simple protocol (8.4, 3.4 and 9.6 us in src/graph/tuning.cc).
    """

    achieved_tflops: float = 510.0
    hbm_bytes_per_s: float = 4.03e12
    gpus_per_node: int = 8
    intra_node_bus_bytes_per_s: float = 450e9
    nic_bytes_per_s: float = 50e9
    base_latency_s: float = 8.4e-6
    intra_node_step_latency_s: float = 3.4e-6
    inter_node_step_latency_s: float = 9.6e-6

    def __post_init__(self) -> None:
        rates = {name: getattr(self, name) for name in ("achieved_tflops", "hbm_bytes_per_s", "gpus_per_node",
                                                         "intra_node_bus_bytes_per_s", "nic_bytes_per_s")}
        bad = [f"{name}={value}" for name, value in rates.items() if not value > 0]
        if bad:
            raise ValueError(f"cluster rates must be positive: {', '.join(bad)}")


def _bus_factor(op: str, group_size: int) -> float:
    if op == "all_reduce":
        return 2 * (group_size - 1) / group_size
    if op in ("broadcast", "send", "recv"):
        return 1.0
    return (group_size - 1) / group_size


def _nodes(group_ranks: Sequence[int], gpus_per_node: int) -> tuple[int, int]:
    """(nodes the group spans, most of its ranks in one node)."""
    per_node: dict[int, int] = {}
    for rank in group_ranks:
        per_node[rank // gpus_per_node] = per_node.get(rank // gpus_per_node, 0) + 1
    return len(per_node), max(per_node.values())


def collective_seconds(op: str, message_bytes: int, group_size: int, cluster: Cluster,
                       group_ranks: Sequence[int] | None = None) -> float:
    """One collective's time (the module's note). ``group_ranks``: its global ranks; None takes
    ``range(group_size)``, consecutive ranks from a node's first."""
    if group_size <= 1:
        return 0.0
    ranks = range(group_size) if group_ranks is None else group_ranks
    nodes, most_in_a_node = _nodes(ranks, cluster.gpus_per_node)
    bandwidth = cluster.intra_node_bus_bytes_per_s
    if nodes > 1:
        bandwidth = min(bandwidth, most_in_a_node * cluster.nic_bytes_per_s)
    steps, node_steps = group_size - 1, nodes - 1
    if op == "all_reduce":
        steps, node_steps = 2 * steps, 2 * node_steps
    latency = (cluster.base_latency_s + (steps - node_steps) * cluster.intra_node_step_latency_s
               + node_steps * cluster.inter_node_step_latency_s)
    return latency + message_bytes * _bus_factor(op, group_size) / bandwidth


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time and where it goes: ``compute`` (forward and backward at the rate),
    ``optimizer`` (the optimizer step's memory traffic), ``communication`` (every collective's own
    time, hidden or not) and ``exposed_communication``, what the step waits on beyond compute and
    optimizer: ``seconds - compute - optimizer``."""

    seconds: float
    compute: float
    optimizer: float
    communication: float

    @property
    def exposed_communication(self) -> float:
        return self.seconds - self.compute - self.optimizer


@dataclass
class _Event:
    """One compute segment (``collective`` None) or one collective (its position) on the timeline."""

    seconds: float
    collective: int | None = None
    needs: int | None = None  # a compute segment: the position of the collective it reads
    prefetchable: bool = False  # a collective: a gather of weights, which the engine issues a unit early
    optimizer: bool = False
    start: float = 0.0
    end: float = 0.0


def _timeline(collectives: Sequence[Collective], compute: Sequence[ComputeSegment], cluster: Cluster,
              optimizer_seconds: float) -> list[_Event]:
    """The timed phases' compute and collectives in issue order, with the optimizer step's
    memory work as one compute segment after the last collective of backward."""
    timed = [i for i, c in enumerate(collectives) if c.phase in TIMED_PHASES]
    optimizer_at = next((i for i in timed if collectives[i].phase == OPTIMIZER_PHASE), len(collectives))
    flops_per_s = cluster.achieved_tflops * 1e12
    segments: dict[int, list[_Event]] = {}
    for segment in compute:
        if segment.phase in TIMED_PHASES:
            segments.setdefault(segment.after, []).append(_Event(segment.flops / flops_per_s, needs=segment.needs))
    before_optimizer = max((i for i in timed if i < optimizer_at), default=None)
    segments.setdefault(optimizer_at, []).insert(0, _Event(optimizer_seconds, needs=before_optimizer, optimizer=True))
    events: list[_Event] = []
    for position in range(len(collectives) + 1):
        events += segments.get(position, [])
        if position < len(collectives) and collectives[position].phase in TIMED_PHASES:
            c = collectives[position]
            seconds = collective_seconds(c.op, c.message_bytes, c.group_size, cluster, c.group_ranks)
            prefetchable = c.op == "all_gather" and c.phase != OPTIMIZER_PHASE
            events.append(_Event(seconds, collective=position, prefetchable=prefetchable))
    return events


def _earliest_sources(events: list[_Event]) -> dict[int, tuple[_Event | None, _Event | None]]:
    """For each collective's event index: (the compute segment issued last before it, and, for a
    gather of weights a later segment reads, the segment issued just before that reader: the
    prefetch point)."""
    sources = {}
    last_compute: _Event | None = None
    for index, event in enumerate(events):
        if event.collective is None:
            last_compute = event
            continue
        previous, prefetch_point = last_compute, None
        for later in events[index + 1:] if event.prefetchable else ():
            if later.collective is None and not later.optimizer:
                if later.needs == event.collective:
                    prefetch_point = previous
                    break
                previous = later
        sources[index] = (last_compute, prefetch_point)
    return sources


def predict_step_time(collectives: Sequence[Collective], compute: Sequence[ComputeSegment], optimizer_bytes: int,
                      cluster: Cluster = Cluster()) -> StepTime:
    """The step's time on ``cluster`` (the module's rules): ``collectives`` in issue order (the
    whole list a :class:`RankReport` holds; the wrap's are not timed), ``compute`` the segments
    between them, ``optimizer_bytes`` what the optimizer step reads and writes
    (:func:`optimizer_bytes`)."""
    if any(c.phase == "schedule" for c in collectives) or any(s.phase == "schedule" for s in compute):
        raise ValueError("a pipeline-parallel step (its 'schedule' phase) is not timed: the model has no pipeline "
                         "bubble, so it would under-predict")
    optimizer_seconds = optimizer_bytes / cluster.hbm_bytes_per_s
    events = _timeline(collectives, compute, cluster, optimizer_seconds)
    sources = _earliest_sources(events)
    for _ in range(len(events) + 1):  # settles in a few passes: each only moves times later
        changed = False
        compute_free = link_free = 0.0
        landed: dict[int, float] = {}
        for index, event in enumerate(events):
            if event.collective is None:
                start = max(compute_free, landed.get(event.needs, 0.0))
            else:
                issued_after, prefetch_point = sources[index]
                ready = issued_after.end if issued_after is not None else 0.0
                if prefetch_point is not None:
                    ready = min(ready, prefetch_point.start)
                start = max(link_free, ready)
            changed |= start != event.start
            event.start, event.end = start, start + event.seconds
            if event.collective is None:
                compute_free = event.end
            else:
                link_free = landed[event.collective] = event.end
        if not changed:
            break
    compute_seconds = sum(e.seconds for e in events if e.collective is None) - optimizer_seconds
    return StepTime(
        seconds=max((e.end for e in events), default=0.0), compute=compute_seconds, optimizer=optimizer_seconds,
        communication=sum(e.seconds for e in events if e.collective is not None),
    )


def optimizer_bytes(model_states: dict[str, int]) -> int:
    """What an Adam-style step streams through device memory, from a rank's model states by kind
    (RankReport.model_states): reads and writes its main weights and optimizer state, reads its
    main gradients, and writes the compute weights it keeps apart from the main ones."""
    return (2 * (model_states.get("main weights", 0) + model_states.get("optimizer state", 0))
            + model_states.get("main grads", 0) + model_states.get("compute weights", 0))
