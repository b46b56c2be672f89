"""Bandwidth of the C++ ops against the device's own copy bandwidth (CUDA, or the host's).

    python benchmarks/op_bandwidth.py --numel 67108864 --out results.json
    python benchmarks/op_bandwidth.py --device cpu   # the host: all torch.get_num_threads() threads

Every figure counts bytes read plus bytes written, the way copy bandwidth is usually quoted;
each is the median of --iters timed runs after warm-up, timed with CUDA events (a wall clock on
the CPU, where every op returns when done).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from megatron_fsdp import _ops


def _median_ms(fn: Callable[[], None], iters: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cpu":
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _split(numel: int, pieces: int) -> list[int]:
    """Uneven sizes, like a transformer block's parameters, summing to numel."""
    weights = [1 + (7 * i) % 13 for i in range(pieces)]
    sizes = [numel * w // sum(weights) for w in weights]
    sizes[-1] += numel - sum(sizes)
    return sizes


def _optimizer_rows(numel: int, iters: int, device: torch.device, record: Callable[[str, int, float], None]) -> None:
    """adam_step_ and sgd_step_ over one flat buffer, and torch.optim.Adam on a buffer of the same
    size. Bytes: the gradient read, the parameter and each state read and written; with bf16
    weights, also those written (weights_out) or the parameter read again and cast (copy_)."""
    param = torch.randn(numel, device=device)
    exp_avg, exp_avg_sq, momentum_buffer = (torch.zeros_like(param) for _ in range(3))
    grad32 = torch.randn(numel, device=device)
    grad_bf16 = grad32.bfloat16()
    steps = itertools.count(1)
    for name, grad in (("fp32", grad32), ("bf16", grad_bf16)):
        record(f"adam_step_ {name} grad", (24 + grad.element_size()) * numel,
               _median_ms(lambda: _ops.adam_step_(param, grad, exp_avg, exp_avg_sq, step=next(steps), lr=1e-6), iters, device))
    weights = torch.empty(numel, device=device, dtype=torch.bfloat16)
    record("adam_step_ bf16 grad, then param cast into bf16 weights", 32 * numel,
           _median_ms(lambda: (_ops.adam_step_(param, grad_bf16, exp_avg, exp_avg_sq, step=next(steps), lr=1e-6), weights.copy_(param)), iters, device))
    record("adam_step_ bf16 grad, bf16 weights_out", 28 * numel,
           _median_ms(lambda: _ops.adam_step_(param, grad_bf16, exp_avg, exp_avg_sq, step=next(steps), lr=1e-6, weights_out=weights), iters, device))
    record("sgd_step_ momentum bf16 grad", 18 * numel,
           _median_ms(lambda: _ops.sgd_step_(param, grad_bf16, momentum_buffer, lr=1e-6, momentum=0.9), iters, device))
    reference = param.clone().requires_grad_(True)
    reference.grad = grad32
    adam = torch.optim.Adam([reference], lr=1e-6)
    path = "foreach" if device.type == "cuda" else "single-tensor"
    record(f"torch.optim.Adam fp32 grad ({path}; reference)", 28 * numel, _median_ms(adam.step, iters, device))


def run(numel: int, world: int, pieces: int, iters: int, device: torch.device) -> list[dict]:
    rows = []

    def record(name: str, nbytes: int, ms: float) -> None:
        rows.append({"op": name, "bytes": nbytes, "median_ms": ms, "GB_per_s": nbytes / ms / 1e6})

    def median_ms(fn: Callable[[], None], iters: int) -> float:
        return _median_ms(fn, iters, device)

    src32 = torch.randn(numel, device=device)
    dst32 = torch.empty_like(src32)
    record("torch copy_ fp32->fp32 (reference)", 8 * numel, median_ms(lambda: dst32.copy_(src32), iters))

    sizes = _split(numel, pieces)
    offsets = [sum(sizes[:i]) for i in range(pieces)]
    params_bf16 = [torch.randn(n, device=device, dtype=torch.bfloat16) for n in sizes]
    flat32 = torch.empty(numel, device=device)
    record(f"flatten_copy {pieces} bf16 tensors -> fp32 flat", 6 * numel,
           median_ms(lambda: _ops.flatten_copy(params_bf16, offsets, flat32), iters))
    record(f"unflatten_copy fp32 flat -> {pieces} bf16 tensors", 6 * numel,
           median_ms(lambda: _ops.unflatten_copy(flat32, offsets, params_bf16), iters))
    params32 = [torch.randn(n, device=device) for n in sizes]
    record(f"flatten_copy {pieces} fp32 tensors -> fp32 flat", 8 * numel,
           median_ms(lambda: _ops.flatten_copy(params32, offsets, flat32), iters))
    record(f"torch.cat {pieces} fp32 tensors (reference)", 8 * numel,
           median_ms(lambda: torch.cat(params32, out=flat32), iters))

    shard = numel // world
    chunks = torch.randn(world, shard, device=device, dtype=torch.bfloat16)
    out32 = torch.zeros(shard, device=device)
    record(f"promoting_reduce bf16 [{world}, n] += fp32", world * shard * 2 + 2 * shard * 4,
           median_ms(lambda: _ops.promoting_reduce(chunks, out32, 1.0 / world, True), iters))
    record(f"torch chunks.float().sum(0) (reference) [{world}, n]", world * shard * 2 + shard * 4,
           median_ms(lambda: torch.sum(chunks, 0, dtype=torch.float32, out=out32), iters))

    record(f"find_non_finite {pieces} fp32 tensors", 4 * numel,
           median_ms(lambda: _ops.find_non_finite(params32), iters))
    record(f"multi_tensor_norm p=2 {pieces} fp32 tensors", 4 * numel,
           median_ms(lambda: _ops.multi_tensor_norm(params32, 2.0), iters))
    record(f"torch._foreach_norm {pieces} fp32 tensors (reference)", 4 * numel,
           median_ms(lambda: torch._foreach_norm(params32, 2.0), iters))
    _optimizer_rows(numel, iters, device, record)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 26)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--pieces", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write the rows and the setting as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = run(args.numel, args.world, args.pieces, args.iters, device)
    copy_bw = rows[0]["GB_per_s"]
    host = f"{platform.machine()} CPU, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"
    setting = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else host,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "numel": args.numel,
        "world": args.world,
        "pieces": args.pieces,
        "iters": args.iters,
    }
    print(f"{setting['device']}, torch {setting['torch']}, {setting['date']}, numel {args.numel}")
    print("| op | median ms | GB/s (read+write) | vs copy_ |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['op']} | {row['median_ms']:.3f} | {row['GB_per_s']:.0f} | {row['GB_per_s'] / copy_bw:.2f} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"setting": setting, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
