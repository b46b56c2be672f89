"""The mixed-precision policy matrix of test_mixed_precision.py on NCCL (2 GPUs, 1 on a one-GPU
machine) against a single-GPU run doing the same arithmetic (parity.emulated_reference_run on
CUDA)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from _dist import nccl_world, run_distributed
from megatron_fsdp import MixedPrecisionPolicy
from parity import Setup, compare_emulated, emulated_reference_run, sharded_runs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WORLD = nccl_world()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SETUPS = {
    f"s{strategy}-{p}-{g}-{c}": Setup(
        strategy=strategy, accum=2, dtype=torch.bfloat16, steps=3,
        policy=MixedPrecisionPolicy(main_params_dtype=DTYPES[p], main_grads_dtype=DTYPES[g], grad_comm_dtype=DTYPES[c]),
    )
    for strategy in (1, 3)
    for p, g, c in itertools.product(DTYPES, DTYPES, DTYPES)
}


@functools.cache
def _results() -> dict:
    names = list(SETUPS)
    per_rank = run_distributed(sharded_runs, WORLD, [SETUPS[n] for n in names], "cuda", backend="nccl", timeout=600)
    return dict(zip(names, per_rank[0]))


@pytest.mark.parametrize("name", list(SETUPS))
def test_nccl_policy_matches_single_gpu_emulation(name: str) -> None:
    setup = SETUPS[name]
    compare_emulated(_results()[name], emulated_reference_run(setup, WORLD, device="cuda"), setup, WORLD, f"{name} nccl")
