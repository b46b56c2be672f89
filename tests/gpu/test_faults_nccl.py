"""Faults over NCCL at the machine's world size (2 to 4 GPUs): one rank is killed, stops
answering or runs out of memory while the others are in a collective; they end with
megatron_fsdp's error naming the late collective and that rank within collective_timeout, instead
of hanging until NCCL's watchdog tears them down (tests/fault_drills.py)."""

from __future__ import annotations

import pytest
import torch

import fault_drills
from _dist import nccl_world, run_distributed

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a fault between ranks needs 2 GPUs"),
]

WORLD = nccl_world(4)
# On CUDA the error surfaces at the survivor's next collective after the abort, behind its
# synchronisation: a few seconds more than on gloo.
SLACK = 6.0


@pytest.mark.parametrize("fault", fault_drills.FAULTS)
def test_a_failing_rank_makes_the_others_raise_naming_it_within_the_timeout(fault: str) -> None:
    last = frozenset({WORLD - 1})
    results = run_distributed(fault_drills.one_rank_fails, WORLD, fault, "cuda", backend="nccl", dying_ranks=last, timeout=120)
    if fault == "out of memory":
        assert results[-1] == {"raised": "OutOfMemoryError"}, results[-1]
    fault_drills.check_survivors(results, fault, SLACK)
