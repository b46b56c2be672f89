"""Megatron-LM drop-in (issue 22): megatron-core's FullyShardedDataParallel, distributed optimizer
(clip_grad=1.0), finalize_model_grads and fsdp_dtensor checkpoints on megatron_fsdp train a
2-layer GPTModel exactly as on megatron-core's bundled megatron-fsdp, and resume exactly.

Each package runs in its own torchrun process (install() is process-wide), over every GPU of the
machine, via tests/gpu/megatron_core_run.py; the bundled run also trains megatron-core's own DDP
as the single-process-equivalent reference. fp32 throughout, so the tolerance is fp32's: 1e-5
relative for losses and gradient norms between packages (the optimizers' kernels may differ:
torch's foreach Adam on upstream's DTensors, its per-tensor loop on megatron_fsdp's), 1e-6 for a
resumed run against the run it was saved from (deterministic algorithms; the same kernels).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("megatron_core_run.py")
STRATEGIES = ("optim_grads_params", "optim_grads", "optim")
BETWEEN_PACKAGES, RESUME = 1e-5, 1e-6



def _has_megatron_core() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not _has_megatron_core(), reason="needs megatron-core (Python >= 3.12)"),
]


def _run(package: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{package}.json"
    env = {
        **os.environ,
        # Our checkout first: an installed upstream megatron_fsdp wheel must not shadow it.
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torch.cuda.device_count()}",
        str(RUNNER), "--package", package, "--out", str(out), "--ckpt", str(tmp_path / "ckpt"),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    if result.returncode != 0 or not out.exists():
        pytest.fail(f"{package} run failed (exit {result.returncode}):\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}")
    return json.loads(out.read_text())


def _differences(name: str, ours: list[float], theirs: list[float], rel: float) -> list[str]:
    if len(ours) != len(theirs):
        return [f"{name}: {len(ours)} values vs {len(theirs)}"]
    return [
        f"{name}[{i}]: {a!r} vs {b!r} (rel {abs(a - b) / max(abs(b), 1e-12):.2e})"
        for i, (a, b) in enumerate(zip(ours, theirs))
        if not math.isclose(a, b, rel_tol=rel, abs_tol=0.0)
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("megatron_core")
    results = {package: _run(package, tmp_path) for package in ("bundled", "ours")}
    (tmp_path / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"megatron-core runs written to {tmp_path}")
    return results


def test_ours_is_what_megatron_core_imported(runs):
    assert Path(runs["ours"]["package_file"]).resolve().is_relative_to(REPO), runs["ours"]["package_file"]
    assert "megatron/core" in runs["bundled"]["package_file"], runs["bundled"]["package_file"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trains_like_the_bundled_copy(runs, strategy):
    ours, bundled, reference = runs["ours"], runs["bundled"], runs["bundled"]["reference"]
    assert strategy not in ours["errors"], ours["errors"][strategy]
    mine = ours["strategies"][strategy]
    # Where the bundled copy itself departs from megatron-core's DDP (single-process training),
    # megatron_fsdp follows DDP (issue 22: match single-process training, document the difference).
    expected, against = reference, "megatron-core DDP"
    if strategy in bundled["strategies"]:
        theirs = bundled["strategies"][strategy]
        upstream_off = _differences("loss", theirs["losses"], reference["losses"], BETWEEN_PACKAGES)
        if not upstream_off:
            expected, against = theirs, "the bundled copy"
        else:
            print(f"bundled megatron-fsdp ({strategy}) departs from DDP:\n" + "\n".join(upstream_off[:5]))
    else:
        print(f"bundled megatron-fsdp ({strategy}) failed:\n{bundled['errors'].get(strategy)}")
    problems = _differences("loss", mine["losses"], expected["losses"], BETWEEN_PACKAGES)
    problems += _differences("grad norm", mine["grad_norms"], expected["grad_norms"], BETWEEN_PACKAGES)
    assert not problems, f"{strategy}: megatron_fsdp vs {against}:\n" + "\n".join(problems)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resumes_exactly_from_an_fsdp_dtensor_checkpoint(runs, strategy):
    ours = runs["ours"]
    assert strategy not in ours["errors"], ours["errors"][strategy]
    mine = ours["strategies"][strategy]
    continued = slice(len(mine["losses"]) - len(mine["resumed_losses"]), None)
    problems = _differences("resumed loss", mine["resumed_losses"], mine["losses"][continued], RESUME)
    problems += _differences("resumed grad norm", mine["resumed_grad_norms"], mine["grad_norms"][continued], RESUME)
    assert not problems, f"{strategy}: resumed vs continued run:\n" + "\n".join(problems)
