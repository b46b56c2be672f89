"""The C++ ops' CUDA kernels against float64 references, opcheck included."""

import pytest
import torch

import float8_op_checks
import op_checks
from megatron_fsdp import _ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHECKS = [name for name in dir(op_checks) if name.startswith("check_")]


def test_extension_was_built_with_cuda_kernels() -> None:
    assert _ops.has_cuda_kernels(), "rebuild on a machine with nvcc and a CUDA torch"


@pytest.mark.parametrize("check", CHECKS)
def test_op_on_cuda(check: str) -> None:
    getattr(op_checks, check)("cuda")


FLOAT8_CHECKS = [name for name in dir(float8_op_checks) if name.startswith("check_")]


@pytest.mark.parametrize("check", FLOAT8_CHECKS)
def test_float8_op_on_cuda(check: str) -> None:
    getattr(float8_op_checks, check)("cuda")
