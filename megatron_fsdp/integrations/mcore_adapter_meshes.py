"""The device meshes megatron-core's FullyShardedDataParallel adapter builds, read from the process
groups themselves so that they hold under pipeline parallelism.

megatron-core 0.19's adapter (``mcore_fsdp_adapter``) lays ``torch.arange(world_size)`` out as
``(dp_cp, ep, tp)`` (with HSDP ``(outer, dp_cp, ep, tp)``), which assumes every rank of the world
is in this rank's data-, expert- and tensor-parallel groups: with ``--pipeline-model-parallel-size
2`` the world is twice that and the layout fails (an einops error) before training starts. Here
each rank of the data-parallel group reports the ranks of its own tensor-parallel group (and, under
HSDP, each outer replica its whole data x tensor mesh), so the mesh is the groups' true layout
whatever megatron-core's rank order and pipeline size: without pipeline parallelism it equals the
adapter's own. library_replacements.py puts these in the adapter module when it is imported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def dp_tp_mesh(dp_cp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup | None, ep_size: int = 1) -> torch.Tensor:
    """Global ranks as a ``[dp_cp, tp]`` mesh: row ``i`` is the tensor-parallel group of the ``i``-th
    rank of ``dp_cp_group`` (``ep_size``: unused, the expert layout is in the groups already)."""
    own_tp = dist.get_process_group_ranks(tp_group) if tp_group is not None else [dist.get_rank()]
    rows: list[list[int] | None] = [None] * dp_cp_group.size()
    dist.all_gather_object(rows, own_tp, group=dp_cp_group)
    return _checked(torch.tensor(rows), (dp_cp_group.size(), len(own_tp)), "data x tensor parallel")


def hsdp_tp_mesh(
    outer_group: dist.ProcessGroup, dp_cp_group: dist.ProcessGroup, tp_group: dist.ProcessGroup | None, ep_size: int = 1
) -> torch.Tensor:
    """Global ranks as an ``[outer, dp_cp, tp]`` mesh: slice ``o`` is the data x tensor mesh of the
    ``o``-th rank of ``outer_group`` (the distributed-optimizer instances)."""
    own = dp_tp_mesh(dp_cp_group, tp_group).tolist()
    slices: list[list[list[int]] | None] = [None] * outer_group.size()
    dist.all_gather_object(slices, own, group=outer_group)
    return _checked(torch.tensor(slices), (outer_group.size(), *torch.tensor(own).shape), "outer x data x tensor parallel")


def _checked(mesh: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """Refuses a mesh that is not a layout of distinct ranks holding this one (groups built
    inconsistently across ranks), with the groups' ranks in the message."""
    ranks = mesh.flatten().tolist()
    if tuple(mesh.shape) != shape or len(set(ranks)) != len(ranks) or dist.get_rank() not in ranks:
        raise ValueError(
            f"megatron-core's process groups do not form a {what} mesh around rank {dist.get_rank()}: "
            f"its groups' ranks lay out as {mesh.tolist()} (expected shape {list(shape)}, distinct ranks); "
            "build the groups with megatron-core's parallel_state.initialize_model_parallel"
        )
    return mesh
