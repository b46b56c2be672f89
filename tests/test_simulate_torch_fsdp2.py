"""Torch's own FSDP2 simulated beside ours (simulate/torch_fsdp2.py, docs/scaling.md "Torch's
FSDP2 beside ours"): FSDPMemTracker's model states equal the DTensors' own shards and FSDP2's
padding rule (each parameter's sharded dim padded to the group: dim 0, or a grouped expert
weight's dim 1 as torchtitan places it); the collectives, counted and sized, are FSDP2's ZeRO-3
(and under a pipeline, one gather and one reduction a group a step); ours' and FSDP2's gathered
and reduced bytes differ by exactly their padding; what it does not simulate is refused; the
command's and the side-by-side benchmark's rows are the two simulations' own numbers.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections import Counter

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard

from megatron_fsdp.simulate import MeshSizes
from megatron_fsdp.simulate.command import main
from megatron_fsdp.simulate.models import LLAMA_TP_PLAN, hugging_face
from megatron_fsdp.simulate.traffic import sent_bytes
from test_simulate import BATCH, SEQ, _expected_buckets, _expected_pipeline_collectives


def test_the_command_compares_with_torch_fsdp2_side_by_side(capsys) -> None:
    """``--compare fsdp2``: each rank's rows are the two simulations' own numbers."""
    main(["--model", "examples/gpt_model.py:gpt", "--model-kwargs", '{"layers": 1, "vocab_size": 1001}',
          "--units", "TransformerBlock", "--world-size", "8", "--ranks", "last", "--seq-len", "32",
          "--compare", "fsdp2", "--json"])
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows = {r["what"]: (r["ours"], r["torch_fsdp2"]) for r in row["rows"]}
    ours, theirs = row["ours"], row["torch_fsdp2"]
    assert rows["sent per step"] == (ours["sent_per_step"], theirs["sent_per_step"])
    assert rows["model states"] == (ours["model_state_bytes"], theirs["model_state_bytes"])
    assert theirs["model_states"] == theirs["shard_bytes"]  # FSDPMemTracker against the DTensors' shards
    assert theirs["door"] == "torch_fsdp2" and theirs["sent_per_step"] > 0


def test_the_side_by_side_benchmark_lays_out_its_meshes_and_splits_the_bytes_by_op() -> None:
    """benchmarks/fsdp2_side_by_side.py's rows (docs/scaling.md): ZeRO-3, HSDP replicas of 8-rank
    shard groups and TP 8 x DP meshes from its options, and each op's bytes sent by the ring rule."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from fsdp2_side_by_side import layout_name, mesh_for, sent_by_op

    assert (mesh_for(4096), layout_name(mesh_for(4096))) == (MeshSizes(4096), "ZeRO-3")
    hsdp = mesh_for(512, shard_group=8)
    assert (hsdp.dp_outer, hsdp.dp_shard, hsdp.tp, layout_name(hsdp)) == (64, 8, 1, "HSDP 64 x 8")
    tp = mesh_for(512, tp=8)
    assert (tp.dp_outer, tp.dp_shard, tp.tp, layout_name(tp)) == (1, 64, 8, "TP 8 x DP 64")
    both = mesh_for(4096, shard_group=8, tp=8)
    assert (both.dp_outer, both.dp_shard, layout_name(both)) == (64, 8, "HSDP 64 x 8, TP 8")
    with pytest.raises(ValueError, match="at least two replicas"):
        mesh_for(8, shard_group=8)  # one replica: that is ZeRO-3, not HSDP
    with pytest.raises(ValueError, match="must be a multiple of 64"):
        mesh_for(96, shard_group=8, tp=8)
    # Two all-gathers of 800 bytes over 8 ranks send 700 each; an all-reduce of 400 over 4, 600.
    counts = Counter({("all_gather", 8, "bfloat16", 800): 2, ("all_reduce", 4, "float32", 400): 1})
    assert sent_by_op(counts) == {"all_gather": 1400, "all_reduce": 600}


