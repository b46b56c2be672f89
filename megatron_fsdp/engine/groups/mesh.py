"""Finds the data-parallel process group from a DeviceMesh (or the default group)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp.engine.groups.process_exit import settle_gloo_at_exit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataParallelGroup:
    group: dist.ProcessGroup
    rank: int
    size: int
    # The 1-D mesh of this group when the user gave one; else made from the group on demand.
    mesh: DeviceMesh | None = None
    # HSDP: the group replicating this one's shards ("dp_outer"), and whether the optimizer
    # state is sharded across it too (outer strategy ``optim``, i.e. HFSDP).
    outer: DataParallelGroup | None = None
    outer_shards_optimizer: bool = False
    # Expert parallelism: the group that holds the same experts ("expert data parallel"), which
    # expert parameters are sharded over instead of this one.
    expert: DataParallelGroup | None = None
    # Whether this is that expert group: ranks outside its mesh hold other experts.
    holds_experts: bool = False
    # The mesh the user gave (the one this group's mesh was sliced from) and the dims of this
    # group in it, so parameters' DTensors can live on this group's dims plus the tensor- or
    # expert-parallel ones (``model_parallel_dims``: those of the model's DTensor parameters).
    root_mesh: DeviceMesh | None = None
    dim_names: tuple[str, ...] = ()
    model_parallel_dims: tuple[str, ...] = ()

    @property
    def dense_size(self) -> int:
        """Ranks that see different data: this group times the outer one."""
        return self.size * (self.outer.size if self.outer is not None else 1)

    def model_parallel_mesh(self) -> DeviceMesh | None:
        """The mesh of ``model_parallel_dims`` (None without them)."""
        if not self.model_parallel_dims or self.root_mesh is None:
            return None
        return self.root_mesh[self.model_parallel_dims]

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """A 1-D DeviceMesh over this group (what state-dict DTensors are placed on)."""
        return self.mesh if self.mesh is not None else DeviceMesh.from_group(self.group, device_type)


def resolve_dp_shard_group(device_mesh: DeviceMesh | None, dp_shard_dim: str | None) -> DataParallelGroup:
    """The group FSDP shards over: ``device_mesh[dp_shard_dim]``, the mesh itself when it is
    1-D and no dim is named, or the default group without a mesh. Raises before any collective."""
    if device_mesh is None:
        if dp_shard_dim is not None:
            raise ValueError(f"dp_shard_dim={dp_shard_dim!r} was given without a device_mesh; pass device_mesh too")
        init_default_group()
        return _group_over(None)
    mesh = _named_or_only_dim(
        device_mesh, dp_shard_dim, "device_mesh", "dp_shard_dim", "name the one to shard over with dp_shard_dim"
    )
    return _group_over(mesh, device_mesh)


# What torchrun (and other launchers) set for init_process_group's env:// rendezvous.
LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def init_default_group() -> None:
    """Without a default process group, creates it from the launcher's environment, as torch's
    ``fully_shard`` and ``init_device_mesh`` do (``init_process_group()``: gloo for CPU tensors,
    NCCL for CUDA ones), and, as ``init_device_mesh``, makes ``LOCAL_RANK`` the current CUDA
    device if none was chosen; the group it creates is destroyed at exit
    (engine/groups/process_exit.py). Outside a launcher, raises before any collective."""
    if not dist.is_available():
        raise RuntimeError("megatron_fsdp needs torch.distributed, which this build of torch lacks")
    if dist.is_initialized():
        return
    missing = [name for name in LAUNCHER_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            "megatron_fsdp needs a torch.distributed process group: launch the script with torchrun "
            "(e.g. torchrun --nproc-per-node 2 train.py), and fully_shard creates the default group from its "
            "environment as torch's fully_shard does; or call torch.distributed.init_process_group(...) before "
            f"fully_shard (not launched so: {', '.join(missing)} unset)"
        )
    dist.init_process_group()
    settle_gloo_at_exit(destroy_default_group=True)
    if torch.cuda.is_available() and not torch.cuda.is_initialized() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    logger.info(
        "megatron_fsdp: created the default process group from the launcher's environment (rank %d of %d, %s)",
        dist.get_rank(), dist.get_world_size(), dist.get_backend(),
    )


def _group_over(mesh: DeviceMesh | None, root: DeviceMesh | None = None) -> DataParallelGroup:
    """The group of a 1-D mesh sliced from ``root`` (the default group without one), with this
    rank's place in it."""
    group = dist.group.WORLD if mesh is None else mesh.get_group()
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    return DataParallelGroup(
        group=group, rank=dist.get_rank(group), size=dist.get_world_size(group), mesh=mesh, root_mesh=root, dim_names=names
    )


