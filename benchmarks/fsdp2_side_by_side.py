"""Ours and torch's FSDP2 side by side at 8 to 4,096 ranks (issue 60, docs/scaling.md): for each
model and world size, the last rank (whose shard holds each bucket's padded tail) simulated on
this CPU under torch's fake process group, once through ours (``fully_shard``, ZeRO-3) and once
through torch's ``fully_shard`` (memory by FSDPMemTracker), with the same model, precision (bf16
compute, fp32 weights, bf16 gradient communication), AdamW and batch (1 x 4,096 tokens).

    python benchmarks/fsdp2_side_by_side.py                         # 8B and 70B at W 8, 64, 512, 4096
    python benchmarks/fsdp2_side_by_side.py --models llama3-405b --worlds 4096
    python benchmarks/fsdp2_side_by_side.py --worlds 64,512,4096 --shard-group 8   # HSDP (W / 8) x 8
    python benchmarks/fsdp2_side_by_side.py --worlds 64,512,4096 --tp 8            # TP 8 x DP W / 8

The mesh: ZeRO-3 over every rank by default; ``--shard-group G`` makes it HSDP, replicas of G-rank
shard groups (G x tp ranks a replica); ``--tp T`` splits each layer over T ranks as Megatron-LM does
(simulate.models.LLAMA_TP_PLAN, both sides through torch's ``parallelize_module``).

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

from megatron_fsdp.simulate import MeshSizes
from megatron_fsdp.simulate.traffic import sent_bytes

GIB = 2**30


def mesh_for(world_size: int, shard_group: int | None = None, tp: int = 1) -> MeshSizes:
    """The mesh of a row: ZeRO-3 over every rank (``shard_group`` None), or HSDP whose replicas
    each shard over ``shard_group`` ranks; ``tp`` ranks split each layer (fastest in the mesh)."""
    if shard_group is None:
        return MeshSizes(world_size, tp=tp)
    replica = shard_group * tp
    if world_size % replica or world_size == replica:
        raise ValueError(f"--shard-group {shard_group} x --tp {tp}: W = {world_size} must be a multiple of {replica} "
                         f"larger than it (HSDP needs at least two replicas); leave --shard-group out for ZeRO-3")
    return MeshSizes(world_size, dp_outer=world_size // replica, tp=tp)


def layout_name(mesh: MeshSizes) -> str:
    """``ZeRO-3``, ``HSDP 64 x 8``, ``TP 8 x DP 64``, ``HSDP 8 x 8, TP 8``: how a row's mesh is named."""
    data = f"HSDP {mesh.dp_outer} x {mesh.dp_shard}" if mesh.dp_outer > 1 else ""
    if mesh.tp == 1:
        return data or "ZeRO-3"
    return f"{data}, TP {mesh.tp}" if data else f"TP {mesh.tp} x DP {mesh.dp_shard}"


def sent_by_op(counts: dict[tuple, int]) -> dict[str, int]:
    """Bytes sent a step by each collective op (ring algorithms), from ``step_collectives()``."""
    found: dict[str, int] = {}
    for (op, group_size, _, message_bytes), count in counts.items():
        found[op] = found.get(op, 0) + count * sent_bytes(op, message_bytes, group_size)
    return found


def simulate_one(model: str, mesh: MeshSizes, side: str, seq_len: int) -> dict:
    """One side's simulation of the last rank, with this process's CPU time and peak RSS."""
    import torch

    from megatron_fsdp.simulate import simulate_rank
    from megatron_fsdp.simulate.models import LLAMA_TP_PLAN, hugging_face
    from megatron_fsdp.simulate.torch_fsdp2 import simulate_torch_fsdp2

    source = hugging_face(model, torch.bfloat16)
    rank = mesh.world_size - 1
    options = dict(fsdp_unit_modules=list(source.units), seq_len=seq_len,
                   tensor_parallel_plan=LLAMA_TP_PLAN if mesh.tp > 1 else None)
    if side == "ours":
        report = simulate_rank(source.build, mesh, rank, **options)
        padding = sum(row.padding for row in report.buckets)
    else:
        report = simulate_torch_fsdp2(source.build, mesh, rank, **options)
        padding = sum(row.padding for row in report.groups)
    counts = report.step_collectives()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "model": model, "world_size": mesh.world_size, "dp_outer": mesh.dp_outer, "tp": mesh.tp,
        "layout": layout_name(mesh), "rank": rank, "side": side, "model_state_bytes": report.model_state_bytes,
        "model_states": report.model_states, "step_peak": report.step_peak, "first_step_peak": report.first_step_peak,
        "steps": report.steps, "sent_per_step": report.sent_per_step(),
        "gathered_per_step": sum(n * c for (op, _, _, n), c in counts.items() if op == "all_gather"),
        "sent_by_op": sent_by_op(counts),
        "padding_elements": padding, "simulate_seconds": round(report.seconds, 1),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1), "peak_rss_mb": usage.ru_maxrss // 1024,
    }


