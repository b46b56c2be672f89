"""The C++ ops on CPU against float64 references, opcheck included (CUDA: gpu/test_ops_cuda.py)."""

import pytest

import op_checks

CHECKS = [name for name in dir(op_checks) if name.startswith("check_")]


@pytest.mark.parametrize("check", CHECKS)
def test_op_on_cpu(check: str) -> None:
    getattr(op_checks, check)("cpu")
