"""benchmarks/muon_step.py: its Newton-Schulz FLOP count against torch's own Newton-Schulz as
torch's FLOP counter sees it, and the script end to end on CPU (gloo, world 2, a small model)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz
from torch.utils.flop_counter import FlopCounterMode

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import muon_step  # noqa: E402


@pytest.mark.parametrize("shape", [(8, 24), (24, 8), (16, 16)])
def test_newton_schulz_flops_are_what_torchs_muon_computes(shape: tuple[int, int]) -> None:
    # torch's step transposes a tall matrix first, so its cost follows min and max of the shape.
    grad = torch.randn(*shape)
    with FlopCounterMode(display=False) as counter:
        _zeropower_via_newtonschulz(grad, (3.4445, -4.7750, 2.0315), muon_step.NEWTON_SCHULZ_STEPS, 1e-7)
    assert counter.get_total_flops() == muon_step.newton_schulz_flops([shape])


def test_the_benchmark_runs_its_muon_rows_on_cpu(tmp_path) -> None:
    out = tmp_path / "muon.json"
    command = [
        sys.executable, os.path.join(ROOT, "benchmarks", "muon_step.py"), "--device", "cpu", "--nproc-per-node", "2",
        "--config", "small", "--layers", "1", "--seq-len", "16", "--micro-batches", "2", "--steps", "1", "--warmup", "1",
        "--rows", "megatron_fsdp Muon,torch FSDP2 Muon", "--out", str(out),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["implementation"] for row in rows] == ["megatron_fsdp Muon", "torch FSDP2 Muon"], rows
    for row in rows:
        assert row["world"] == 2 and row["median_muon_step_ms"] > 0 and row["ideal_muon_ms"] > 0, row
        # The same model, data and first steps: both start from the same loss (ln 32000 ~ 10.4).
        assert abs(row["final_loss"] - rows[0]["final_loss"]) < 0.05 and 9.5 < row["final_loss"] < 11.5, rows
    assert "x ideal" in run.stdout and "Muon's step by world size" in run.stdout, run.stdout
    projected = json.loads(out.read_text())["projected_muon_step"]
    assert [entry["world"] for entry in projected] == muon_step.PROJECTED_WORLDS, projected


def test_the_projection_takes_the_most_loaded_owner_and_the_exchanged_values() -> None:
    shapes = [(4, 8)] * 3
    one = muon_step.newton_schulz_flops([(4, 8)])
    projected = muon_step.projected_muon_step(shapes, [1, 2, 4], tflops=1e-6, gb_per_s=1e-3)
    # 1e-6 TFLOP/s is 1e6 FLOP/s; 1e-3 GB/s is 1e6 bytes/s.
    assert [entry["newton_schulz_ms"] for entry in projected] == pytest.approx([3 * one / 1e3, 2 * one / 1e3, one / 1e3])
    values = 3 * 32
    exchanged = [0.0, 3 * values * 1 / 4, 3 * values * 3 / 16]  # 3 M (W-1) / W^2 values of 4 bytes
    assert [entry["exchange_ms"] for entry in projected] == pytest.approx([4 * v / 1e3 for v in exchanged])
