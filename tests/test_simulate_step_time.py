"""The step-time model (megatron_fsdp/simulate/step_time.py, compute.py): its collective times
and overlap rule against numbers worked by hand, the simulator's FLOP count against
examples/gpt_model.py's formula (the one benchmarks/step_time.py reports TFLOP/s by), and its
predictions against our measured steps in benchmarks/results (benchmarks/step_time_validation.py).
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter

import pytest
import torch

from megatron_fsdp.simulate import MeshSizes, compare_with_torch_fsdp2, simulate_rank
from megatron_fsdp.simulate.comparison import message_bytes
from megatron_fsdp.simulate.compute import ComputeSegment
from megatron_fsdp.simulate.models import hugging_face
from megatron_fsdp.simulate.step_time import Cluster, collective_seconds, optimizer_bytes, predict_step_time
from megatron_fsdp.simulate.traffic import Collective

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import step_time_validation as validation  # noqa: E402
from gpt_model import GPTConfig, TransformerBlock, gpt, training_flops_per_token  # noqa: E402

US = 1e-6


@pytest.mark.parametrize("op, message_bytes, ranks, expected", [
    # 8 ranks of one node: 8.4 us + 7 NVLink steps of 3.4 us; 1 GB x 7/8 at 450 GB/s.
    ("all_gather", 10**9, tuple(range(8)), 32.2 * US + 1.9444444444e-3),
    # 16 ranks over two full nodes: 14 NVLink steps and one network step; 8 NICs of 50 GB/s a node (400 < 450).
    ("reduce_scatter", 10**9, tuple(range(16)), (8.4 + 14 * 3.4 + 9.6) * US + 2.34375e-3),
    # HSDP's replicas, one rank a node: 2 x 3 network steps; 2 x 3/4 of 100 MB through one 50 GB/s NIC.
    ("all_reduce", 10**8, (0, 8, 16, 24), (8.4 + 6 * 9.6) * US + 3e-3),
    ("all_gather", 10**9, (5,), 0.0),  # a group of one moves nothing
])
def test_a_collective_takes_nccls_ring_latency_plus_its_bus_bytes_over_the_bus_bandwidth(op, message_bytes, ranks,
                                                                                      expected) -> None:
    seconds = collective_seconds(op, message_bytes, len(ranks), Cluster(), ranks)
    assert seconds == pytest.approx(expected, rel=1e-9)


def _collective(phase: str, op: str) -> Collective:
    # 2e6 bytes over 2 ranks at 1e9 B/s without latency: 1 ms.
    return Collective(phase, op, 2, torch.bfloat16, 2 * 10**6, 10**6, (0, 1))


def test_gathers_prefetch_under_the_unit_before_and_what_nothing_hides_is_exposed() -> None:
    """Two units. Forward: gather 0 (c0), unit 0 (2 ms), gather 1 (c1), unit 1; backward: unit 1,
    reduce-scatter 1 (c2), unit 0, reduce-scatter 0 (c3); then a 1 ms optimizer step. By hand
    (ms): c0 0-1, exposed; unit 0 1-3; c1 may start when unit 0 starts (the prefetch) but the link
    is busy until 1: 1-2, hidden; unit 1 3-5, backward unit 1 5-7; c2 waits for the backward that
    made its gradients: 7-8, under backward unit 0 7-9; c3 9-10, exposed; the optimizer waits for
    every reduction: 10-11."""
    collectives = [_collective("forward", "all_gather"), _collective("forward", "all_gather"),
                   _collective("backward", "reduce_scatter"), _collective("backward", "reduce_scatter")]
    compute = [ComputeSegment("forward", 1, 2 * 10**6, needs=0), ComputeSegment("forward", 2, 2 * 10**6, needs=1),
               ComputeSegment("backward", 2, 2 * 10**6, needs=1), ComputeSegment("backward", 3, 2 * 10**6, needs=0)]
    cluster = Cluster(achieved_tflops=1e-3, hbm_bytes_per_s=1e9, intra_node_bus_bytes_per_s=1e9, base_latency_s=0.0,
                      intra_node_step_latency_s=0.0)
    step = predict_step_time(collectives, compute, 10**6, cluster)
    assert (step.seconds, step.compute, step.optimizer, step.communication) == pytest.approx((11e-3, 8e-3, 1e-3, 4e-3))
    assert step.exposed_communication == pytest.approx(2e-3)
    # Unit 1 reading gather 0 instead (no gather ahead of it to wait for): gather 1 still runs, but
    # hides under unit 0 and nothing waits for it until the optimizer step.
    compute[1] = ComputeSegment("forward", 2, 2 * 10**6, needs=0)
    assert predict_step_time(collectives, compute, 10**6, cluster).seconds == pytest.approx(11e-3)


def test_adam_streams_its_states_once_each_way_and_the_gradients_once() -> None:
    states = {"main weights": 4, "optimizer state": 8, "main grads": 2, "compute weights": 1, "bookkeeping": 100}
    assert optimizer_bytes(states) == 2 * (4 + 8) + 2 + 1


def test_torch_fsdp2s_step_is_timed_from_its_own_records_beside_ours() -> None:
    """A 1-layer Llama-3 8B at 4,096 ranks through torch's FSDP2 and ours, as
    benchmarks/scaling_plots.py draws both: the same model FLOPs timed on each side; FSDP2's
    optimizer streams its fp32 parameters and Adam moments both ways and its fp32 gradients once
    (28 bytes a padded shard element); each side gathers its padded numel (the layer in forward and
    again in backward, the root once), so the two differ by the padding comparison.py reports,
    FSDP2's the more (each parameter's dim 0 to a multiple of 4,096: k_proj's 1,024 rows to 4,096)."""
    llama = hugging_face("llama3-8b", torch.bfloat16, 1)
    comparison = compare_with_torch_fsdp2(llama.build, MeshSizes(4096), 0, fsdp_unit_modules=list(llama.units))
    ours, theirs = comparison.ours, comparison.torch_fsdp2
    ours_step = predict_step_time(ours.collectives, ours.compute, optimizer_bytes(ours.model_states))
    step = predict_step_time(theirs.collectives, theirs.compute, optimizer_bytes(theirs.model_states_as_ours()))
    # The same FLOPs in differently cut segments: only the sums' rounding differs.
    assert step.compute == pytest.approx(ours_step.compute, rel=1e-12) and step.compute > 0.01
    shard_numel = sum(group.shard_numel for group in theirs.groups)
    step_counters = theirs.shard_bytes["OptState"] - 8 * shard_numel  # AdamW's step count, a scalar a parameter
    assert 0 < step_counters <= 8 * sum(group.params for group in theirs.groups)
    assert step.optimizer * Cluster().hbm_bytes_per_s == pytest.approx(28 * shard_numel + 2 * step_counters, rel=1e-12)

    def gathered(rows) -> int:  # bf16 gathers: 2 bytes an element
        return sum(2 * row.padded_numel * (1 if row.unit == "<root>" else 2) for row in rows)

    def layer_padding(rows) -> int:
        return sum(row.padding for row in rows if row.unit != "<root>")

    assert message_bytes(ours.step_collectives(), "all_gather") == gathered(ours.buckets)
    assert message_bytes(theirs.step_collectives(), "all_gather") == gathered(theirs.groups)
    rows = {what: (a, b) for what, a, b in comparison.rows()}
    (ours_padding, their_padding), (ours_gathered, their_gathered) = rows["padding (elements)"], rows["all-gathered per step"]
    assert their_padding > ours_padding
    assert their_gathered - ours_gathered == 2 * (their_padding - ours_padding
                                                 + layer_padding(theirs.groups) - layer_padding(ours.buckets))
    assert step.seconds > step.compute + step.optimizer  # the first gathers and the last reductions are exposed


