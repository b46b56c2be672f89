"""Predicted step time and tokens/s/GPU of Llama-3 8B, 70B and 405B from 8 to 4,096 GPUs: each
point one rank simulated on this CPU (megatron_fsdp.simulate, the real wrap and step under fake
tensors) and its step timed by the step-time model (megatron_fsdp/simulate/step_time.py) on the
default cluster (8-GPU H200 nodes, 8 x 400 Gb/s InfiniBand, 510 model TFLOP/s a GPU).

Every decoder layer is the same unit, so each point is simulated at 3 and at 4 layers and its
times carried linearly to the model's depth (each further layer adds what the fourth added, the
pipeline of gathers, compute and reductions being in its steady state by then); ``--check-depth``
sets that beside full-depth simulations of 8B (docs/scaling.md gives the result).

    python benchmarks/scaling_plots.py                       # simulates, writes the PNGs and points
    python benchmarks/scaling_plots.py --from-json POINTS    # redraws from saved points

Writes docs/images/scaling_step_time.png, docs/images/scaling_tokens_per_gpu.png and the points
as JSON (benchmarks/results/2026-12-02b_scaling_plot_points.json). Each rank: batch 1 x 4,096
tokens, bf16 weights, fp32 main weights, bf16 gradients and communication, AdamW, no activation
checkpointing (a time model: whether the activations fit is not asked). Layouts: ZeRO-3 over
every rank, and HSDP with the smallest shard group of 8, 64 or 512 ranks that holds the model
states in half an H200 (8B: 8, 70B: 64, 405B: 512). 72 simulated ranks of 3 and 4 layers (ours'
36 and torch FSDP2's 36): 120 s of CPU time, 123 s of wall time in one process.

FSDP2's curve: :func:`torch_fsdp2` runs torch's own ``fully_shard`` on the same model, mesh,
precision and batch (megatron_fsdp/simulate/torch_fsdp2.py) at the same depths, timed by the same
model; its optimizer streams fp32 parameters, fp32 gradients and fp32 Adam moments (28 bytes a
shard element, ours 26: our main gradients are bf16). :func:`points` takes any such schedule as
``fsdp2_schedule``; the command passes :func:`torch_fsdp2`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from megatron_fsdp.simulate import MeshSizes, simulate_rank
from megatron_fsdp.plan_memory.meta_models import PRESETS
from megatron_fsdp.simulate.compute import ComputeSegment
from megatron_fsdp.simulate.models import hugging_face
from megatron_fsdp.simulate.step_time import Cluster, optimizer_bytes, predict_step_time
from megatron_fsdp.simulate.torch_fsdp2 import simulate_torch_fsdp2
from megatron_fsdp.simulate.traffic import Collective

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
POINTS = ROOT / "benchmarks" / "results" / "2026-12-02b_scaling_plot_points.json"
WORLDS = (8, 64, 512, 4096)
SEQ_LEN = 4096
# HSDP's shard group per model: the smallest of 8, 64, 512 holding its model states in half an H200.
MODELS = {"llama3-8b": 8, "llama3-70b": 64, "llama3-405b": 512}

# The depths simulated; the model's own is reached from them (the module's note).
SHORT_DEPTHS = (3, 4)
TIMES = ("seconds", "compute", "optimizer", "communication")

Schedule = tuple[Sequence[Collective], Sequence[ComputeSegment], int]


def ours(preset: str, world: int, dp_outer: int, layers: int | None = None) -> Schedule:
    """Rank 0's step through megatron_fsdp's whole-model door, as the simulator records it;
    ``layers``: the depth simulated (None: the model's)."""
    source = hugging_face(preset, torch.bfloat16, layers)
    report = simulate_rank(source.build, MeshSizes(world, dp_outer=dp_outer), 0,
                           fsdp_unit_modules=list(source.units), seq_len=SEQ_LEN)
    return report.collectives, report.compute, optimizer_bytes(report.model_states)


def torch_fsdp2(preset: str, world: int, dp_outer: int, layers: int | None = None) -> Schedule:
    """Rank 0's step under torch's own FSDP2, the same model, mesh, precision and batch as
    :func:`ours` (simulate/torch_fsdp2.py), in the same records; the optimizer streams FSDP2's
    fp32 parameters, fp32 gradients and fp32 Adam moments."""
    source = hugging_face(preset, torch.bfloat16, layers)
    report = simulate_torch_fsdp2(source.build, MeshSizes(world, dp_outer=dp_outer), 0,
                                  fsdp_unit_modules=list(source.units), seq_len=SEQ_LEN)
    return report.collectives, report.compute, optimizer_bytes(report.model_states_as_ours())


def depth(preset: str) -> int:
    return PRESETS[preset][1]["num_hidden_layers"]


def full_depth_step(schedule: Callable[..., Schedule], preset: str, world: int, dp_outer: int,
                    cluster: Cluster) -> dict[str, float]:
    """The step's times at the model's depth, carried linearly from SHORT_DEPTHS."""
    short, longer = (predict_step_time(*schedule(preset, world, dp_outer, layers), cluster) for layers in SHORT_DEPTHS)
    extra = depth(preset) - SHORT_DEPTHS[1]
    return {name: getattr(longer, name) + extra * (getattr(longer, name) - getattr(short, name)) for name in TIMES}


def points(cluster: Cluster = Cluster(), fsdp2_schedule: Callable[..., Schedule] | None = None,
           saved: Path | None = None) -> list[dict]:
    """Every (implementation, model, layout, world) point's predicted step; with ``saved``, each
    point is written there as it comes, and points already there are kept, not simulated again."""
    found = json.loads(saved.read_text()) if saved is not None and saved.exists() else []
    done = {(p["implementation"], p["model"], p["layout"], p["world"]) for p in found}
    implementations = {"megatron_fsdp": ours} | ({"torch FSDP2": fsdp2_schedule} if fsdp2_schedule else {})
    for implementation, schedule in implementations.items():
        for preset, shard_group in MODELS.items():
            for world in WORLDS:
                layouts = {"ZeRO-3": 1} | ({f"HSDP, shard group {shard_group}": world // shard_group}
                                           if world > shard_group else {})
                for layout, dp_outer in layouts.items():
                    if (implementation, preset, layout, world) in done:
                        continue
                    print(f"{implementation} {preset} W={world} {layout}", flush=True)
                    step = full_depth_step(schedule, preset, world, dp_outer, cluster)
                    found.append({"implementation": implementation, "model": preset, "layout": layout, "world": world,
                                  "step_s": step["seconds"], "compute_s": step["compute"], "optimizer_s": step["optimizer"],
                                  "communication_s": step["communication"],
                                  "exposed_communication_s": step["seconds"] - step["compute"] - step["optimizer"],
                                  "tokens_per_s_per_gpu": SEQ_LEN / step["seconds"]})
                    if saved is not None:
                        saved.write_text(json.dumps(found, indent=1))
    return found


def draw(found: list[dict], images: Path = IMAGES) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, label, name in (("step_s", "predicted step time (s)", "scaling_step_time.png"),
                             ("tokens_per_s_per_gpu", "predicted tokens/s per GPU", "scaling_tokens_per_gpu.png")):
        figure, axes = plt.subplots(1, len(MODELS), figsize=(15, 4.5))
        for axis, preset in zip(axes, MODELS):
            curves: dict[str, list[dict]] = {}
            for point in found:
                if point["model"] == preset:
                    curves.setdefault(f"{point['implementation']}, {point['layout']}", []).append(point)
            for curve, rows in curves.items():
                rows.sort(key=lambda p: p["world"])
                # A layout's colour, an implementation's line: ours solid, FSDP2's dashed.
                theirs = rows[0]["implementation"] != "megatron_fsdp"
                axis.plot([p["world"] for p in rows], [p[key] for p in rows], label=curve,
                          color="tab:orange" if rows[0]["layout"].startswith("HSDP") else "tab:blue",
                          linestyle="--" if theirs else "-", marker="x" if theirs else "o")
            axis.set_xscale("log", base=2)
            axis.set_xticks(WORLDS, [str(w) for w in WORLDS])
            axis.set_title(f"{preset}, 1 x {SEQ_LEN} tokens a GPU")
            axis.set_xlabel("GPUs")
            axis.set_ylabel(label)
            # Headroom above the curves for the legend.
            axis.set_ylim(0, 1.6 * max(p[key] for p in found if p["model"] == preset))
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize=8, loc="upper left")
        figure.suptitle("megatron_fsdp and torch FSDP2, step-time model: 8-GPU H200 nodes, 8 x 400 Gb/s IB, "
                        "510 TFLOP/s a GPU")
        figure.tight_layout()
        images.mkdir(parents=True, exist_ok=True)
        figure.savefig(images / name, dpi=100)
        plt.close(figure)
        written.append(images / name)
    return written


def check_depth(cluster: Cluster = Cluster()) -> list[dict]:
    """Llama-3 8B simulated at its full 32 layers beside the carried-over times, at two layouts,
    ours and torch FSDP2's."""
    rows = []
    for schedule in (ours, torch_fsdp2):
        for world, dp_outer in ((64, 1), (512, 64)):
            full = predict_step_time(*schedule("llama3-8b", world, dp_outer), cluster)
            carried = full_depth_step(schedule, "llama3-8b", world, dp_outer, cluster)
            rows.append({"implementation": schedule.__name__, "world": world, "dp_outer": dp_outer,
                         "full_depth_s": full.seconds, "carried_s": carried["seconds"],
                         "difference": carried["seconds"] / full.seconds - 1})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-json", help="redraw from these saved points instead of simulating")
    parser.add_argument("--check-depth", action="store_true",
                        help="only compare full-depth 8B simulations (ours and FSDP2's) with the times carried "
                             "from 3 and 4 layers")
    parser.add_argument("--points", default=str(POINTS),
                        help="where the simulated points are saved as they come (points already there are kept)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.check_depth:
        check_depth()
        return
    if args.from_json:
        found = json.loads(Path(args.from_json).read_text())
    else:
        found = points(fsdp2_schedule=torch_fsdp2, saved=Path(args.points))
    for path in draw(found):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