@pytest.mark.parametrize("mesh, options, message", [
    (MeshSizes(64, ep=8), {}, "without expert parallelism"),
    (MeshSizes(64, cp=2), {}, "without context parallelism"),
    (MeshSizes(64, pp=2), dict(pipeline_schedule="Interleaved1F1B", virtual_stages=2), "FSDPMemTracker tracks one root"),
])
def test_torch_fsdp2_refuses_the_meshes_it_does_not_simulate(mesh: MeshSizes, options: dict, message: str) -> None:
    """Refused before anything is built, not silently wrong: a rank holding several stage roots
    would be tracked for one of them only; under context parallelism it would run whole
    sequences where ours runs 1/cp of each."""
    from megatron_fsdp.simulate.torch_fsdp2 import simulate_torch_fsdp2

    llama = hugging_face("llama3-8b", torch.bfloat16, 2)
    with pytest.raises(ValueError, match=message):
        simulate_torch_fsdp2(llama.build, mesh, 0, fsdp_unit_modules=list(llama.units), **options)


def _fsdp2_groups(model: nn.Module, units: tuple[type, ...]) -> list[tuple[str, list[torch.Size]]]:
    """FSDP2's parameter groups as fully_shard makes them: each unit's parameters, then the root's
    (everything outside the units), as (unit, shapes)."""
    unit_names = [name for name, m in model.named_modules() if isinstance(m, units)]
    groups = [(unit, [p.shape for n, p in model.named_parameters() if n.startswith(unit + ".")]) for unit in unit_names]
    root = [p.shape for n, p in model.named_parameters() if not any(n.startswith(u + ".") for u in unit_names)]
    return [*groups, ("<root>", root)]


def _fsdp2_padded(shape: torch.Size, group: int, dim: int = 0) -> tuple[int, int]:
    """FSDP2's padding rule: the sharded dim up to a multiple of the shard group. (rows per shard,
    elements a row), a row being one index of that dim."""
    return math.ceil(shape[dim] / group), math.prod(shape) // shape[dim]


def _fsdp2_model_states(model: nn.Module, group: int, index: int, shard_dims: dict[str, int] | None = None,
                        shapes: dict[str, torch.Size] | None = None) -> dict:
    """FSDPMemTracker's model states of shard ``index`` of ``group`` under FSDP2's padding rule:
    ceil(d / group) rows of each float32 parameter's sharded dim ``d`` (``shard_dims``, else 0)
    and of its gradient (one reduce-scatter output a group); AdamW's moments are zeros_like the
    unpadded local rows, plus a 4-byte step count a parameter; the buffers whole. ``shapes``: the
    parameters the rank holds and their shapes before FSDP (a pipeline stage's, tensor-parallel
    parts); default every parameter of ``model``, whole."""
    shapes = shapes if shapes is not None else {name: p.shape for name, p in model.named_parameters()}
    params = [(shape, (shard_dims or {}).get(name, 0)) for name, shape in shapes.items()]
    shards = [_fsdp2_padded(shape, group, dim) for shape, dim in params]
    local_rows = [min(max(shape[dim] - index * rows, 0), rows) for (shape, dim), (rows, _) in zip(params, shards)]
    return {
        "Sharded Param": sum(rows * per_row * 4 for rows, per_row in shards),
        "Sharded Grad": sum(rows * per_row * 4 for rows, per_row in shards),
        "OptState": sum(2 * n * per_row * 4 + 4 for n, (_, per_row) in zip(local_rows, shards)),
        "Buffer": sum(b.numel() * b.element_size() for b in model.buffers()),
    }


