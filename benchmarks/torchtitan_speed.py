"""torchtitan's trainer, as shipped, on one GPU: tokens/s of the llama3 debug model with torch's
FSDP2 (``--module llama3``) and megatron_fsdp (``--module megatron_fsdp.integrations.torchtitan``),
eager and with torchtitan's per-block compile (``--compile.enable``), read from torchtitan's own
log lines (``step: N ... tps: T``). Launched with torchrun, torchtitan's launcher, world 1, no
network: the tokenizer and data come from examples/torchtitan_offline_assets.py.

    python benchmarks/torchtitan_speed.py RESULTS_DIR [--steps 12] [--dry-run]

Writes RESULTS_DIR/torchtitan_speed.json and .md: median tps over the steps after the first 3
(warm-up and compile), and the error tail of any run that failed.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from torchtitan_offline_assets import write_offline_assets  # noqa: E402

MODULES = {"fsdp2": "llama3", "megatron_fsdp": "megatron_fsdp.integrations.torchtitan"}
TPS_LINE = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
WARMUP_STEPS = 3


def command(module: str, compiled: bool, steps: int, dump_folder: str) -> list[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            "-m", "torchtitan.train", "--module", module, "--config", "llama3_debugmodel",
            "--training.steps", str(steps), "--dump_folder", dump_folder]  # fmt: skip
    return args + (["--compile.enable"] if compiled else [])


def tokens_per_second(log: str) -> dict[int, int]:
    return {int(step): int(tps.replace(",", "")) for step, tps in TPS_LINE.findall(ANSI.sub("", log))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    options = parser.parse_args()
    results_dir = Path(options.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    run_dir = write_offline_assets(tempfile.mkdtemp(prefix="torchtitan_speed_"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    rows = []
    for compiled in (False, True):
        for name, module in MODULES.items():
            cmd = command(module, compiled, options.steps, str(Path(run_dir) / f"{name}_{compiled}"))
            print(("would run: " if options.dry_run else "running: ") + " ".join(cmd), flush=True)
            if options.dry_run:
                continue
            done = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)
            log = done.stdout + done.stderr
            tps = tokens_per_second(log)
            steady = [v for step, v in tps.items() if step > WARMUP_STEPS]
            rows.append({
                "implementation": name, "compiled": compiled, "returncode": done.returncode,
                "median_tps": statistics.median(steady) if steady else None, "tps_by_step": tps,
                "error_tail": None if done.returncode == 0 else log[-3000:],
            })  # fmt: skip
            print(f"  {name} compiled={compiled}: rc={done.returncode} median tps={rows[-1]['median_tps']}", flush=True)
    if options.dry_run:
        return
    (results_dir / "torchtitan_speed.json").write_text(json.dumps(rows, indent=2))
    lines = ["| implementation | compiled | median tps (steps > 3) | rc |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['implementation']} | {r['compiled']} | {r['median_tps']} | {r['returncode']} |" for r in rows]
    (results_dir / "torchtitan_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
