"""torch.optim.Muon (the blocks' matrices) with AdamW (the rest) over NCCL, both doors, against
the same optimizers in one process: the owner exchanges (all-to-alls of uneven pieces; on a
(dp, tp) mesh the object all-gather of every rank's rectangles) run over NCCL here. Up to 4 GPUs;
the tensor-parallel case (dp 2 x tp 2, Colwise up, Rowwise down) needs 4. The runs and checks are
tests/test_whole_matrix_optimizers.py's (``muon_over_dp_tp``: the errors, within LOOSE_RTOL for the
reason given there, and each matrix stepped on one rank)."""

from __future__ import annotations

import pytest
import torch

from _dist import nccl_world, run_distributed
from test_whole_matrix_optimizers import check_muon_over_dp_tp, muon_over_dp_tp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WORLD = nccl_world(4)


@pytest.mark.parametrize("door, tensor_parallel", [("whole-model", False), ("fsdp2", False), ("whole-model", True), ("fsdp2", True)])
def test_muon_over_nccl_steps_like_one_process(door: str, tensor_parallel: bool) -> None:
    if tensor_parallel and WORLD < 4:
        pytest.skip("dp 2 x tp 2 needs 4 GPUs")
    results = run_distributed(muon_over_dp_tp, WORLD, door, tensor_parallel, "cuda", backend="nccl")
    check_muon_over_dp_tp(results, tensor_parallel)
