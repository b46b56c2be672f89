"""A rank killed mid-run (SIGKILL, as a crashed host) under ``torchrun --max-restarts``: the job
restarts, resumes from its last complete checkpoint and ends with exactly the parameters,
optimizer state and loss history of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import megatron_fsdp

TRAIN_GPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt.py")
STEPS, CHECKPOINT_EVERY, FAIL_AT = 8, 3, 5
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--micro-batch", "4", "--grad-accum", "2"]


def _train(checkpoint_dir: str, *extra: str) -> str:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "1",
        TRAIN_GPT, "--checkpoint-dir", checkpoint_dir, "--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY),
        "--sample-chars", "0", *TINY, *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"torchrun failed ({run.returncode}):\n{log[-6000:]}"
    return log


def _final_state(checkpoint_dir: str, tmp_path) -> dict:
    step = megatron_fsdp.latest_checkpoint_step(checkpoint_dir)
    assert step == STEPS, f"{checkpoint_dir}: the last checkpoint is step {step}, not {STEPS}"
    path = os.path.join(checkpoint_dir, f"step_{step:08d}")
    plain = tmp_path / (os.path.basename(checkpoint_dir) + ".pt")
    dcp_to_torch_save(path, str(plain))
    state = torch.load(plain, weights_only=False)
    state["losses"] = torch.load(os.path.join(path, "extra_state.pt"), weights_only=False)["losses"]
    return state


def _differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [d for key in a for d in _differences(a[key], b[key], f"{where}.{key}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            error = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
            return [f"{where}: max difference {error}"]
        return []
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def test_a_job_whose_rank_is_killed_resumes_and_ends_bit_for_bit_like_an_uninterrupted_one(tmp_path) -> None:
    _train(str(tmp_path / "uninterrupted"))
    log = _train(str(tmp_path / "killed"), "--fail-at-step", str(FAIL_AT))
    assert f"--fail-at-step {FAIL_AT}: killing this process" in log, "the drill did not kill a rank:\n" + log[-4000:]
    resumed_at = FAIL_AT // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    assert f"resumed from {tmp_path / 'killed'} at step {resumed_at}" in log, "the job did not restart:\n" + log[-4000:]

    expected, got = _final_state(str(tmp_path / "uninterrupted"), tmp_path), _final_state(str(tmp_path / "killed"), tmp_path)
    assert len(got["losses"]) == STEPS
    differences = _differences(expected, got)
    assert not differences, "the resumed run differs from the uninterrupted one:\n" + "\n".join(differences[:20])
