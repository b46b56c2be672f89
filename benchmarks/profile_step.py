"""Where a training step's time goes, per implementation: GPU kernel time by kind, the time the
GPU sits idle (host overhead or waits), the kernels launched, and the host time spent in CUDA
runtime calls. Same model, data and implementations as step_time.py.

    torchrun --standalone --nproc_per_node 1 benchmarks/profile_step.py --config 1.3B --micro-batch 4 --seq-len 2048

All rows run in this one process, so a megatron_fsdp row is profiled only where its package is
the one imported: NVIDIA's megatron-fsdp with the directory it was installed into first on
PYTHONPATH (``PYTHONPATH=/tmp/nv-site:$PYTHONPATH torchrun ... --impls NVIDIA``), ours without.

The GPU is busy when any kernel, copy or memset runs on any stream; idle time is the rest of the
step's wall time. Communication that overlaps compute adds kernel time but no wall time, so
"exposed" communication shows as wall time beyond compute, not in the communication column.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch._dynamo
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import IMPLEMENTATIONS, add_model_arguments, batch, compile_counts, imports_here, model_config, train_step, wanted_implementations  # noqa: E402  (puts examples/ on the path)
from gpt_model import GPTConfig  # noqa: E402

# First match wins; names as CUDA kernels of torch 2.11 / cuBLAS / NCCL are spelled.
KINDS = [
    ("communication", re.compile(r"nccl", re.I)),
    ("compiled (triton)", re.compile(r"^triton_")),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|sm\d+_xmma|matmul", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("megatron_fsdp ops", re.compile(r"megatron_fsdp|flatten|promoting_reduce|non_finite", re.I)),
    ("copies and casts", re.compile(r"copy|cast|convert|cat_|CatArray|memcpy|memset|fill", re.I)),
    ("other elementwise", re.compile(r"elementwise|reduce_kernel|unrolled", re.I)),
]


def _kind(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other kernels")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def _host_phases(model, optimizer, autocast: bool, config: GPTConfig, tokens: torch.Tensor, steps: int) -> dict:
    """Median host ms, unprofiled, of each phase of a step until it returns (the GPU may still
    run behind it), and of the closing wait for the GPU."""
    times: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": [], "wait for GPU": []}
    for _ in range(steps):
        torch.cuda.synchronize()
        marks = [time.perf_counter()]
        train_step(model, optimizer, autocast, config, tokens, after_phase=lambda: marks.append(time.perf_counter()))
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        for phase, start, stop in zip(times, marks, marks[1:]):
            times[phase].append((stop - start) * 1e3)
    return {phase: statistics.median(values) for phase, values in times.items()}


def _host_syncs_in_one_step(model, optimizer, autocast: bool, config: GPTConfig, tokens: torch.Tensor) -> list[str]:
    """Where one step makes the host wait for the GPU, as torch's sync debug mode reports it."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(model, optimizer, autocast, config, tokens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]


