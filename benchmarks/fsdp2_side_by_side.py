"""Ours and torch's FSDP2 side by side at 8 to 4,096 ranks (issue 60, docs/scaling.md): for each
model and world size, the last rank (whose shard holds each bucket's padded tail) simulated on
this CPU under torch's fake process group, once through ours (``fully_shard``, ZeRO-3) and once
through torch's ``fully_shard`` (memory by FSDPMemTracker), with the same model, precision (bf16
compute, fp32 weights, bf16 gradient communication), AdamW and batch (1 x 4,096 tokens).

    python benchmarks/fsdp2_side_by_side.py                         # 8B and 70B at W 8, 64, 512, 4096
    python benchmarks/fsdp2_side_by_side.py --models llama3-405b --worlds 4096

Each simulation runs in a process of its own (``--jobs`` of them at once), so its CPU time and
peak resident set are its own; the table (markdown) is printed at the end, the rows as JSON lines
as they come (``--out`` keeps them in a file, ``--resume`` runs only what it does not hold yet).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

GIB = 2**30


def simulate_one(model: str, world_size: int, side: str, seq_len: int) -> dict:
    """One side's simulation of the last rank, with this process's CPU time and peak RSS."""
    import torch

    from megatron_fsdp.simulate import MeshSizes, simulate_rank
    from megatron_fsdp.simulate.models import hugging_face
    from megatron_fsdp.simulate.torch_fsdp2 import simulate_torch_fsdp2

    source = hugging_face(model, torch.bfloat16)
    mesh, rank = MeshSizes(world_size), world_size - 1
    options = dict(fsdp_unit_modules=list(source.units), seq_len=seq_len)
    if side == "ours":
        report = simulate_rank(source.build, mesh, rank, **options)
        padding = sum(row.padding for row in report.buckets)
    else:
        report = simulate_torch_fsdp2(source.build, mesh, rank, **options)
        padding = sum(row.padding for row in report.groups)
    counts = report.step_collectives()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "model": model, "world_size": world_size, "rank": rank, "side": side,
        "model_state_bytes": report.model_state_bytes, "model_states": report.model_states,
        "step_peak": report.step_peak, "first_step_peak": report.first_step_peak, "steps": report.steps,
        "sent_per_step": report.sent_per_step(),
        "gathered_per_step": sum(n * c for (op, _, _, n), c in counts.items() if op == "all_gather"),
        "padding_elements": padding, "simulate_seconds": round(report.seconds, 1),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1), "peak_rss_mb": usage.ru_maxrss // 1024,
    }


def _table(rows: list[dict]) -> str:
    pairs: dict[tuple, dict] = {}
    for row in rows:
        pairs.setdefault((row["model"], row["world_size"]), {})[row["side"]] = row
    lines = ["| model, W | model states ours / FSDP2 (GiB) | step peak ours / FSDP2 (GiB) | "
             "sent per step ours / FSDP2 (GiB) | padding ours / FSDP2 (elements) | CPU s ours / FSDP2 | "
             "peak RSS ours / FSDP2 (MB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (model, world), sides in pairs.items():
        ours, theirs = sides.get("ours"), sides.get("fsdp2")
        if ours is None or theirs is None:
            continue

        def both(key: str, scale: float = 1, digits: int = 3) -> str:
            return f"{ours[key] / scale:,.{digits}f} / {theirs[key] / scale:,.{digits}f}"

        lines.append(f"| {model}, {world:,} | {both('model_state_bytes', GIB)} | {both('step_peak', GIB, 1)} | "
                     f"{both('sent_per_step', GIB, 2)} | {both('padding_elements', digits=0)} | "
                     f"{both('cpu_seconds', digits=1)} | {both('peak_rss_mb', digits=0)} |")
    return "\n".join(lines)


def _run_one(model: str, world: int, side: str, seq_len: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--seq-len", str(seq_len), "--one", model, str(world), side],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{model} W{world} {side} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rows_in(path: str | None) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path) as rows:
        return [json.loads(line) for line in rows if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama3-8b,llama3-70b")
    parser.add_argument("--worlds", default="8,64,512,4096")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", default=None, help="also write the JSON rows to this file")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once, each in its own process")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in --out, run only the rest")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "WORLD", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, world, side = args.one
        print(json.dumps(simulate_one(model, int(world), side, args.seq_len)))
        return
    done = _rows_in(args.out) if args.resume else []
    finished = {(row["model"], row["world_size"], row["side"]) for row in done}
    runs = [(model, int(world), side) for model in args.models.split(",") for world in args.worlds.split(",")
            for side in ("ours", "fsdp2") if (model, int(world), side) not in finished]
    rows, started = list(done), time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:  # the largest first, so the last to finish are short
        futures = [pool.submit(_run_one, *run, args.seq_len) for run in reversed(runs)]
        for future in as_completed(futures):
            row = future.result()
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "w") as out:
                    out.write("\n".join(json.dumps(r) for r in rows) + "\n")
    order = {(model, int(world)): i for i, (model, world) in
             enumerate((m, w) for m in args.models.split(",") for w in args.worlds.split(","))}
    rows.sort(key=lambda row: order.get((row["model"], row["world_size"]), len(order)))
    print(f"\n{_table(rows)}\n\nall simulations: {time.perf_counter() - started:.0f} s of wall time")


if __name__ == "__main__":
    main()
