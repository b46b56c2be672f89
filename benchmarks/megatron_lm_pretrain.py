"""Speed and memory in Megatron-LM's own log: its ``pretrain_gpt.py`` run unchanged with the bundled
megatron-fsdp, with megatron_fsdp (``-m megatron_fsdp.integrations.launch``), with
``--use-torch-fsdp2`` and with ``--use-distributed-optimizer`` alone, one torchrun after another on
every GPU of the machine, for a 2-layer model and a 1.3B-class model.

    MEGATRON_LM_DIR=/path/to/Megatron-LM python benchmarks/megatron_lm_pretrain.py --out results.json

Reports, per row, the median ``elapsed time per iteration (ms)`` over the iterations after the
warm-up and the ``max allocated`` (MB) Megatron-LM reports: it prints each data-parallel rank 0's
after the first iterations (after the first and second in megatron-core 0.19.2), and a row takes
each printing rank's last figure (its peak so far) and the largest of those (the ranks' figures
are kept too). ``--repeat N`` runs the whole table N times, rows interleaved, so a slow spell of a
shared host lands on every row rather than on one.

With ``--pipeline-model-parallel-size P`` (P > 1) the table is another: the bundled megatron-fsdp
cannot run pipeline parallelism, so ours (``optim_grads_params``) runs against megatron-core's DDP
with ``--use-distributed-optimizer``, both with ``--overlap-grad-reduce`` and the embedding tied to
the output layer, the rest of the world being data-parallel (PP2 x DP2 on 4 GPUs). Each pipeline
stage's data-parallel rank 0 reports its memory, so the ranks' figures are the stages'.
``--virtual-stage-layers L`` makes the schedule interleaved (``--num-layers-per-virtual-pipeline-stage``).
The global batch over the micro-batch size and the data-parallel size is the number of
micro-batches a step pipelines (global batch 16, micro-batch 1, DP2: 8):

    python benchmarks/megatron_lm_pretrain.py --sizes 1.3B --pipeline-model-parallel-size 2 \
        --global-batch-size 16 --iterations 8 --warm-up 3 --out pp2.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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
# Pipeline parallelism (--pipeline-model-parallel-size > 1), which the bundled copy cannot run: ours
# against megatron-core's own DDP with the distributed optimizer, as tests/gpu/test_megatron_lm_pretrain.py
# compares them, with the embedding tied to the output layer (COMMON's untying is dropped).
PIPELINE_ROWS = {
    "megatron_fsdp (ours) optim_grads_params": ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
                                                "--data-parallel-sharding-strategy", "optim_grads_params",
                                                "--overlap-grad-reduce"],
    "megatron-core DDP, distributed optimizer": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
}
ELAPSED = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")
# megatron.training's report_memory, printed by each data-parallel rank 0 (one a pipeline stage).
RANK_MEMORY = re.compile(r"\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\).*?max allocated: ([0-9.]+)")


def table(pipeline: int) -> dict[str, list[str]]:
    """The rows that run at this pipeline-parallel size."""
    return ROWS if pipeline == 1 else PIPELINE_ROWS


def wanted_rows(rows: str | None, pipeline: int) -> list[str]:
    """Rows by comma-separated names: an exact name picks itself, anything else every name
    containing it; None picks the whole table. Unknown names are an error."""
    names = list(table(pipeline))
    if rows is None:
        return names
    picked = set()
    for item in rows.split(","):
        matches = [item] if item in names else [name for name in names if item in name]
        if not matches:
            raise SystemExit(f"--rows: no row named or containing {item!r} among {names}")
        picked.update(matches)
    return [name for name in names if name in picked]


def command(row: str, size: str, args: argparse.Namespace) -> list[str]:
    """The torchrun of pretrain_gpt.py for one row."""
    script = str(Path(os.environ["MEGATRON_LM_DIR"], "pretrain_gpt.py"))
    entry = ["-m", "megatron_fsdp.integrations.launch", script] if "ours" in row else [script]
    common = COMMON
    if args.pipeline_model_parallel_size > 1:
        common = [flag for flag in COMMON if flag != "--untie-embeddings-and-output-weights"]
        common += ["--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size)]
        if args.virtual_stage_layers:
            common += ["--num-layers-per-virtual-pipeline-stage", str(args.virtual_stage_layers)]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}",
        *entry, *SIZES[size], *common, *table(args.pipeline_model_parallel_size)[row],
        "--train-iters", str(args.iterations), "--global-batch-size", str(args.global_batch_size),
    ]


def parse(log: str, warm_up: int) -> dict:
    """Median, min and max iteration time after the warm-up, and the reported peak memory."""
    times = {int(i): float(ms) for i, ms in ELAPSED.findall(log)}
    steady = [ms for i, ms in times.items() if i > warm_up]
    by_rank = {int(rank): float(mb) for rank, mb in RANK_MEMORY.findall(log)}  # each rank's last report
    if not steady:
        return {}
    return {"median_ms": statistics.median(steady), "min_ms": min(steady), "max_ms": max(steady), "iterations_timed": len(steady),
            "max_allocated_mb": max(by_rank.values()) if by_rank else None,
            "max_allocated_mb_by_rank": {str(rank): by_rank[rank] for rank in sorted(by_rank)}}


def _ensure_dataset_makefile() -> None:
    """megatron.training runs `make` in megatron/core/datasets at start-up; the wheel ships the
    built helpers but not the Makefile, so a Makefile with nothing to do stands in for it (as
    tests/gpu/test_megatron_lm_pretrain.py does), found without importing megatron.core."""
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    for location in (spec.submodule_search_locations or []) if spec else []:
        datasets = Path(location, "core", "datasets")
        if datasets.is_dir() and not (datasets / "Makefile").exists():
            (datasets / "Makefile").write_text("all:\n")


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's /proc), for a torchrun: its workers."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return children


def _stop(torchrun: subprocess.Popen) -> None:
    """Stops a run: SIGTERM to torchrun, which stops its workers (each in a session of its own,
    out of reach of a signal to torchrun's group); after 30 s, or once torchrun is gone,
    SIGKILL to torchrun's group and to each worker's, so none is left holding a GPU."""
    workers = _children(torchrun.pid)
    torchrun.terminate()
    try:
        torchrun.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    for group in [torchrun.pid, *workers]:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:  # already gone
            pass
    torchrun.wait()


def run(row: str, size: str, args: argparse.Namespace, workdir: Path, repeat: int = 0) -> dict:
    """One torchrun of pretrain_gpt.py in ``workdir``, its log written as it runs into --log-dir
    (else ``workdir``). It runs in a session of its own; past --timeout, or when this process is
    stopped (SIGTERM), it and its workers are stopped (_stop)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ["MEGATRON_LM_DIR"], os.environ.get("PYTHONPATH", "")]),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # Megatron-LM refuses FSDP with it at 1
    log_path = workdir / "pretrain_gpt.log"
    if args.log_dir:
        name = f"{size}_pp{args.pipeline_model_parallel_size}_vpp{args.virtual_stage_layers or 0}_{row}_{repeat}"
        log_path = Path(args.log_dir, re.sub(r"[^A-Za-z0-9.]+", "_", name) + ".log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log_file:
        process = subprocess.Popen(command(row, size, args), env=env, cwd=workdir, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            if process.poll() is None:
                _stop(process)
    log = log_path.read_text(errors="replace")
    numbers = parse(log, args.warm_up)
    if returncode != 0 or not numbers:
        ending = f"timed out after {args.timeout:g} s" if returncode is None else f"exit {returncode}"
        return {"row": row, "size": size, "error": f"{ending}: {log[-3000:]}", **numbers}
    return {"row": row, "size": size, **numbers}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--warm-up", type=int, default=WARM_UP, help=f"iterations left out of the timing (default {WARM_UP})")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                        help="above 1: ours against megatron-core's DDP with the distributed optimizer (PIPELINE_ROWS)")
    parser.add_argument("--virtual-stage-layers", type=int, default=None,
                        help="--num-layers-per-virtual-pipeline-stage (interleaved schedule); with --pipeline-model-parallel-size > 1")
    parser.add_argument("--rows", default=None, help="comma-separated row names (exact, else substrings); default: every row")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="GPUs a run uses (default: every GPU)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    parser.add_argument("--log-dir", default=None, help="write each run's pretrain_gpt.py log here (as it runs)")
    args = parser.parse_args()
    if args.virtual_stage_layers and args.pipeline_model_parallel_size == 1:
        parser.error("--virtual-stage-layers needs --pipeline-model-parallel-size > 1")
    rows = wanted_rows(args.rows, args.pipeline_model_parallel_size)
    if not os.environ.get("MEGATRON_LM_DIR"):
        raise SystemExit("set MEGATRON_LM_DIR to a folder with Megatron-LM's pretrain_gpt.py, gpt_builders.py, model_provider.py")
    if args.nproc_per_node is None:
        args.nproc_per_node = torch.cuda.device_count()
    # Stopped (e.g. by `timeout`), the finally in run() stops the running torchrun and its workers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    _ensure_dataset_makefile()
    results = []
    for repeat in range(args.repeat):
        for size in args.sizes.split(","):
            for row in rows:
                with tempfile.TemporaryDirectory() as workdir:
                    results.append({**run(row, size, args, Path(workdir), repeat), "repeat": repeat,
                                    "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
                                    "virtual_stage_layers": args.virtual_stage_layers, "nproc_per_node": args.nproc_per_node,
                                    "global_batch_size": args.global_batch_size, "iterations": args.iterations,
                                    "warm_up": args.warm_up})
                print(summary(results[-1]), flush=True)
                Path(args.out).write_text(json.dumps(results, indent=1))  # after every row: a cut-off run keeps its rows


def summary(line: dict) -> str:
    """One printed line for one row."""
    head = f"{line['repeat']} {line['size']:8} {line['row']:40} "
    if "error" in line:
        return head + "failed: " + line["error"][-600:]
    by_rank = line.get("max_allocated_mb_by_rank") or {}
    ranks = " (" + ", ".join(f"rank {rank} {mb:.0f}" for rank, mb in by_rank.items()) + ")" if len(by_rank) > 1 else ""
    return (head + f"{line['median_ms']:8.1f} ms (max {line['max_ms']:.1f} over {line['iterations_timed']})"
            f"  max allocated {line['max_allocated_mb']} MB{ranks}")


if __name__ == "__main__":
    main()
