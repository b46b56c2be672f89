"""Shared by tests/test_restart.py (gloo) and tests/gpu/test_restart_nccl.py (NCCL): launch
examples/train_gpt.py under ``torchrun --max-restarts 1`` on a tiny model, read a run's final
checkpoint back as plain tensors, and compare two runs bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import megatron_fsdp

TRAIN_GPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt.py")
# Checkpoints at steps 3, 6 and 8: a rank killed at step 5 resumes from 3, and one killed while
# step 6 is saved resumes from 3 too.
STEPS, CHECKPOINT_EVERY = 8, 3
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--micro-batch", "4", "--grad-accum", "2"]


def train(checkpoint_dir: str, *extra: str, nproc: int = 2, env: dict[str, str] | None = None, timeout: float = 240) -> str:
    """One torchrun job of ``nproc`` ranks (one restart allowed) to STEPS; returns its log."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "--max-restarts", "1",
        TRAIN_GPT, "--checkpoint-dir", checkpoint_dir, "--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY),
        "--sample-chars", "0", *TINY, *extra,
    ]
    run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    run = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=timeout)
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"torchrun failed ({run.returncode}):\n{log[-6000:]}"
    return log


def resumed_line(checkpoint_dir: str, step: int) -> str:
    """What train_gpt.py's rank 0 logs when it resumes."""
    return f"resumed from {checkpoint_dir} at step {step}"


def saved_line(checkpoint_dir: str, step: int) -> str:
    """What save_checkpoint logs on rank 0 once checkpoint ``step`` is committed."""
    return f"saved checkpoint {os.path.join(checkpoint_dir, f'step_{step:08d}')}\n"


def final_state(checkpoint_dir: str, tmp_path) -> dict:
    """The last checkpoint (which must be step STEPS) as plain tensors, with its loss history."""
    step = megatron_fsdp.latest_checkpoint_step(checkpoint_dir)
    assert step == STEPS, f"{checkpoint_dir}: the last checkpoint is step {step}, not {STEPS}"
    path = os.path.join(checkpoint_dir, f"step_{step:08d}")
    plain = tmp_path / (os.path.basename(checkpoint_dir) + ".pt")
    dcp_to_torch_save(path, str(plain))
    state = torch.load(plain, weights_only=False)
    state["losses"] = torch.load(os.path.join(path, "extra_state.pt"), weights_only=False)["losses"]
    return state


def differences(a, b, where: str = "") -> list[str]:
    """Where two nested states differ (tensors compared bit for bit)."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(set(a) ^ set(b))}"]
        return [d for key in a for d in differences(a[key], b[key], f"{where}.{key}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            error = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
            return [f"{where}: max difference {error}"]
        return []
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def assert_same_ending(uninterrupted_dir: str, resumed_dir: str, tmp_path) -> None:
    """The resumed run's last checkpoint equals the uninterrupted run's: parameters, optimizer
    state, LR schedule and every step's loss."""
    expected, got = final_state(uninterrupted_dir, tmp_path), final_state(resumed_dir, tmp_path)
    assert len(got["losses"]) == STEPS
    found = differences(expected, got)
    assert not found, "the resumed run differs from the uninterrupted one:\n" + "\n".join(found[:20])


def assert_killed_mid_step_and_resumed(log: str, checkpoint_dir: str, fail_at: int) -> None:
    """--fail-at-step ``fail_at`` killed a rank and the restarted job resumed from the checkpoint before."""
    assert f"--fail-at-step {fail_at}: killing this process" in log, "the drill did not kill a rank:\n" + log[-4000:]
    resumed_at = fail_at // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    assert resumed_line(checkpoint_dir, resumed_at) in log, "the job did not restart:\n" + log[-4000:]


def assert_killed_in_save_and_resumed(log: str, checkpoint_dir: str, save_step: int) -> None:
    """--fail-in-save-at-step ``save_step`` killed a rank with its data file written; the
    checkpoint was not committed then (the restarted job resumed from the one before and
    committed ``save_step`` only after that)."""
    killed = f"--fail-in-save-at-step {save_step}: killing this process"
    assert killed in log, "the drill did not kill a rank in the save:\n" + log[-4000:]
    assert ".distcp written, not yet committed" in log.split(killed, 1)[1].splitlines()[0], log[-4000:]
    resumed = resumed_line(checkpoint_dir, save_step - CHECKPOINT_EVERY)
    assert resumed in log, "the job did not restart from the checkpoint before:\n" + log[-4000:]
    saved = saved_line(checkpoint_dir, save_step)
    assert log.count(saved) == 1 and log.index(saved) > log.index(resumed), (
        f"checkpoint {save_step} was committed by the killed attempt:\n" + log[-4000:]
    )
