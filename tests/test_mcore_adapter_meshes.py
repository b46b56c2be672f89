"""The meshes megatron-core's FSDP adapter gets from install(): read from the process groups, equal
to the adapter's own world-size layout without pipeline parallelism, and right with it (where the
adapter's own fails)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from _dist import run_distributed
from megatron_fsdp.integrations.mcore_adapter_meshes import dp_tp_mesh, hsdp_tp_mesh


def _groups(rank: int, layout: torch.Tensor, dim: int) -> dist.ProcessGroup:
    """This rank's group along ``dim`` of ``layout`` (every group created on every rank, as
    megatron-core's parallel_state does)."""
    mine = None
    moved = layout.movedim(dim, -1).reshape(-1, layout.shape[dim])
    for ranks in moved.tolist():
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _meshes(rank: int, world: int) -> dict[str, list]:
    # megatron-core's default order tp-cp-ep-dp-pp: tp fastest, pp slowest.
    dp_tp = torch.arange(4).reshape(2, 2)  # (dp, tp)
    pp_dp = torch.arange(4).reshape(2, 2)  # (pp, dp)
    outer_dp = torch.arange(4).reshape(2, 2)  # (outer, dp): two distributed-optimizer instances
    return {
        "dp2-tp2": dp_tp_mesh(_groups(rank, dp_tp, 0), _groups(rank, dp_tp, 1)).tolist(),
        "pp2-dp2": dp_tp_mesh(_groups(rank, pp_dp, 1), None).tolist(),
        "outer2-dp2": hsdp_tp_mesh(_groups(rank, outer_dp, 0), _groups(rank, outer_dp, 1), None).tolist(),
    }


def test_meshes_are_the_groups_layout_with_and_without_pipeline_parallelism() -> None:
    results = run_distributed(_meshes, 4)
    # Without pipeline parallelism: the adapter's own "(dp_cp ep tp) -> ep dp_cp tp" of arange(4).
    assert all(result["dp2-tp2"] == [[0, 1], [2, 3]] for result in results)
    # PP2 x DP2: each stage's data-parallel pair, where the adapter's layout of 4 ranks as 2 fails.
    assert [result["pp2-dp2"] for result in results] == [[[0], [1]], [[0], [1]], [[2], [3]], [[2], [3]]]
    assert all(result["outer2-dp2"] == [[[0], [1]], [[2], [3]]] for result in results)
