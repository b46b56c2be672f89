"""The C++ ops on CPU against float64 references, opcheck included (CUDA: gpu/test_ops_cuda.py)."""

import pytest

import float8_op_checks
import op_checks

CHECKS = [name for name in dir(op_checks) if name.startswith("check_")]


@pytest.mark.parametrize("check", CHECKS)
def test_op_on_cpu(check: str) -> None:
    getattr(op_checks, check)("cpu")


FLOAT8_CHECKS = [name for name in dir(float8_op_checks) if name.startswith("check_")]


@pytest.mark.parametrize("check", FLOAT8_CHECKS)
def test_float8_op_on_cpu(check: str) -> None:
    getattr(float8_op_checks, check)("cpu")
