"""A whole training step (forward, backward, optimizer step) captured in one CUDA graph and
replayed, for megatron_fsdp and for the single-GPU floor of step_time.py, against the same
implementation run eagerly on the same data: whether capture works, whether the replayed
losses match eager ones, and the step time of each.

    torchrun --standalone --nproc_per_node 1 benchmarks/cuda_graph_step.py --config 1.3B --micro-batch 1 --seq-len 1024

``--compile-blocks`` compiles each block first (the warm-up steps compile; the graph captures
the compiled kernels); ``--float8`` puts our row in torchtitan's float8 recipe.

Capture follows torch's recipe for whole-network capture: a few eager steps on a side stream,
gradients set to None, then ``torch.cuda.graph`` around one step; each replay reads the next
batch from the captured input tensor. The optimizers are torch's fused AdamW with
``capturable=True`` (step count on the device, as a captured step must advance it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import FLOOR, _compiled, _floor_with, _megatron, add_model_arguments, batch, model_config, train_step  # noqa: E402  (puts examples/ on the path)
from gpt_model import GPTConfig  # noqa: E402


def _builders(args) -> dict:
    """Our optim_grads_params row (fp32 main gradients, so torch's AdamW steps them) and the
    floor, each with a capturable optimizer; with --float8 ours takes torchtitan's float8 recipe
    (the floor stays bf16), with --compile-blocks each block is compiled after sharding."""
    ours = _megatron(3, torch.float32, float8=args.float8, capturable=True)
    floor = _floor_with(capturable=True)
    if args.compile_blocks:
        ours, floor = _compiled(ours), _compiled(floor)
    return {"megatron_fsdp optim_grads_params fp32-comm": ours, FLOOR: floor}


def _eager(make, config: GPTConfig, args, device: torch.device) -> dict:
    model, optimizer, _ = make(config, device)
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        tokens = batch(config, args, step, 0, device)
        torch.cuda.synchronize()
        started = time.perf_counter()
        losses.append(train_step(model, optimizer, False, config, tokens))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return {"losses": [loss.item() for loss in losses], "median_step_ms": statistics.median(times[args.warmup:]) * 1e3}


def _captured(make, config: GPTConfig, args, device: torch.device) -> dict:
    model, optimizer, _ = make(config, device)
    tokens = batch(config, args, 0, 0, device)
    losses = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(args.warmup):
            tokens.copy_(batch(config, args, step, 0, device))
            losses.append(train_step(model, optimizer, False, config, tokens))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        captured_loss = train_step(model, optimizer, False, config, tokens)
    times = []
    for step in range(args.warmup, args.warmup + args.steps):
        tokens.copy_(batch(config, args, step, 0, device))
        torch.cuda.synchronize()
        started = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        losses.append(captured_loss.clone())
    return {"losses": [loss.item() for loss in losses], "median_step_ms": statistics.median(times) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile-blocks", action="store_true", help="compile each transformer block (warm-up compiles)")
    parser.add_argument("--float8", action="store_true", help="ours in torchtitan's float8 recipe (the floor stays bf16)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    config = model_config(args)
    rows = {}
    for name, make in _builders(args).items():
        for mode, run in (("eager", _eager), ("captured", _captured)):
            try:
                rows[f"{name} {mode}"] = run(make, config, args, device)
            except Exception as error:  # a capture that fails is a result: say where
                frames = traceback.extract_tb(error.__traceback__)
                where = next((f"{f.filename}:{f.lineno}" for f in reversed(frames) if "megatron_fsdp" in f.filename), "")
                rows[f"{name} {mode}"] = {"error": f"{type(error).__name__}: {str(error)[:400]}", "where": where}
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            print(f"{name} {mode}: {json.dumps(rows[f'{name} {mode}'])}", flush=True)
    if args.out and dist.get_rank() == 0:
        with open(args.out, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "rows": rows}, file, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
