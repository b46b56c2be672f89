"""``FSDPDistributedIndex``: upstream megatron-fsdp's record of the meshes and process groups a
model is sharded over, as a face over :mod:`megatron_fsdp.engine.groups.mesh`.

Upstream code builds one and passes it to ``MegatronFSDP(module, dist_index, ...)``;
megatron-core reads its groups and sub-meshes. The groups megatron_fsdp shards with are resolved
once, by ``mesh.py``, into :attr:`FSDPDistributedIndex.data_parallel`; every getter here reads
that or the mesh the user gave, so there is one place of truth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp.engine.groups.mesh import (
    DataParallelGroup,
    resolve_dp_shard_group,
    resolve_expert_group,
    resolve_outer_group,
    submesh,
)


def _same_ranks(group: dist.ProcessGroup, reference: dist.ProcessGroup, name: str, reference_name: str) -> None:
    if dist.get_process_group_ranks(group) != dist.get_process_group_ranks(reference):
        raise ValueError(
            f"{name} holds ranks {dist.get_process_group_ranks(group)} but the {reference_name} group it stands in "
            f"for holds {dist.get_process_group_ranks(reference)}: create it over the same ranks "
            f"(torch.distributed.new_group(ranks)) or leave it None"
        )


def _with_outer_replicas(
    expert: DataParallelGroup, expt_device_mesh: DeviceMesh, dp_outer_dim: str,
    hybrid_fsdp_expt_group: dist.ProcessGroup | None, shards_optimizer: bool,
) -> DataParallelGroup:
    """Under HSDP the outer replicas hold the same experts as the dense ones hold the same shards:
    the expert group gets the expert mesh's ``dp_outer_dim`` as its outer group, so expert
    gradients are summed over it too (without it they would miss the other replicas' tokens)."""
    if dp_outer_dim not in (expt_device_mesh.mesh_dim_names or ()):
        raise ValueError(
            f"HSDP with experts: expt_device_mesh has no dim {dp_outer_dim!r} (its dims: "
            f"{expt_device_mesh.mesh_dim_names}); the outer replicas hold the same experts, so the expert mesh "
            f"must hold dp_outer_dim too, as megatron-core's does"
        )
    return resolve_outer_group(expert, expt_device_mesh, dp_outer_dim, hybrid_fsdp_expt_group, shards_optimizer)


def _with_expert_tp(expert: DataParallelGroup | None, expt_device_mesh: DeviceMesh | None, tp_dim: str) -> DataParallelGroup | None:
    """The expert group with the expert mesh's ``tp_dim`` (megatron-core's expert-tensor-parallel
    ranks) as its model-parallel dims, so split expert weights are placed over it as dense ones
    are over the dense ``tp_dim``. An expert mesh without that dim: experts are not split."""
    if expert is None or tp_dim not in (expt_device_mesh.mesh_dim_names or ()):
        return expert
    return dataclasses.replace(expert, model_parallel_dims=tuple(expt_device_mesh[tp_dim].mesh_dim_names))


class FSDPDistributedIndex:
    """The meshes and groups of one sharded model, with upstream megatron-fsdp's constructor.

    - ``device_mesh``: the mesh holding the dims below; None (an extension of upstream):
      shard over the default process group.
    - ``dp_shard_dim``: the dim to shard over (may be flattened, e.g. data x context
      parallel); optional when ``device_mesh`` is 1-D.
    - ``dp_outer_dim``: HSDP, the dim that replicates the shards (``hsdp_outer_dp_shard``: or
      shards the optimizer state too, HFSDP).
    - ``tp_dim``: the tensor-parallel dim; plain parameters are replicated over it. When
      ``expt_device_mesh`` has a dim of that name too, it is the experts' (expert tensor
      parallelism): expert weights Megatron-Core splits are placed over it.
    - ``hybrid_fsdp_group``: the flattened (dp_outer, dp_shard) group, what
      :meth:`get_dp_group` returns under HSDP; checked for size. Optional here (upstream
      requires it), but :meth:`get_dp_group` needs it under HSDP.
    - ``hybrid_fsdp_expt_group``: the same for expert parameters; returned by
      ``get_dp_group(is_expert_parallel=True)`` under HSDP, otherwise unused.
    - ``expt_device_mesh``: the expert mesh; experts are sharded over its ``dp_shard_dim``.
    - ``fsdp_group_ag`` / ``expt_fsdp_group_ag``: upstream's separate all-gather groups. They must
      hold the same ranks as the groups they stand in for; megatron_fsdp gathers on the
      sharding groups themselves (gathers and reductions already overlap on their own
      streams), so they are only returned by ``get_fsdp_group(independent_all_gather=True)``.

    Raises ``ValueError`` (before any collective) when a named dim is missing or a group does
    not fit.
    """

    def __init__(
        self,
        device_mesh: DeviceMesh | None = None,
        dp_shard_dim: str | None = None,
        dp_outer_dim: str | None = None,
        tp_dim: str | None = None,
        hybrid_fsdp_group: dist.ProcessGroup | None = None,
        hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
        hsdp_outer_dp_shard: bool = False,
        expt_device_mesh: DeviceMesh | None = None,
        fsdp_group_ag: dist.ProcessGroup | None = None,
        expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    ) -> None:
        self.device_mesh = device_mesh
        self.dp_shard_dim = dp_shard_dim
        self.dp_outer_dim = dp_outer_dim
        self.tp_dim = tp_dim
        self.use_hybrid_fsdp = dp_outer_dim is not None
        self.hsdp_outer_dp_shard = bool(hsdp_outer_dp_shard)
        self.expt_device_mesh = expt_device_mesh
        self.hybrid_fsdp_group = hybrid_fsdp_group
        self.hybrid_fsdp_expt_group = hybrid_fsdp_expt_group
        self.fsdp_group_ag = fsdp_group_ag
        self.expt_fsdp_group_ag = expt_fsdp_group_ag
        if self.hsdp_outer_dp_shard and dp_outer_dim is None:
            raise ValueError("hsdp_outer_dp_shard=True (HFSDP) needs dp_outer_dim naming the outer data-parallel dim")

        dp = resolve_dp_shard_group(device_mesh, dp_shard_dim)
        if dp_outer_dim is not None:
            dp = resolve_outer_group(dp, device_mesh, dp_outer_dim, hybrid_fsdp_group, self.hsdp_outer_dp_shard)
        if expt_device_mesh is not None:
            dp = resolve_expert_group(dp, expt_device_mesh, dp_shard_dim)
            if dp_outer_dim is not None:
                dp = dataclasses.replace(dp, expert=_with_outer_replicas(
                    dp.expert, expt_device_mesh, dp_outer_dim, hybrid_fsdp_expt_group, self.hsdp_outer_dp_shard
                ))
        if tp_dim is not None:
            if device_mesh is None:
                raise ValueError(f"tp_dim={tp_dim!r} needs a device_mesh holding that dim")
            # Plain parameters of a tensor-parallel model are replicated over its tp dims.
            tp_names = tuple(submesh(device_mesh, tp_dim, "tp_dim").mesh_dim_names)
            dp = dataclasses.replace(dp, model_parallel_dims=tp_names, expert=_with_expert_tp(dp.expert, expt_device_mesh, tp_dim))
        if fsdp_group_ag is not None:
            _same_ranks(fsdp_group_ag, dp.group, "fsdp_group_ag", "dp_shard")
        if expt_fsdp_group_ag is not None:
            if dp.expert is None:
                raise ValueError("expt_fsdp_group_ag was given without expt_device_mesh: pass the expert mesh too")
            _same_ranks(expt_fsdp_group_ag, dp.expert.group, "expt_fsdp_group_ag", "expert data-parallel")
        if hybrid_fsdp_expt_group is not None and dp_outer_dim is None:
            raise ValueError("hybrid_fsdp_expt_group is the expert group of HSDP: pass dp_outer_dim too, or leave it None")
        #: The groups megatron_fsdp shards, reduces and gathers over (mesh.DataParallelGroup).
        self.data_parallel: DataParallelGroup = dp

    # -- upstream's group attributes ----------------------------------------------------------

    @property
    def fsdp_group(self) -> dist.ProcessGroup:
        """The group parameters are sharded over (dp_shard)."""
        return self.data_parallel.group

    @property
    def outer_fsdp_group(self) -> dist.ProcessGroup | None:
        outer = self.data_parallel.outer
        return outer.group if outer is not None else None

    @property
    def expt_fsdp_group(self) -> dist.ProcessGroup | None:
        expert = self.data_parallel.expert
        return expert.group if expert is not None else None

    @property
    def expt_outer_fsdp_group(self) -> dist.ProcessGroup | None:
        outer = self.data_parallel.expert.outer if self.data_parallel.expert is not None else None
        return outer.group if outer is not None else None

    # -- upstream's getters -------------------------------------------------------------------

    def get_dp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        """Every rank that sees different data: the hybrid (dp_outer x dp_shard) group under
        HSDP, else the sharding group; with ``is_expert_parallel`` the expert counterparts."""
        if is_expert_parallel:
            return self.hybrid_fsdp_expt_group if self.use_hybrid_fsdp else self.expt_fsdp_group
        if not self.use_hybrid_fsdp:
            return self.fsdp_group
        if self.hybrid_fsdp_group is None:
            raise ValueError(
                "get_dp_group() under HSDP returns hybrid_fsdp_group, which was not given: pass the flattened "
                "(dp_outer, dp_shard) group, e.g. device_mesh[(dp_outer, dp_shard)]._flatten('dp').get_group()"
            )
        return self.hybrid_fsdp_group

    def get_fsdp_group(self, is_expert_parallel: bool = False, independent_all_gather: bool = False) -> dist.ProcessGroup | None:
        """The sharding group (dp_shard, or the expert-data-parallel one); with
        ``independent_all_gather`` the all-gather group given for it (None if none was)."""
        if is_expert_parallel:
            return self.expt_fsdp_group_ag if independent_all_gather else self.expt_fsdp_group
        return self.fsdp_group_ag if independent_all_gather else self.fsdp_group

    def get_outer_fsdp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        """The dp_outer group under HSDP (of the expert mesh with ``is_expert_parallel``); None
        without HSDP."""
        if not self.use_hybrid_fsdp:
            return None
        return self.expt_outer_fsdp_group if is_expert_parallel else self.outer_fsdp_group

    def get_root_mesh(self, is_expert_parallel: bool = False) -> DeviceMesh | None:
        """The mesh given (``expt_device_mesh`` with ``is_expert_parallel``)."""
        return self.expt_device_mesh if is_expert_parallel else self.device_mesh

    def get_submesh(self, mesh_dim_names: str | Sequence[str], is_expert_parallel: bool = False) -> DeviceMesh:
        """``mesh[mesh_dim_names]`` of the (expert) mesh; raises naming the mesh's dims when it
        has no such dims."""
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        mesh = self.get_root_mesh(is_expert_parallel)
        which = "expt_device_mesh" if is_expert_parallel else "device_mesh"
        if mesh is None or any(name is None for name in names):
            raise ValueError(f"no sub-mesh {names} of {which} {mesh}: name dims of the mesh given (tp_dim, dp_shard_dim, ...)")
        if len(names) == 1:
            return submesh(mesh, names[0], "mesh_dim_names")
        try:
            return mesh[names]
        except (KeyError, RuntimeError, ValueError) as error:
            raise ValueError(f"{which} has no sub-mesh {names} (its dims: {mesh.mesh_dim_names})") from error

    def get_logical_hybrid_fsdp_rank(self, is_expert_parallel: bool = False) -> int:
        """This rank's place in the order HFSDP pieces are laid out in: a bucket is split over
        dp_shard first, then each shard over dp_outer, so ``dp_shard rank * dp_outer size +
        dp_outer rank``."""
        if not self.hsdp_outer_dp_shard:
            raise ValueError("get_logical_hybrid_fsdp_rank() applies to HFSDP only (hsdp_outer_dp_shard=True)")
        if is_expert_parallel:
            raise ValueError("expert parameters are not sharded over dp_outer by megatron_fsdp: no hybrid rank")
        dp = self.data_parallel
        return dp.rank * dp.outer.size + dp.outer.rank