def _named_or_only_dim(device_mesh: DeviceMesh, dim: str | None, mesh_argument: str, dim_argument: str, hint: str) -> DeviceMesh:
    """``device_mesh[dim]``, or the mesh itself when no dim is named and it is 1-D."""
    if dim is not None:
        return submesh(device_mesh, dim, dim_argument)
    if device_mesh.ndim != 1:
        raise ValueError(f"{mesh_argument} has {device_mesh.ndim} dims {device_mesh.mesh_dim_names}; {hint}")
    return device_mesh


def resolve_outer_group(
    inner: DataParallelGroup,
    device_mesh: DeviceMesh | None,
    dp_outer_dim: str,
    hybrid_fsdp_group: dist.ProcessGroup | None,
    shards_optimizer: bool,
) -> DataParallelGroup:
    """``inner`` with its HSDP outer group ``device_mesh[dp_outer_dim]`` attached."""
    if device_mesh is None:
        raise ValueError(f"dp_outer_dim={dp_outer_dim!r} needs a device_mesh holding that dim")
    outer = _group_over(submesh(device_mesh, dp_outer_dim, "dp_outer_dim"), device_mesh)
    if hybrid_fsdp_group is not None and dist.get_world_size(hybrid_fsdp_group) != inner.size * outer.size:
        raise ValueError(
            f"hybrid_fsdp_group has {dist.get_world_size(hybrid_fsdp_group)} ranks but dp_outer x dp_shard is "
            f"{outer.size} x {inner.size}: pass the flattened (dp_outer, dp_shard) group"
        )
    return dataclasses.replace(inner, outer=outer, outer_shards_optimizer=shards_optimizer)


def resolve_expert_group(dense: DataParallelGroup, expt_device_mesh: DeviceMesh, dp_shard_dim: str | None) -> DataParallelGroup:
    """``dense`` with its expert-data-parallel group ``expt_device_mesh[dp_shard_dim]`` (the
    mesh itself when 1-D) attached."""
    mesh = _named_or_only_dim(
        expt_device_mesh, dp_shard_dim, "expt_device_mesh", "dp_shard_dim (in expt_device_mesh)",
        "name its expert-data-parallel dim with dp_shard_dim (the same name as in device_mesh)",
    )
    expert = dataclasses.replace(_group_over(mesh, expt_device_mesh), holds_experts=True)
    if dense.dense_size % expert.size:
        raise ValueError(
            f"expt_device_mesh's {dp_shard_dim or 'only'} dim has {expert.size} ranks, which does not divide the "
            f"{dense.dense_size} data-parallel ranks; expert-data-parallel size x expert-parallel size must equal "
            "the data-parallel size"
        )
    return dataclasses.replace(dense, expert=expert)


def submesh(device_mesh: DeviceMesh, name: str, argument: str = "dp_shard_dim") -> DeviceMesh:
    """``device_mesh[name]``, where name may also be a dim made with ``_flatten``."""
    try:
        return device_mesh[name]
    except (KeyError, RuntimeError, ValueError) as error:
        raise ValueError(
            f"device_mesh has no dim named {name!r} (its dims: {device_mesh.mesh_dim_names}); pass one of "
            f"those as {argument}, or flatten the dims you want with device_mesh[(...)]._flatten(name)"
        ) from error