def _row_key(row: dict) -> tuple:
    """(model, W, dp_outer, tp): which simulation a row is, less its side (rows written before
    the mesh options were ZeRO-3's)."""
    return row["model"], row["world_size"], row.get("dp_outer", 1), row.get("tp", 1)


def _table(rows: list[dict]) -> str:
    """The rows as a markdown table, ours and FSDP2 side by side; with an HSDP or TP mesh among
    them, a column of the all-reduces' share of the bytes sent (over the replicas, or TP's
    activations)."""
    pairs: dict[tuple, dict] = {}
    for row in rows:
        pairs.setdefault(_row_key(row), {})[row["side"]] = row
    all_reduces = any(key[2] > 1 or key[3] > 1 for key in pairs)
    lines = ["| model, W | model states ours / FSDP2 (GiB) | step peak ours / FSDP2 (GiB) | "
             "sent per step ours / FSDP2 (GiB) | " + ("of it all-reduces ours / FSDP2 (GiB) | " if all_reduces else "")
             + "padding ours / FSDP2 (elements) | CPU s ours / FSDP2 | peak RSS ours / FSDP2 (MB) |",
             "| --- " * (8 if all_reduces else 7) + "|"]
    for (model, world, *_), sides in pairs.items():
        ours, theirs = sides.get("ours"), sides.get("fsdp2")
        if ours is None or theirs is None:
            continue

        def both(key: str, scale: float = 1, digits: int = 3) -> str:
            return f"{ours[key] / scale:,.{digits}f} / {theirs[key] / scale:,.{digits}f}"

        layout = ours.get("layout", "ZeRO-3")
        named = f"{model}, {world:,}" + ("" if layout == "ZeRO-3" else f" ({layout})")
        reduced = "".join(f"{side.get('sent_by_op', {}).get('all_reduce', 0) / GIB:,.2f}{sep}"
                          for side, sep in ((ours, " / "), (theirs, " | "))) if all_reduces else ""
        lines.append(f"| {named} | {both('model_state_bytes', GIB)} | {both('step_peak', GIB, 1)} | "
                     f"{both('sent_per_step', GIB, 2)} | {reduced}{both('padding_elements', digits=0)} | "
                     f"{both('cpu_seconds', digits=1)} | {both('peak_rss_mb', digits=0)} |")
    return "\n".join(lines)


def _run_one(model: str, mesh: MeshSizes, side: str, seq_len: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--seq-len", str(seq_len), "--one", model, str(mesh.world_size),
                           str(mesh.dp_outer), str(mesh.tp), side], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{model} W{mesh.world_size} {layout_name(mesh)} {side} failed:\n{done.stderr[-4000:]}")
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
    parser.add_argument("--shard-group", type=int, default=None,
                        help="HSDP: replicas of this many shard ranks (dp_outer = W / (shard group x tp)); "
                             "left out: ZeRO-3 over every rank")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (Megatron-LM's split of each layer)")
    parser.add_argument("--out", default=None, help="also write the JSON rows to this file")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run at once, each in its own process")
    parser.add_argument("--resume", action="store_true", help="keep the rows already in --out, run only the rest")
    parser.add_argument("--one", nargs=5, metavar=("MODEL", "WORLD", "DP_OUTER", "TP", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        model, world, dp_outer, tp, side = args.one
        print(json.dumps(simulate_one(model, MeshSizes(int(world), dp_outer=int(dp_outer), tp=int(tp)), side,
                                      args.seq_len)))
        return
    try:
        meshes = [mesh_for(int(world), args.shard_group, args.tp) for world in args.worlds.split(",")]
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    done = _rows_in(args.out) if args.resume else []
    finished = {(*_row_key(row), row["side"]) for row in done}
    runs = [(model, mesh, side) for model in args.models.split(",") for mesh in meshes for side in ("ours", "fsdp2")
            if (model, mesh.world_size, mesh.dp_outer, mesh.tp, side) not in finished]
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
    order = {(model, mesh.world_size, mesh.dp_outer, mesh.tp): i for i, (model, mesh) in
             enumerate((m, mesh) for m in args.models.split(",") for mesh in meshes)}
    rows.sort(key=lambda row: order.get(_row_key(row), len(order)))
    print(f"\n{_table(rows)}\n\nall simulations: {time.perf_counter() - started:.0f} s of wall time")


if __name__ == "__main__":
    main()
