import os
import random
import sys

# Test helpers (op_checks, _dist, models) are imported by name from this folder and from gpu/.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _dist import free_port  # noqa: E402

# The suite's outcome depends on the code alone: property tests draw the same examples on every
# run (derandomize: seeded by each test's own source) and keep no example database between runs.
# Every draw that ever failed is pinned with @example beside its test. The seed sweep
# (`pytest --hypothesis-profile=seed-sweep --hypothesis-seed=N`) draws afresh for each N, to find
# what the fixed draws miss.
try:
    from hypothesis import settings
except ImportError:  # a GPU machine without the CPU suite's test tools: no property test runs there
    settings = None
if settings is not None:
    settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    settings.register_profile("seed-sweep", derandomize=False, database=None, print_blob=True)
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _fixed_random_state():
    """Every test starts from the same torch and Python random state, whatever ran before it."""
    torch.manual_seed(0)
    random.seed(0)


@pytest.fixture
def single_rank_group():
    """A one-process gloo group in the test process, for checks that need no peers."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
