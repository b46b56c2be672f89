import os
import sys

# Test helpers (op_checks, _dist, models) are imported by name from this folder and from gpu/.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _dist import free_port  # noqa: E402


@pytest.fixture
def single_rank_group():
    """A one-process gloo group in the test process, for checks that need no peers."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
