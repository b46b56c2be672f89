"""One rank of a world of thousands, on a CPU: the real wrap and two real training steps (the
second's peak is the steady state's) of megatron_fsdp under torch's fake process group and ``FakeTensorMode``, with the memory the rank
allocates, the collectives it issues and its buckets' layout (docs/scaling.md).

``simulate_rank(build_model, MeshSizes(world_size, dp_outer=, tp=, cp=, pp=, ep=), rank, ...)`` returns a
:class:`RankReport`; ``python -m megatron_fsdp.simulate`` prints one per rank asked for
(command.py). No GPU and no real weights: every tensor is fake. ``predict_step_time`` times a
report's step on a :class:`Cluster` (step_time.py). ``compare_with_torch_fsdp2`` simulates the
same rank under torch's own FSDP2 as well and returns both side by side.
"""

from megatron_fsdp.simulate.comparison import Comparison, compare_with_torch_fsdp2
from megatron_fsdp.simulate.report import RankReport
from megatron_fsdp.simulate.runner import simulate_rank
from megatron_fsdp.simulate.step_time import Cluster, StepTime, optimizer_bytes, predict_step_time
from megatron_fsdp.simulate.world import MeshSizes

__all__ = ["Cluster", "Comparison", "MeshSizes", "RankReport", "StepTime", "compare_with_torch_fsdp2", "optimizer_bytes",
           "predict_step_time", "simulate_rank"]
