"""``fully_shard`` without a process group (issue 47, point 4): under torchrun it creates the
default group from the launcher's environment, as torch's ``fully_shard`` does (the doc tests
run every example so, tests/test_docs.py); launched without one, it raises saying how to launch,
before anything else happens."""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_fsdp.engine.groups.mesh import LAUNCHER_ENV

from _dist import free_port

SCRIPT = "import torch, megatron_fsdp; megatron_fsdp.fully_shard(torch.nn.Linear(2, 2), fsdp_unit_modules=[torch.nn.Linear])"


def test_fully_shard_outside_a_launcher_and_without_a_group_says_how_to_launch() -> None:
    env = {name: value for name, value in os.environ.items() if name not in LAUNCHER_ENV}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: megatron_fsdp needs a torch.distributed process group: launch the script with torchrun"), last
    assert "init_process_group" in last and "RANK" in last, last


# Registered before fully_shard, so it runs after fully_shard's handler (atexit runs last first).
EXIT_PROBE = """
import atexit, torch, torch.distributed as dist, megatron_fsdp
atexit.register(lambda: print("group alive at teardown:", dist.is_initialized()))
megatron_fsdp.fully_shard(torch.nn.Sequential(torch.nn.Linear(2, 2)), fsdp_unit_modules=[torch.nn.Linear])
"""


def test_the_group_fully_shard_creates_is_destroyed_before_the_interpreter_tears_down() -> None:
    # Left to the teardown, gloo's threads can abort the process after the script succeeded.
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    for ending in ("", "dist.destroy_process_group()  # the user's own, before ours\n"):
        run = subprocess.run([sys.executable, "-c", EXIT_PROBE + ending], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert "group alive at teardown: False" in run.stdout, run.stdout