def _profile(name: str, config: GPTConfig, args, device: torch.device) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    model, optimizer, autocast = IMPLEMENTATIONS[name](config, device)
    rank = dist.get_rank()
    for step in range(args.warmup):
        train_step(model, optimizer, autocast, config, batch(config, args, step, rank, device))
    host_ms = _host_phases(model, optimizer, autocast, config, batch(config, args, args.warmup, rank, device), 15)
    syncs = _host_syncs_in_one_step(model, optimizer, autocast, config, batch(config, args, args.warmup, rank, device))
    graphs = compile_counts()["compiled_graphs"]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for step in range(args.warmup, args.warmup + args.steps):
            train_step(model, optimizer, autocast, config, batch(config, args, step, rank, device))
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - started) * 1e6
    compiled = compile_counts()
    compiled["graphs_made_while_profiled"] = compiled["compiled_graphs"] - graphs
    torch._dynamo.utils.counters.clear()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            events = [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]
    per_kind: dict[str, float] = {}
    intervals = []
    kernels = 0
    per_kernel: dict[str, float] = {}
    calls: dict[str, list[float]] = {}  # runtime call: [count, host microseconds]
    for event in events:
        category = event.get("cat", "")
        if category in ("kernel", "gpu_memcpy", "gpu_memset"):
            kind = _kind(event["name"]) if category == "kernel" else "copies and casts"
            per_kind[kind] = per_kind.get(kind, 0.0) + event["dur"]
            intervals.append((event["ts"], event["ts"] + event["dur"]))
            kernels += category == "kernel"
            per_kernel[event["name"]] = per_kernel.get(event["name"], 0.0) + event["dur"]
        elif category == "cuda_runtime":
            count_and_time = calls.setdefault(event["name"], [0, 0.0])
            count_and_time[0] += 1
            count_and_time[1] += event["dur"]
    del model, optimizer
    steps = args.steps
    busy = _union_us(intervals)
    return {
        "implementation": name,
        "step_ms": wall_us / steps / 1e3,
        "gpu_busy_ms": busy / steps / 1e3,
        "gpu_idle_ms": (wall_us - busy) / steps / 1e3,
        "kernel_ms": {kind: value / steps / 1e3 for kind, value in sorted(per_kind.items())},
        "kernels_per_step": kernels / steps,
        # The ten costliest kernels (and copies), ms per step.
        "costliest_kernels_ms": {
            name[:120]: total / steps / 1e3 for name, total in sorted(per_kernel.items(), key=lambda item: -item[1])[:10]
        },
        "host_ms": host_ms,
        "host_syncs_per_step": syncs,
        "torch_compile": compiled,
        # Per runtime call: (calls, host ms) per step, the most expensive first.
        "runtime_calls_per_step": {
            call: (count / steps, total / steps / 1e3)
            for call, (count, total) in sorted(calls.items(), key=lambda item: -item[1][1])
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--layers", type=int, default=None, help="--config's width at this depth (default: its own)")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--impls", default="optim_grads_params fp32-comm,FSDP2", help="comma-separated names (exact, else substrings)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    config = model_config(args)
    if args.layers is not None:
        config = dataclasses.replace(config, layers=args.layers)
    matching = wanted_implementations(args.impls)
    wanted = [n for n in matching if imports_here(n)]
    if dist.get_rank() == 0 and len(wanted) < len(matching):
        print(f"not profiled, as this process imports the other megatron_fsdp: {sorted(set(matching) - set(wanted))}")
    rows = [_profile(name, config, args, device) for name in wanted]
    if dist.get_rank() == 0:
        kinds = sorted({kind for row in rows for kind in row["kernel_ms"]})
        print(f"{torch.cuda.get_device_name()} x{dist.get_world_size()}, torch {torch.__version__}; {args.config} width, {config.layers} layers, "
              f"micro-batch {args.micro_batch}, seq {args.seq_len}; ms per step, mean of {args.steps} profiled steps")
        print("| implementation | step | GPU busy | GPU idle | " + " | ".join(kinds)
              + " | kernels per step | costliest runtime calls per step (calls, host ms) |")
        print("| --- " * (5 + len(kinds)) + "| --- |")
        for row in rows:
            cells = " | ".join(f"{row['kernel_ms'].get(kind, 0.0):.1f}" for kind in kinds)
            top = list(row["runtime_calls_per_step"].items())[:4]
            calls = ", ".join(f"{call} ({count:g}, {ms:.1f})" for call, (count, ms) in top) or "none"
            print(f"| {row['implementation']} | {row['step_ms']:.1f} | {row['gpu_busy_ms']:.1f} | {row['gpu_idle_ms']:.1f} | "
                  f"{cells} | {row['kernels_per_step']:.0f} | {calls} |")
        print("\nHost waits for the GPU in one step (sync debug mode), torch.compile's graphs and graph breaks")
        for row in rows:
            print(f"- {row['implementation']}: {len(row['host_syncs_per_step'])} syncs {row['host_syncs_per_step'][:3]}; "
                  f"{row['torch_compile']}")
        print("\nCostliest kernels, ms per step")
        for row in rows:
            print(f"- {row['implementation']}: " + "; ".join(f"{name} {ms:.1f}" for name, ms in row["costliest_kernels_ms"].items()))
        print("\nHost ms per phase, median of 15 unprofiled steps (until the call returns; then the wait for the GPU)")
        phases = list(rows[0]["host_ms"]) if rows else []
        print("| implementation | " + " | ".join(phases) + " |")
        print("| --- " * (1 + len(phases)) + "|")
        for row in rows:
            print(f"| {row['implementation']} | " + " | ".join(f"{row['host_ms'][phase]:.1f}" for phase in phases) + " |")
        if args.out:
            with open(args.out, "w") as file:
                json.dump(rows, file, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