def test_the_simulated_step_counts_the_benchmarks_model_flops_and_reads_each_layers_gather() -> None:
    config = GPTConfig(vocab_size=512, seq_len=64, layers=3, hidden=64, heads=4, ffn=176)
    batch = 2

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return gpt(**vars(config)).to(torch.bfloat16)

    report = simulate_rank(build, MeshSizes(4), 3, fsdp_unit_modules=[TransformerBlock], batch_size=batch,
                           seq_len=config.seq_len)
    flops = sum(s.flops for s in report.compute if s.phase in ("forward", "backward"))
    assert flops == training_flops_per_token(config, config.seq_len) * batch * config.seq_len
    # Forward: each block's segment reads the all-gather issued just before it (the blocks' buckets,
    # in order); backward: each block's reads a backward gather, the newest first.
    blocks = [s for s in report.compute if s.phase == "forward"][:config.layers]
    block_bytes = math.ceil(sum(p.numel() for p in TransformerBlock(config).parameters()) / (4 * 64)) * 4 * 64 * 2
    for segment in blocks:
        gather = report.collectives[segment.needs]
        assert (gather.phase, gather.op, gather.message_bytes) == ("forward", "all_gather", block_bytes)
        assert segment.needs == segment.after - 1
    backward = [report.collectives[s.needs] for s in report.compute if s.phase == "backward"][1:]
    assert [(c.phase, c.op) for c in backward] == [("backward", "all_gather")] * config.layers


