"""tests/test_restart.py's drills over NCCL, on up to 4 GPUs (skipped with fewer than 2): a rank
SIGKILLed mid-step, and one SIGKILLed while a checkpoint is written, under ``torchrun
--max-restarts 1``. The restarted job resumes from the last committed checkpoint and ends bit for
bit like an uninterrupted run, which on CUDA needs train_gpt.py's --deterministic (deterministic
kernels, cuBLAS workspace); every run here uses it. Each torchrun start costs 10-15 s, so the
model is tiny and the uninterrupted run is shared."""

from __future__ import annotations

import pytest
import torch

from restart_drill import assert_killed_in_save_and_resumed, assert_killed_mid_step_and_resumed, assert_same_ending, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FAIL_AT, FAIL_IN_SAVE_AT = 5, 6
# NVLink multicast stays off, as in scripts/gpu_suite.sh, also when this file runs on its own.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _world() -> int:
    world = min(torch.cuda.device_count(), 4)
    if world < 2:
        pytest.skip("needs 2 GPUs")
    return world


def _train(checkpoint_dir: str, *extra: str) -> str:
    return train(checkpoint_dir, "--deterministic", *extra, nproc=_world(), env=NCCL_ENV)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    checkpoint_dir = str(tmp_path_factory.mktemp("restart_nccl") / "uninterrupted")
    _train(checkpoint_dir)
    return checkpoint_dir


def test_a_rank_killed_mid_step_over_nccl_resumes_and_ends_bit_for_bit_like_an_uninterrupted_run(uninterrupted, tmp_path) -> None:
    killed = str(tmp_path / "killed")
    log = _train(killed, "--fail-at-step", str(FAIL_AT))
    assert_killed_mid_step_and_resumed(log, killed, FAIL_AT)
    assert_same_ending(uninterrupted, killed, tmp_path)


def test_a_rank_killed_while_a_checkpoint_is_written_over_nccl_leaves_it_uncommitted_and_ends_bit_for_bit(
    uninterrupted, tmp_path
) -> None:
    killed = str(tmp_path / "killed_in_save")
    log = _train(killed, "--fail-in-save-at-step", str(FAIL_IN_SAVE_AT))
    assert_killed_in_save_and_resumed(log, killed, FAIL_IN_SAVE_AT)
    assert_same_ending(uninterrupted, killed, tmp_path)
