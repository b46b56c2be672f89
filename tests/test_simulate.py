"""The simulator (issue 60): one rank of a world of 8 to 4,096 runs the real wrap and one real
training step under torch's fake process group and FakeTensorMode. Checked for Llama-3 8B's and a
Mixtral 8x7B-like MoE's shapes (two of their 32 decoder layers: every layer is the same unit, so
two show the layers' buckets and their prefetch; the root unit is whole) under plain sharding,
HSDP with 8-rank shard groups, TP 8 x DP and (the MoE) EP 8, and for Llama-3 70B's and 405B's (a 405B layer's
bucket holds 3.2B elements, past 2^31):

- plan_memory's model states for the simulated rank equal the bytes of every storage the rank
  still holds after the step, to the byte;
- the buckets are laid out as the rule says (each parameter at an offset aligned to 128 bytes,
  the bucket padded to a multiple of group size x 128 bytes), their padding named;
- the step's collectives, counted and sized, and the bytes the rank sends equal each strategy's
  formula (ZeRO-3: every bucket gathered in forward and every layer's again in backward, the
  root unit staying gathered; gradients reduce-scattered; HSDP adds an all-reduce of each
  reduced shard over the replicas; TP 8 adds Megatron's activation all-reduces).

The simulated rank is the last one, whose shard holds each bucket's padded tail. Torch's own
FSDP2 beside ours: tests/test_simulate_torch_fsdp2.py.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest
import torch
from torch import nn

from megatron_fsdp.plan_memory import plan_memory
from megatron_fsdp.simulate import MeshSizes, simulate_rank
from megatron_fsdp.simulate.command import main
from megatron_fsdp.simulate.doors import planned_as
from megatron_fsdp.simulate.models import LLAMA_TP_PLAN, hugging_face
from megatron_fsdp.simulate.traffic import sent_bytes

pytest.importorskip("transformers")

LAYERS = 2
BATCH, SEQ = 1, 256
ALIGNMENT_BYTES = 128
_SOURCES = {}


def _source(name: str):
    if name not in _SOURCES:
        _SOURCES[name] = hugging_face(name, torch.bfloat16, num_hidden_layers=LAYERS)
    return _SOURCES[name]


def _padded(numels: list[int], group: int, itemsize: int) -> int:
    """The bucket rule: each parameter starts at a multiple of 128 bytes, and the bucket is a
    multiple of group x 128 bytes (so every shard is whole and aligned)."""
    align = ALIGNMENT_BYTES // itemsize
    cursor = 0
    for numel in numels:
        cursor = math.ceil((cursor + numel) / align) * align
    return math.ceil(max(cursor, 1) / (group * align)) * group * align


def _expected_buckets(model: nn.Module, units: tuple[type, ...], mesh: MeshSizes) -> list[tuple[str, int, int, int]]:
    """(unit, numel, padded numel, group size) of each bucket: the parameters outside every unit
    one bucket per module that holds them (the root unit), then per unit its dense parameters and,
    under expert parallelism, its experts (1/ep of them, sharded over the world / ep ranks holding
    the same ones); tensor-parallel parameters by their local (1/tp) size."""
    tp_split = {f"{name}.weight" for name, _ in _tp_modules(model)} if mesh.tp > 1 else set()
    local = {name: p.numel() // (mesh.tp if name in tp_split else 1) for name, p in model.named_parameters()}
    experts = {name for name in local if ".experts." in name} if mesh.ep > 1 else set()
    unit_names = [name for name, m in model.named_modules() if isinstance(m, units)]
    in_unit = {n for n in local if any(n.startswith(u + ".") for u in unit_names)}
    root: dict[str, list[int]] = {}
    for name in local:
        if name not in in_unit:
            root.setdefault(name.rpartition(".")[0], []).append(local[name])
    groups = [("<root>", numels, mesh.shard_group) for numels in root.values()]
    for unit in unit_names:
        members = [n for n in local if n.startswith(unit + ".")]
        groups.append((unit, [local[n] for n in members if n not in experts], mesh.shard_group))
        if experts:
            groups.append((unit, [local[n] // mesh.ep for n in members if n in experts], mesh.world_size // mesh.ep))
    return [(unit, sum(numels), _padded(numels, g, 2), g) for unit, numels, g in groups]


def _tp_modules(model: nn.Module):
    patterns = [pattern.split(".") for pattern in LLAMA_TP_PLAN]
    for name, module in model.named_modules():
        parts = name.split(".")
        if any(len(p) == len(parts) and all(a in ("*", b) for a, b in zip(p, parts)) for p in patterns):
            yield name, module


def _expected_collectives(buckets, strategy: str, mesh: MeshSizes, hidden: int, layers: int) -> Counter:
    """(op, group size, dtype, message bytes) -> count for one step of bf16 weights, gradients
    and communication (the default policy: fp32 main weights, bf16 main gradients)."""
    expected = Counter()
    for unit, _, padded, g in buckets:
        nbytes = padded * 2
        if strategy == "optim_grads_params":
            expected["all_gather", g, "bfloat16", nbytes] += 1 if unit == "<root>" else 2
            expected["reduce_scatter", g, "bfloat16", nbytes] += 1
        elif strategy == "no_shard":
            expected["all_reduce", g, "bfloat16", nbytes] += 1
        else:  # optim, optim_grads: gradients reduce-scattered, the stepped weights gathered once
            expected["reduce_scatter", g, "bfloat16", nbytes] += 1
            expected["all_gather", g, "bfloat16", nbytes] += 1
        if mesh.dp_outer > 1:
            expected["all_reduce", mesh.dp_outer, "bfloat16", nbytes // g] += 1
    if mesh.tp > 1:  # row-parallel outputs in forward (o, down), column-parallel inputs' gradients (q, k, v, gate, up)
        expected["all_reduce", mesh.tp, "bfloat16", BATCH * SEQ // mesh.cp * hidden * 2] += 7 * layers
    return Counter({key: count for key, count in expected.items() if key[1] > 1})


CASES = [
    *[("llama3-8b", MeshSizes(w), "optim_grads_params") for w in (8, 64, 512, 4096)],
    *[("llama3-8b", MeshSizes(w, dp_outer=w // 8), "optim_grads_params") for w in (64, 512, 4096)],
    *[("llama3-8b", MeshSizes(w, tp=8), "optim_grads_params") for w in (64, 512, 4096)],
    *[("llama3-8b", MeshSizes(64), s) for s in ("no_shard", "optim", "optim_grads")],
    *[("mixtral-8x7b", MeshSizes(w), "optim_grads_params") for w in (8, 64, 512, 4096)],
    *[("mixtral-8x7b", MeshSizes(w, dp_outer=w // 8), "optim_grads_params") for w in (64, 4096)],
    *[("mixtral-8x7b", MeshSizes(w, ep=8), "optim_grads_params") for w in (64, 4096)],
    # A 405B layer is 3.2B elements (past 2^31) in one bucket at TP 1: sizes and offsets beyond int32.
    ("llama3-70b", MeshSizes(512, tp=8), "optim_grads_params"),
    ("llama3-405b", MeshSizes(4096), "optim_grads_params"),
    ("llama3-405b", MeshSizes(4096, dp_outer=512), "optim_grads_params"),
    # Context parallelism: cp ranks join the shard group (dp_shard x cp) and run 1/cp of each sequence
    # (with TP and PP: the pipeline cases below).
    ("llama3-8b", MeshSizes(512, dp_outer=8, cp=2), "optim_grads_params"),
]


def _case_id(case) -> str:
    name, mesh, strategy = case
    cp = f"-cp{mesh.cp}" if mesh.cp > 1 else ""
    return f"{name}-W{mesh.world_size}-outer{mesh.dp_outer}{cp}-tp{mesh.tp}-ep{mesh.ep}-{strategy}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_a_simulated_rank_holds_what_the_plan_says_and_sends_what_the_formula_says(case) -> None:
    name, mesh, strategy = case
    source = _source(name)
    rank = mesh.world_size - 1
    tp_plan = LLAMA_TP_PLAN if mesh.tp > 1 else None
    report = simulate_rank(source.build, mesh, rank, fsdp_unit_modules=list(source.units), zero_dp_strategy=strategy,
                           tensor_parallel_plan=tp_plan, batch_size=BATCH, seq_len=SEQ)
    model = source.build()
    plan = plan_memory(model, mesh.world_size, dp_outer_size=mesh.dp_outer, tensor_parallel_size=mesh.tp,
                       context_parallel_size=mesh.cp, expert_parallel_size=mesh.ep, tensor_parallel_plan=tp_plan,
                       fsdp_unit_modules=list(source.units), zero_dp_strategy=strategy, device_type="cpu").for_rank(rank)
    planned = plan.device_model_states + plan.host_model_states
    assert report.model_state_bytes == planned, (
        f"simulated {report.model_states} ({report.model_state_bytes} bytes), planned {plan.device} {plan.host} ({planned})")
    # Category by category too: nothing here is offloaded, so the plan's host part is empty.
    assert {kind: n for kind, n in report.model_states.items() if n} == {kind: n for kind, n in plan.device.items() if n}
    # The plan's working set bounds what the bucket pool lent at once (gathered weights, gradient buffers).
    assert report.pool_peak <= plan.working_set, f"pool peak {report.pool_peak} > planned working set {plan.working_set}"

    expected_buckets = _expected_buckets(model, source.units, mesh)
    simulated_buckets = [(row.unit, row.numel, row.padded_numel, row.group_size) for row in report.buckets]
    assert simulated_buckets == expected_buckets
    assert [row.padding for row in report.buckets] == [padded - numel for _, numel, padded, _ in expected_buckets]

    expected = _expected_collectives(expected_buckets, strategy, mesh, model.config.hidden_size, LAYERS)
    assert report.step_collectives() == expected
    expected_sent = sum(sent_bytes(op, nbytes, size) * count for (op, size, _, nbytes), count in expected.items())
    assert report.sent_per_step() == expected_sent


def _expected_fsdp2_collectives(buckets, mesh: MeshSizes) -> Counter:
    """FSDP2's door as torchtitan calls it: bf16 weights gathered (each layer's again in backward;
    the root, whose forward runs first, keeps its weights), gradients reduce-scattered in float32,
    HSDP's all-reduce of each float32 shard over the replicas."""
    expected = Counter()
    for unit, _, padded, g in buckets:
        expected["all_gather", g, "bfloat16", padded * 2] += 1 if unit == "<root>" else 2
        expected["reduce_scatter", g, "float32", padded * 4] += 1
        if mesh.dp_outer > 1:
            expected["all_reduce", mesh.dp_outer, "float32", padded * 4 // g] += 1
    return expected


@pytest.mark.parametrize("mesh", [MeshSizes(64), MeshSizes(4096, dp_outer=512)], ids=["W64", "W4096-outer512"])
def test_the_fsdp2_door_at_scale_gathers_and_reduces_as_torchtitan_runs_it(mesh: MeshSizes) -> None:
    source = _source("llama3-8b")
    report = simulate_rank(source.build, mesh, mesh.world_size - 1, fsdp_unit_modules=list(source.units),
                           batch_size=BATCH, seq_len=SEQ, door="fsdp2")
    model = source.build()
    # Its root is one bucket of everything outside the layers (one per dtype), after the layers'.
    layers = _expected_buckets(model, source.units, mesh)
    root = [(n, p) for n, p in model.named_parameters() if ".layers." not in n]
    buckets = [b for b in layers if b[0] != "<root>"]
    buckets.append(("<root>", sum(p.numel() for _, p in root), _padded([p.numel() for _, p in root], mesh.dp_shard, 2),
                    mesh.dp_shard))
    assert [(row.numel, row.padded_numel) for row in report.buckets] == [(numel, padded) for _, numel, padded, _ in buckets]
    expected = _expected_fsdp2_collectives(buckets, mesh)
    assert report.step_collectives() == expected
    assert report.sent_per_step() == sum(sent_bytes(op, n, size) * count for (op, size, _, n), count in expected.items())
    # Model states: float32 weights (the optimizer's), float32 gradients and AdamW's two moments,
    # each this rank's shard of every bucket, its padding included.
    shard = sum(padded for _, _, padded, _ in buckets) // mesh.dp_shard
    assert report.model_states["main weights"] == shard * 4


def _expected_stage_buckets(model: nn.Module, mesh: MeshSizes, stage: int,
                            stage_layers: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """(unit, numel, padded numel) of each bucket of pipeline stage ``stage``, the stages holding
    ``stage_layers`` consecutive layers each, as the FSDP2 door makes them: one a layer
    (TP-local sizes), then one for the stage module's own parameters (the embedding on the
    first stage, the final norm and head on the last), each padded over the shard group
    (dp_shard x cp)."""
    stages, first = len(stage_layers), sum(stage_layers[:stage])
    group = mesh.shard_group
    by_layer = _expected_buckets(model, (type(model.model.layers[0]),), mesh)
    buckets = [(u, n, p) for u, n, p, _ in by_layer if u != "<root>"][first:first + stage_layers[stage]]
    own = [p.numel() for n, p in model.named_parameters()
           if (stage == 0 and "embed_tokens" in n) or (stage == stages - 1 and (".norm." in n or "lm_head" in n))]
    if own:
        buckets.append(("<stage>", sum(own), _padded(own, group, 2)))
    return buckets


def _expected_pipeline_collectives(buckets, mesh: MeshSizes, micro_batches: int, gathers: int, stage: int,
                                   stages: int, hidden: int, tokens: int) -> Counter:
    """One step of a pipeline stage through the FSDP2 door, per bucket of ``P`` padded elements:
    ``gathers`` bf16 all-gathers of ``2 P`` bytes (reshard_after_forward False: 1, the stage
    stays gathered from its first forward to the step's reduction; True under GPipe: one a
    forward and one for the backwards, after which the stage stays gathered), one float32
    reduce-scatter of ``4 P`` bytes (the step's one reduction) and under HSDP one float32
    all-reduce of the shard over the replicas. Each micro-batch of ``tokens`` tokens: Megatron's
    7 TP all-reduces a layer, and its activation (bf16, ``tokens x hidden``) sent to the next
    stage and its gradient received back (the first stage), received and sent back (the
    last), or both (a middle stage)."""
    expected = Counter()
    group = mesh.shard_group
    for _, _, padded in buckets:
        expected["all_gather", group, "bfloat16", padded * 2] += gathers
        expected["reduce_scatter", group, "float32", padded * 4] += 1
        if mesh.dp_outer > 1:
            expected["all_reduce", mesh.dp_outer, "float32", padded * 4 // group] += 1
    activation = tokens * hidden * 2
    layers = sum(unit != "<stage>" for unit, _, _ in buckets)
    if mesh.tp > 1:
        expected["all_reduce", mesh.tp, "bfloat16", activation] += 7 * layers * micro_batches
    peers = (stage > 0) + (stage < stages - 1)  # previous and next stage
    expected["send", mesh.pp, "bfloat16", activation] += peers * micro_batches
    expected["recv", mesh.pp, "bfloat16", activation] += peers * micro_batches
    return expected


# (model, mesh, layers, layer split and what it deals each stage, schedule, micro-batches,
# reshard_after_forward, ranks). torchtitan's 405B recipe, FSDP 8 x TP 8 x PP 8 at 512, one layer a
# stage (all 126, 15 or 16 a stage, take minutes: docs/scaling.md has those rows), its first and
# last pipeline ranks; and every dim at once on 8B's shapes under GPipe with weights given back
# after each forward, 6 layers dealt out as torchtitan deals them (the embedding and the head
# counting as a layer each), a rank of the second stage.
PIPELINE_CASES = [
    ("llama3-405b", MeshSizes(512, tp=8, pp=8), 8, "even", (1,) * 8, "1F1B", 8, False, (0, 511)),
    ("llama3-8b", MeshSizes(64, dp_outer=2, cp=2, tp=2, pp=4), 6, "torchtitan", (1, 2, 2, 1), "GPipe", 2, True, (31,)),
]


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=[f"{c[0]}-W{c[1].world_size}-pp{c[1].pp}-{c[5]}" for c in PIPELINE_CASES])
def test_a_pipeline_rank_holds_its_stage_as_planned_and_sends_what_the_formula_says(case) -> None:
    name, mesh, layers, split, stage_layers, schedule, micro_batches, reshard, ranks = case
    source = hugging_face(name, torch.bfloat16, num_hidden_layers=layers)
    model = source.build()
    options = dict(tensor_parallel_plan=LLAMA_TP_PLAN if mesh.tp > 1 else None, fsdp_unit_modules=list(source.units))
    in_float32, policy = planned_as("fsdp2", None)
    plan = plan_memory(source.build().float() if in_float32 else source.build(), mesh.world_size,
                       dp_outer_size=mesh.dp_outer, tensor_parallel_size=mesh.tp, context_parallel_size=mesh.cp,
                       pipeline_parallel_size=mesh.pp, pipeline_schedule=schedule, micro_batches=micro_batches,
                       pipeline_layer_split=split, reshard_after_forward=reshard, mixed_precision_policy=policy,
                       device_type="cpu", **options)
    for rank in ranks:
        report = simulate_rank(source.build, mesh, rank, batch_size=micro_batches, seq_len=SEQ, door="fsdp2",
                               pipeline_schedule=schedule, micro_batches=micro_batches, pipeline_layer_split=split,
                               reshard_after_forward=reshard, **options)
        planned = plan.for_rank(rank)
        stage = mesh.pp_rank(rank)
        assert planned.stages == (stage,)
        assert report.model_state_bytes == planned.device_model_states, (report.model_states, planned.device)
        # The FSDP2 door's float32 parameters are the plan's compute weights (its main weights alias them).
        for kind in ("main grads", "optimizer state", "module buffers"):
            assert report.model_states.get(kind, 0) == planned.device[kind], kind
        buckets = _expected_stage_buckets(model, mesh, stage, stage_layers)
        assert [(row.numel, row.padded_numel, row.group_size) for row in report.buckets] == [
            (numel, padded, mesh.shard_group) for _, numel, padded in buckets]
        gathers = 1 if not reshard else micro_batches + 1
        expected = _expected_pipeline_collectives(buckets, mesh, micro_batches, gathers, stage, mesh.pp,
                                                  model.config.hidden_size, SEQ // mesh.cp)
        assert report.step_collectives() == expected
        assert report.sent_per_step() == sum(sent_bytes(op, n, size) * count for (op, size, _, n), count in expected.items())


def test_the_command_prints_each_sampled_rank_beside_its_plan(capsys) -> None:
    main(["--model", "examples/gpt_model.py:gpt", "--model-kwargs", '{"layers": 2, "vocab_size": 1001}',
          "--units", "TransformerBlock", "--world-size", "512", "--ranks", "first,largest,last", "--seq-len", "32",
          "--json", "--step-time"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ranks = [row["rank"] for row in rows]
    assert ranks[0] == 0 and ranks[-1] == 511 and len(ranks) in (2, 3)  # the largest may be one of them
    for row in rows:
        assert row["model_state_bytes"] == row["planned_model_state_bytes"] > 0
        assert row["sent_per_step"] == sum(sent_bytes(c["op"], c["message_bytes"], c["group_size"]) * c["count"]
                                           for c in row["collectives"])
        # Every collective spans the 512 ranks (64 nodes): NCCL's ring latency alone is 8.4 us + 448
        # NVLink steps of 3.4 us + 63 network steps of 9.6 us = 2.1364 ms each; one link runs them
        # one after another, so the step lasts at least their sum.
        timed = row["step_time"]
        collectives = sum(c["count"] for c in row["collectives"])
        assert timed["communication_s"] >= collectives * 2.1364e-3
        assert timed["seconds"] >= max(timed["communication_s"], timed["compute_s"] + timed["optimizer_s"])
        assert timed["tokens_per_s_per_gpu"] == pytest.approx(32 / timed["seconds"])


LLAMA_8B_ONE_LAYER = ["--hf", "llama3-8b", "--layers", "1"]


def test_the_allocation_log_sizes_an_op_on_dtensors_by_its_local_output() -> None:
    """Tensor parallelism's column-parallel linear is an mm on DTensors, which the dispatch mode
    sees whole: its memory is the local output (64 x 4 here, kept after ``to_local``, as a layer
    keeps it for backward), not the global-shape wrapper (64 x 32) that dies with ``to_local``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from megatron_fsdp.simulate.compute import ComputeLog
    from megatron_fsdp.simulate.memory import AllocationLog
    from megatron_fsdp.simulate.observer import StepObserver
    from megatron_fsdp.simulate.traffic import CollectiveLog
    from megatron_fsdp.simulate.world import build_mesh, fake_world

    with fake_world(0, 8):
        tp = build_mesh(MeshSizes(8, tp=8))["tp"]
        log = AllocationLog()
        with FakeTensorMode(allow_non_fake_inputs=True), StepObserver(log, CollectiveLog(), ComputeLog()).observing():
            inputs = DTensor.from_local(torch.empty(64, 32), tp, [Replicate()])
            weight = DTensor.from_local(torch.empty(4, 32), tp, [Shard(0)])  # 32 rows, 4 a rank
            local = torch.mm(inputs, weight.t()).to_local()
            (made,) = [a for a in log.allocations if a.label == "mm.default"]
            assert (made.nbytes, made.died) == (64 * 4 * 4, None)  # fp32, live while the local output is
            del local
            assert made.died is not None
            # A meta stand-in (DTensor specs are built from one) holds no memory: not logged.
            real = torch.empty(64, 32)
            before = len(log.allocations)
            stand_in = real.to("meta")
            assert stand_in.device.type == "meta" and len(log.allocations) == before


@pytest.mark.parametrize("arguments, message", [
    ([*LLAMA_8B_ONE_LAYER, "--world-size", "6", "--tp", "3"], "tensor_parallel_size 3 does not divide dim 0 (4096)"),
    ([*LLAMA_8B_ONE_LAYER, "--world-size", "12", "--tp", "8"], "12 is not divisible by 8"),
    ([*LLAMA_8B_ONE_LAYER, "--world-size", "8", "--ranks", "8"], "--ranks: 8 is outside a world of 8"),
    ([*LLAMA_8B_ONE_LAYER, "--world-size", "16", "--pp", "2"], "pass door='fsdp2' (--door fsdp2)"),
    # torchtitan's 405B recipe, FSDP 8 x TP 8 x PP 8 at 512, on the model's 126 layers as they are.
    (["--hf", "llama3-405b", "--world-size", "512", "--tp", "8", "--pp", "8", "--door", "fsdp2"],
     "8 x 1 = 8 stages do not divide the model's 126 layers evenly: pick sizes whose product divides 126"),
    ([*LLAMA_8B_ONE_LAYER, "--world-size", "8", "--compare", "fsdp2", "--strategy", "optim"], "--compare fsdp2 compares FSDP2's ZeRO-3"),
    ([*LLAMA_8B_ONE_LAYER, "--world-size", "16", "--pp", "2", "--door", "fsdp2", "--step-time"],
     "--step-time times data- and tensor-parallel steps only"),
])
def test_the_command_refuses_a_layout_that_cannot_run_naming_the_fix(arguments: list, message: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        main(arguments)


@pytest.mark.parametrize("double_buffer", [False, True])
def test_the_fake_bucket_pool_keeps_the_books_the_cpp_pool_keeps(double_buffer: bool) -> None:
    """The same fetches and releases on the C++ pool (real CPU tensors) and its fake counterpart
    (fake tensors): the same bytes in use after each call, the same high-water mark and, double
    buffered, the same persistent blocks and reserved bytes. (Without the double buffer the CPU
    pool caches released blocks where CUDA's, which the fake one follows, hands them back.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_fsdp import _ops
    from megatron_fsdp._fake_bucket_pool import FakeBucketPool

    calls = [("fetch", "weights/unit", 1000, torch.bfloat16), ("fetch", "weights/unit", 3000, torch.bfloat16),
             ("release", 0), ("fetch", "grads/unit", 700, torch.float32), ("fetch", "weights/unit", 5000, torch.bfloat16),
             ("release", 1), ("release", 3), ("fetch", "weights/unit", 10, torch.bfloat16), ("release", 2)]

    def run(pool) -> list:
        held, books = [], []
        for call in calls:
            if call[0] == "fetch":
                held.append(pool.fetch(call[2], call[3], torch.device("cpu"), call[1]))
            else:
                pool.release(held[call[1]])
            books.append(pool.bytes_in_use())
        books.append(pool.high_water_mark())
        if double_buffer:
            books += [dict(pool.blocks_per_key()), pool.bytes_reserved()]
        return books

    real = run(_ops.new_bucket_pool(double_buffer))
    with FakeTensorMode():
        pool = _ops.new_bucket_pool(double_buffer)
        assert isinstance(pool, FakeBucketPool)
        assert run(pool) == real
