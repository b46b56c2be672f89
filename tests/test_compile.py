"""torch.compile around sharded models, on 2 gloo ranks, against eager training of the same
sharded model: each block compiled before fully_shard, after it, and the whole wrapper
compiled, with and without non-reentrant activation checkpointing.

The hooks run eagerly between graphs (a graph break at each unit boundary), so the compiled
graphs compute exactly what eager forward and backward compute: with the aot_eager backend
(AOT autograd and functionalisation, the layers that reject an aliasing custom op, without
code generation, which is slow on a 2-core CI machine) losses and parameters must agree to
1e-6 relative, a bound any sharding mistake would break by orders of magnitude. One run uses
inductor, torch.compile's default backend. Recompiles after the first step fail the test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import megatron_fsdp
from _dist import run_distributed
from models import VOCAB, Block, TinyGPT, make_batch, make_model
from parity import max_relative_error

STEPS = 4
MICRO_ROWS = 2
RTOL = 1e-6


def _checkpointed_forward(model: TinyGPT, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """TinyGPT's forward with every block under non-reentrant activation checkpointing."""
    x = model.embed(tokens) + model.pos[: tokens.shape[1]]
    for block in model.blocks:
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    logits = model.head(model.norm(x))
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _train(
    rank: int, world: int, strategy: int, compile_mode: str, checkpointing: bool, backend: str, dtype: torch.dtype
) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = make_model(seed=0, dtype=dtype)
    if checkpointing:
        model.forward = _checkpointed_forward.__get__(model)
    if compile_mode == "blocks-before":
        for block in model.blocks:
            block.compile(backend=backend)
    sharded, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block], zero_dp_strategy=strategy
    )
    if compile_mode == "blocks-after":
        for block in sharded.module.blocks:
            block.compile(backend=backend)
    runner = torch.compile(sharded, backend=backend) if compile_mode == "whole" else sharded
    losses, graphs = [], []
    for step in range(STEPS):
        tokens, targets = make_batch(step, world * MICRO_ROWS)
        rows = slice(rank * MICRO_ROWS, (rank + 1) * MICRO_ROWS)
        loss = runner(tokens[rows], targets[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return {"losses": losses, "graphs": graphs, "params": sharded.full_parameters()}


FP32, BF16 = torch.float32, torch.bfloat16
# (strategy, how it is compiled, activation checkpointing, backend, dtype). A bf16 model with
# fp32 main weights compiled with aot_eager runs eager's kernels on eager's inputs: also exact.
RUNS = [
    (3, "blocks-before", False, "aot_eager", FP32),
    (3, "blocks-after", True, "aot_eager", FP32),
    (3, "whole", False, "aot_eager", FP32),
    (3, "whole", True, "aot_eager", FP32),
    (0, "blocks-after", False, "aot_eager", FP32),
    (1, "blocks-before", True, "aot_eager", FP32),
    (2, "whole", False, "aot_eager", FP32),
    (3, "blocks-after", True, "aot_eager", BF16),
    (3, "blocks-after", False, "inductor", FP32),
]


def _all_runs(rank: int, world: int) -> list[tuple[dict, dict]]:
    """Each compiled run with the eager run of its strategy and dtype."""
    eager = {key: _train(rank, world, key[0], "eager", False, "", key[1]) for key in dict.fromkeys((r[0], r[4]) for r in RUNS)}
    return [(_train(rank, world, *run), eager[(run[0], run[4])]) for run in RUNS]


def test_compiled_blocks_and_whole_model_train_like_eager_without_recompiles() -> None:
    results = run_distributed(_all_runs, 2, timeout=900)[0]
    for run, (compiled, eager) in zip(RUNS, results):
        label = f"strategy {run[0]}, {run[1]}, checkpointing {run[2]}, {run[3]}, {run[4]}"
        # Dynamo cannot break a graph inside activation checkpointing's region, so a whole-model
        # compile runs the frames holding checkpointed units eagerly (docs/api.md, torch.compile).
        if run[1:3] != ("whole", True):
            assert compiled["graphs"][0] > 0, f"{label}: nothing was compiled"
        # Graphs compiled by the end of each step: nothing new once the second step has run.
        assert compiled["graphs"][-1] == compiled["graphs"][1], f"{label}: recompiled: {compiled['graphs']}"
        for step, (a, b) in enumerate(zip(compiled["losses"], eager["losses"])):
            assert abs(a - b) <= RTOL * abs(b), f"{label}: loss at step {step}: {a} vs eager {b}"
        for name, value in eager["params"].items():
            err = max_relative_error(compiled["params"][name], value)
            assert err <= RTOL, f"{label}: parameter {name}: relative error {err:.2e}"


def _train_in_place(compile_blocks: bool) -> tuple[list[float], dict]:
    """TinyGPT sharded in place per block and at the root (megatron_fsdp.fsdp2, torchtitan's
    recipe), each block compiled afterwards or not; losses of a few steps and dynamo's counters."""
    import torch._dynamo

    from megatron_fsdp.fsdp2 import fully_shard

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = make_model(seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if compile_blocks:
        for block in model.blocks:
            block.compile(backend="aot_eager")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, graphs = [], []
    for step in range(STEPS):
        tokens, targets = make_batch(step, MICRO_ROWS)
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    counters = {kind: dict(torch._dynamo.utils.counters[kind]) for kind in ("graph_break", "resumes", "frames")}
    return losses, {**counters, "graphs": graphs}


def test_in_place_units_compile_each_block_as_one_frame_without_graph_breaks(single_rank_group) -> None:
    """The in-place front door's forward hooks run eagerly around a compiled block: dynamo
    compiles the block's forward alone (one frame, one graph for all blocks, no recompiles),
    not the hooks' frames up to a graph break and a resume frame each, whose guards would run on
    every call."""
    eager, _ = _train_in_place(compile_blocks=False)
    compiled, counters = _train_in_place(compile_blocks=True)
    assert not counters["graph_break"], f"graph breaks: {list(counters['graph_break'])}"
    assert not counters["resumes"], f"resume frames: {counters['resumes']}"
    assert counters["frames"].get("total") == 1, f"compiled frames: {counters['frames']}"
    assert counters["graphs"] == [1] * STEPS, f"graphs after each step: {counters['graphs']}"
    for step, (a, b) in enumerate(zip(compiled, eager)):
        assert abs(a - b) <= RTOL * abs(b), f"loss at step {step}: compiled {a} vs eager {b}"