@pytest.mark.parametrize("mesh", [MeshSizes(48), MeshSizes(4096, dp_outer=512)], ids=["W48", "W4096-outer512"])
def test_torch_fsdp2_beside_ours_holds_its_shards_and_sends_the_zero3_formula(mesh: MeshSizes) -> None:
    """Torch's own FSDP2 (fully_shard per layer, then the root) and ours on the last rank of the
    same world: one layer of Llama-3 8B's shapes, bf16 compute, fp32 weights, bf16 gradient
    communication, AdamW. At W48 FSDP2 pads (1,024-row k/v over 48 ranks: 22 rows a shard, none
    on the last rank's), at 4,096 = 512 x 8 it does not."""
    from megatron_fsdp.simulate.comparison import compare_with_torch_fsdp2, message_bytes

    source = hugging_face("llama3-8b", torch.bfloat16, num_hidden_layers=1)
    rank, g = mesh.world_size - 1, mesh.dp_shard
    comparison = compare_with_torch_fsdp2(source.build, mesh, rank, fsdp_unit_modules=list(source.units),
                                          batch_size=BATCH, seq_len=64)
    theirs = comparison.torch_fsdp2
    model = source.build().float()
    groups = _fsdp2_groups(model, source.units)

    # Memory: FSDPMemTracker's model states equal the sum of the DTensors' local storages, and
    # both equal the padding rule (the last rank of each shard group).
    expected_memory = _fsdp2_model_states(model, g, g - 1)
    assert theirs.shard_bytes == expected_memory
    assert theirs.model_states == expected_memory, f"tracker {theirs.model_states}, shards {theirs.shard_bytes}"
    # The peak is where FSDP2 holds the root's gathered bf16 weights (forward into backward), not
    # in the optimizer step: a tracker counting DTensor's global-shape shape inference (the whole
    # parameters) as optimizer state would put it there, 6.5 GB at two layers.
    root_gathered = sum(rows * g * per_row * 2 for rows, per_row in (_fsdp2_padded(s, g) for s in groups[-1][1]))
    assert theirs.peak_breakdown.get("Unsharded Param", 0) >= root_gathered, theirs.peak_breakdown

    # Traffic: ZeRO-3 under FSDP2's padding rule, as issued (the same record type as ours).
    padded = {unit: sum(rows * g * per_row for rows, per_row in (_fsdp2_padded(s, g) for s in shapes))
              for unit, shapes in groups}
    expected = Counter()
    for unit, numel in padded.items():
        expected["all_gather", g, "bfloat16", numel * 2] += 1 if unit == "<root>" else 2
        expected["reduce_scatter", g, "bfloat16", numel * 2] += 1
        if mesh.dp_outer > 1:
            expected["all_reduce", mesh.dp_outer, "bfloat16", numel * 2 // g] += 1
    expected = Counter({key: count for key, count in expected.items() if key[1] > 1})
    assert theirs.step_collectives() == expected
    assert theirs.sent_per_step() == sum(sent_bytes(op, n, size) * count for (op, size, _, n), count in expected.items())
    assert [row.padded_numel for row in theirs.groups] == list(padded.values())

    # Ours against FSDP2: the same elements gathered and reduced, as often, in the same dtype;
    # they differ by the padding alone: ours pads each parameter to 128 bytes and each bucket to
    # g x 128 bytes, FSDP2 each parameter's dim 0 to a multiple of g.
    ours_buckets = _expected_buckets(model, source.units, mesh)

    def padding_bytes(gathers_of_layer: int) -> int:
        """Ours' padding less FSDP2's, in bf16 bytes, each unit's counted as often as it travels."""
        times = {unit: 1 if unit == "<root>" else gathers_of_layer for unit, _ in groups}
        ours = sum((padded_numel - numel) * times[unit] for unit, numel, padded_numel, _ in ours_buckets)
        fsdp2 = sum((padded[unit] - sum(math.prod(s) for s in shapes)) * times[unit] for unit, shapes in groups)
        return (ours - fsdp2) * 2

    ours_counts, their_counts = comparison.ours.step_collectives(), theirs.step_collectives()
    assert message_bytes(ours_counts, "all_gather") - message_bytes(their_counts, "all_gather") == padding_bytes(2)
    assert message_bytes(ours_counts, "reduce_scatter") - message_bytes(their_counts, "reduce_scatter") == padding_bytes(1)


@pytest.mark.parametrize("world, expert_dim", [(8, 0), (16, 1)])
def test_torch_fsdp2_shards_an_moe_s_grouped_experts_as_torchtitan_does(world: int, expert_dim: int) -> None:
    """One layer of Mixtral 8x7B's shapes (grouped experts, ``experts.gate_up_proj`` 8 x 28,672 x
    4,096) under torch's FSDP2 at expert-parallel degree 1, as torchtitan shards it: up to 8 FSDP
    ranks, plain ``Shard(0)``, one expert a rank; past 8, the grouped weights ``Shard(1)`` (Shard(0)
    would give every rank past the eighth a whole expert of padding: 0.70 GB of fp32 weights on
    the last rank at W16, where Shard(1) holds 0.35 GB of real rows). FSDPMemTracker's model states equal the padding
    rule on each parameter's sharded dim; where dim 1 is not a multiple of the ranks (W48) it is
    refused, naming the fix."""
    from megatron_fsdp.simulate.torch_fsdp2 import shard_module, simulate_torch_fsdp2, torch_policy
    from megatron_fsdp.simulate.world import build_mesh, fake_world

    source = hugging_face("mixtral-8x7b", torch.bfloat16, num_hidden_layers=1)
    mesh, rank = MeshSizes(world), world - 1
    with fake_world(rank, world):
        model = source.build().float()
        shard_module(model, source.units, build_mesh(mesh), mesh, torch_policy(None, torch.bfloat16)[1])
        placements = {name: param.placements for name, param in model.named_parameters()}
    experts = {name for name in placements if ".experts." in name}
    assert experts == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert {name: tuple(p) for name, p in placements.items()} == {
        name: (Shard(expert_dim if name in experts else 0),) for name in placements}

    # Memory and the layer's group, as the Llama test above checks them, each parameter padded
    # on its sharded dim.
    theirs = simulate_torch_fsdp2(source.build, mesh, rank, fsdp_unit_modules=list(source.units), batch_size=BATCH,
                                  seq_len=64)
    model = source.build().float()
    shard_dims = dict.fromkeys(experts, expert_dim)
    expected_memory = _fsdp2_model_states(model, world, rank, shard_dims)
    assert theirs.shard_bytes == expected_memory
    assert theirs.model_states == expected_memory, f"tracker {theirs.model_states}, shards {theirs.shard_bytes}"
    layer = [_fsdp2_padded(p.shape, world, shard_dims.get(name, 0)) for name, p in model.named_parameters()
             if name.startswith("model.layers.0.")]
    assert theirs.groups[0].padded_numel == sum(rows * world * per_row for rows, per_row in layer)

    if expert_dim:
        with pytest.raises(ValueError, match="its grouped expert weights are sharded on dim 1.*divides the experts' dim 1"):
            simulate_torch_fsdp2(source.build, MeshSizes(48), 47, fsdp_unit_modules=list(source.units))


def _tp_local_shape(name: str, shape: torch.Size, tp: int) -> torch.Size:
    """A parameter's shape on one tensor-parallel rank under LLAMA_TP_PLAN: colwise linears keep
    1/tp of their rows, rowwise ones 1/tp of their columns, the rest whole."""
    module = name.removesuffix(".weight")
    for pattern, style in LLAMA_TP_PLAN.items():
        if re.fullmatch(pattern.replace(".", r"\.").replace("*", r"\d+"), module):
            return torch.Size((shape[0] // tp, shape[1]) if style == "colwise" else (shape[0], shape[1] // tp))
    return shape


def test_torch_fsdp2_under_a_pipeline_holds_its_stage_shards_and_gathers_once_a_step() -> None:
    """Torch's FSDP2 under torchtitan's PP (fully_shard on each layer, then the stage module,
    reshard_after_forward False) beside ours' FSDP2 door, on the last rank of 8 = PP 2 x FSDP 2 x
    TP 2: Llama-3 8B's shapes with 4 layers (2 a stage), Schedule1F1B over 2 micro-batches of 64
    tokens, both in torchtitan's precision (float32 parameters, bf16 compute, float32 reductions)."""
    from megatron_fsdp.simulate.comparison import compare_with_torch_fsdp2, message_bytes

    mesh, rank, micro_batches = MeshSizes(8, tp=2, pp=2), 7, 2
    source = hugging_face("llama3-8b", torch.bfloat16, num_hidden_layers=4)
    comparison = compare_with_torch_fsdp2(source.build, mesh, rank, fsdp_unit_modules=list(source.units),
                                          tensor_parallel_plan=LLAMA_TP_PLAN, seq_len=SEQ // 4, door="fsdp2")
    theirs, g = comparison.torch_fsdp2, mesh.dp_shard
    model = source.build().float()
    shapes = {name: _tp_local_shape(name, p.shape, mesh.tp) for name, p in model.named_parameters()}
    # The last stage: layers 2 and 3, then the stage module's own (the final norm and the head).
    groups = [(f"model.layers.{i}", [(n, s) for n, s in shapes.items() if n.startswith(f"model.layers.{i}.")])
              for i in (2, 3)]
    groups.append(("<stage>", [(n, shapes[n]) for n in ("model.norm.weight", "lm_head.weight")]))

    # Memory: the tracker's model states equal the DTensors' local storages, and both the
    # padding rule over the stage's parameters alone (the first stage's embedding is not held).
    held = {name: shape for _, group in groups for name, shape in group}
    expected_memory = _fsdp2_model_states(model, g, g - 1, shapes=held)
    assert theirs.shard_bytes == expected_memory
    assert theirs.model_states == expected_memory, f"tracker {theirs.model_states}, shards {theirs.shard_bytes}"
    # The peak is the step's one reduction (PipelineStage.perform_reduce_grad), at the stage
    # module's group (the head), reduced first: its weights resharded, the layers' still gathered
    # (bf16), and every layer's and the head's gradients accumulated unreduced over the
    # micro-batches in float32 (FSDP2's reduce dtype), beside the reduce-scatter's buffers.
    layer_numel = sum(math.prod(s) for unit, group in groups if unit != "<stage>" for _, s in group)
    assert theirs.peak_breakdown.get("Unsharded Param") == layer_numel * 2, theirs.peak_breakdown
    assert theirs.peak_breakdown.get("Temp", 0) >= (layer_numel + math.prod(shapes["lm_head.weight"])) * 4

    # Traffic: each group gathered once (bf16) and reduce-scattered once (float32) a step; each
    # micro-batch's activation received from stage 0 and its gradient sent back; TP's 7
    # all-reduces a layer a micro-batch.
    buckets = [(unit, sum(math.prod(s) for _, s in group), sum(rows * g * per_row for rows, per_row in
                                                               (_fsdp2_padded(s, g) for _, s in group)))
               for unit, group in groups]
    expected = _expected_pipeline_collectives(buckets, mesh, micro_batches, 1, 1, mesh.pp,
                                              model.config.hidden_size, SEQ // 4)
    assert theirs.step_collectives() == expected
    assert theirs.sent_per_step() == sum(sent_bytes(op, n, size) * count for (op, size, _, n), count in expected.items())
    assert [row.padded_numel for row in theirs.groups] == [padded for _, _, padded in buckets]

    # Ours' FSDP2 door on the same stage, unpadded here (every bucket a multiple of g x 64
    # elements): the same model states and the same bytes on the wire.
    ours = comparison.ours
    assert sum(row.padding for row in ours.buckets) == 0
    assert ours.model_state_bytes == theirs.model_state_bytes
    for op in ("all_gather", "reduce_scatter"):
        assert message_bytes(ours.step_collectives(), op) == message_bytes(theirs.step_collectives(), op), op
    assert ours.sent_per_step() == theirs.sent_per_step()