def test_predictions_at_worlds_2_and_4_are_within_15_percent_of_the_measured_steps() -> None:
    """A 1.3B GPT at 4 x 2,048 tokens a GPU on H200s: the rate fitted from the world-1 row, then
    the world-2 row and the world-4 HSDP row predicted from it (docs/scaling.md has every row)."""
    calibration, rows = validation.GROUPS[1]
    chosen = [row for row in rows if row.implementation == validation._OURS][:1] + [
        row for row in rows if row.implementation.endswith("hsdp")]
    table = validation.validation_table([(calibration, chosen)])
    assert table[0]["predicted_s"] == pytest.approx(table[0]["measured_s"], rel=1e-9)  # the fit reproduces its row
    assert [(r["world"], r["role"]) for r in table] == [(1, "calibration"), (2, "prediction"), (4, "prediction")]
    for row in table[1:]:
        assert abs(row["error"]) <= validation.TARGET_ERROR, row


def test_torch_fsdp2s_world_2_row_is_predicted_within_15_percent_from_its_own_world_1_row() -> None:
    """Torch FSDP2's row as benchmarks/step_time.py runs it (fully_shard per block, then the
    root; fp32 parameters gathered in bf16, gradients reduced in fp32; torch's default
    resharding: the blocks after forward, the root not), a 1.3B GPT at 4 x 2,048 tokens a GPU on
    H200s: FSDP2's rate fitted from its own world-1 row, its world-2 row predicted
    (docs/scaling.md has its 4-GPU and HSDP rows too). 7 s of CPU time for the two ranks."""
    calibration, rows = next(group for group in validation.FSDP2_GROUPS if "mbs4_seq2048" in group[0].file)
    world_2 = next(row for row in rows if validation.measured(row).world == 2)
    table = validation.validation_table([(calibration, [world_2])])
    assert table[0]["predicted_s"] == pytest.approx(table[0]["measured_s"], rel=1e-9)  # the fit reproduces its row
    assert [(r["world"], r["implementation"]) for r in table] == [(1, "torch FSDP2"), (2, "torch FSDP2")]
    assert abs(table[1]["error"]) <= validation.TARGET_ERROR, table[1]
    # The schedule timed is FSDP2's, in the benchmark's precision: a bf16 gather of each of the
    # 24 blocks and the root in forward, again of each block (not the root) in backward, and an
    # fp32 reduce-scatter of each.
    schedule = validation.simulated(world_2, validation.measured(world_2))
    issued = Counter((c.phase, c.op, c.dtype) for c in schedule.collectives if c.phase in ("forward", "backward"))
    assert issued == {("forward", "all_gather", torch.bfloat16): 25, ("backward", "all_gather", torch.bfloat16): 24,
                      ("backward", "reduce_scatter", torch.float32): 25}


def test_hsdps_replica_all_reduces_are_issued_inside_backward_behind_each_reduce_scatter() -> None:
    """HSDP (4 replicas x 2 shards), 3 GPT blocks: each bucket's all-reduce over the replicas is
    issued as soon as its reduce-scatter is finished, with at most ``max_reductions_in_flight`` (2)
    later reduce-scatters issued before it, so all but the last few run under backward; the bytes
    are each reduce-scatter's output, as before the change (the step's one average per bucket)."""
    config = GPTConfig(vocab_size=512, seq_len=64, layers=3, hidden=64, heads=4, ffn=176)

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return gpt(**vars(config)).to(torch.bfloat16)

    report = simulate_rank(build, MeshSizes(8, dp_outer=4), 0, fsdp_unit_modules=[TransformerBlock], batch_size=1,
                           seq_len=config.seq_len)
    step = [c for c in report.collectives if c.phase in ("forward", "backward")]
    order = [(i, c) for i, c in enumerate(step) if c.op in ("reduce_scatter", "all_reduce")]
    scatters = [(i, c) for i, c in order if c.op == "reduce_scatter"]
    averages = [(i, c) for i, c in order if c.op == "all_reduce"]
    assert len(scatters) == len(averages) == len(report.buckets) > 3
    assert all(c.group_size == 2 for _, c in scatters) and all(c.group_size == 4 for _, c in averages)
    for k, (position, average) in enumerate(averages):
        scattered_at, scatter = scatters[k]
        assert average.message_bytes == scatter.message_bytes // 2, k  # this rank's shard of bucket k
        later_scatters = sum(1 for i, _ in scatters if scattered_at < i < position)
        assert later_scatters == min(2, len(scatters) - 1 - k), (k, later_scatters)
