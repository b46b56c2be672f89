"""A rank killed mid-run (SIGKILL, as a crashed host) under ``torchrun --max-restarts``: the job
restarts, resumes from its last complete checkpoint and ends with exactly the parameters,
optimizer state and loss history of an uninterrupted run. tests/gpu/test_restart_nccl.py runs
the same drills over NCCL."""

from __future__ import annotations

import pytest

from restart_drill import assert_killed_in_save_and_resumed, assert_killed_mid_step_and_resumed, assert_same_ending, train

FAIL_AT, FAIL_IN_SAVE_AT = 5, 6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    """The run both drills must end like, trained once."""
    checkpoint_dir = str(tmp_path_factory.mktemp("restart") / "uninterrupted")
    train(checkpoint_dir)
    return checkpoint_dir


def test_a_job_whose_rank_is_killed_resumes_and_ends_bit_for_bit_like_an_uninterrupted_one(uninterrupted, tmp_path) -> None:
    killed = str(tmp_path / "killed")
    log = train(killed, "--fail-at-step", str(FAIL_AT))
    assert_killed_mid_step_and_resumed(log, killed, FAIL_AT)
    assert_same_ending(uninterrupted, killed, tmp_path)


def test_a_rank_killed_while_a_checkpoint_is_written_leaves_it_uncommitted_and_the_job_ends_bit_for_bit(
    uninterrupted, tmp_path
) -> None:
    killed = str(tmp_path / "killed_in_save")
    log = train(killed, "--fail-in-save-at-step", str(FAIL_IN_SAVE_AT))
    assert_killed_in_save_and_resumed(log, killed, FAIL_IN_SAVE_AT)
    assert_same_ending(uninterrupted, killed, tmp_path)
