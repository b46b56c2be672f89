"""Speed and memory in Megatron-LM's own log: its ``pretrain_gpt.py`` run unchanged with the bundled
megatron-fsdp, with megatron_fsdp (``-m megatron_fsdp.integrations.launch``), with
``--use-torch-fsdp2`` and with ``--use-distributed-optimizer`` alone, one torchrun after another on
every GPU of the machine, for a 2-layer model and a 1.3B-class model.

    MEGATRON_LM_DIR=/path/to/Megatron-LM python benchmarks/megatron_lm_pretrain.py --out results.json

Reports, per row, the median ``elapsed time per iteration (ms)`` over the iterations after the
warm-up and the ``max allocated`` (MB) Megatron-LM reports after its first logged iteration.
``--repeat N`` runs the whole table N times, rows interleaved, so a slow spell of a shared host
lands on every row rather than on one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WARM_UP = 3

SIZES = {
    "2-layer": ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
                "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "2"],
    "1.3B": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
             "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1"],
}
COMMON = [
    "--swiglu", "--position-embedding-type", "rope", "--no-rope-fusion", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--bf16",
    "--lr", "3e-4", "--lr-decay-style", "constant", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "32000", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
]
ROWS = {
    "bundled megatron-fsdp": ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
    "megatron_fsdp (ours)": ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
    "torch FSDP2": ["--use-torch-fsdp2", "--ckpt-format", "torch_dist"],
    "distributed optimizer (no FSDP)": ["--use-distributed-optimizer"],
}
ELAPSED = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")
MAX_ALLOCATED = re.compile(r"max allocated: ([0-9.]+)")


def run(row: str, size: str, iterations: int, global_batch: int, workdir: Path) -> dict:
    script = str(Path(os.environ["MEGATRON_LM_DIR"], "pretrain_gpt.py"))
    entry = ["-m", "megatron_fsdp.integrations.launch", script] if "ours" in row else [script]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torch.cuda.device_count()}",
        *entry, *SIZES[size], *COMMON, *ROWS[row], "--train-iters", str(iterations), "--global-batch-size", str(global_batch),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ["MEGATRON_LM_DIR"], os.environ.get("PYTHONPATH", "")]),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    result = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=900)
    log = result.stdout + result.stderr
    times = {int(i): float(ms) for i, ms in ELAPSED.findall(log)}
    steady = [ms for i, ms in times.items() if i > WARM_UP]
    memory = MAX_ALLOCATED.findall(log)
    if result.returncode != 0 or not steady:
        return {"row": row, "size": size, "error": log[-3000:]}
    return {"row": row, "size": size, "median_ms": statistics.median(steady), "min_ms": min(steady),
            "max_ms": max(steady), "max_allocated_mb": float(memory[0]) if memory else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    if not os.environ.get("MEGATRON_LM_DIR"):
        raise SystemExit("set MEGATRON_LM_DIR to a folder with Megatron-LM's pretrain_gpt.py, gpt_builders.py, model_provider.py")
    results = []
    for repeat in range(args.repeat):
        for size in args.sizes.split(","):
            for row in ROWS:
                with tempfile.TemporaryDirectory() as workdir:
                    results.append({**run(row, size, args.iterations, args.global_batch_size, Path(workdir)), "repeat": repeat})
                line = results[-1]
                print(f"{repeat} {size:8} {row:32} " + (f"{line['median_ms']:8.1f} ms  max allocated {line['max_allocated_mb']} MB"
                                                        if "median_ms" in line else "failed: " + line["error"][-600:]), flush=True)
                Path(args.out).write_text(json.dumps(results, indent=1))  # after every row: a cut-off run keeps its rows


if __name__ == "__main__":
    main()
