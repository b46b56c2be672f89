"""The parameters users see after ``fully_shard``: one DTensor ``nn.Parameter`` per model
parameter, of the parameter's global shape, whose local tensor is this rank's piece of the main
weights (a view into the flat buffers, no copy), and whose ``.grad`` is a DTensor over its piece of
the reduced gradients (a view too).

The mesh holds every dim the parameter is distributed over: the data-parallel dims (``Shard(0)``
where the main weights are sharded, ``Replicate()`` where every rank holds them whole), then the
tensor- or expert-parallel dims of a DTensor parameter with its own placements (of a plain
parameter Megatron-Core splits across tensor-parallel ranks: ``Shard(partition_dim)``). Any other
plain parameter of a tensor-parallel model is ``Replicate()`` on the tensor-parallel dims, so all
dense parameters share one mesh and torch's norms count each element exactly once.

A sharded piece is a contiguous range of the flattened parameter, so its local tensor is 1-D and
its DTensor a :class:`~megatron_fsdp.engine.params.piece_dtensor.PieceDTensor`, which knows every rank's
range (see docs/architecture.md, "The parameter contract").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from megatron_fsdp.engine.groups.mesh import DataParallelGroup
from megatron_fsdp.engine.params.dtensor_params import ParamExtent
from megatron_fsdp.engine.params.piece_dtensor import FlatLayout, as_parameter, piece_dtensor


@dataclass(frozen=True)
class ShardSpec:
    """Where a parameter's piece lives: the mesh and placements of its DTensor, how many ranks
    hold an identical copy of it (what a norm summed over every rank divides its contribution
    by), and for a sharded piece where every rank's piece lies."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    global_shape: torch.Size
    copies: int
    layout: FlatLayout | None = None


class MeshCache:
    """Meshes made by slicing the user's mesh, made once per set of dims."""

    def __init__(self) -> None:
        self._meshes: dict[tuple, DeviceMesh] = {}

    def get(self, dims: tuple[str, ...], dp: DataParallelGroup, device_type: str) -> DeviceMesh:
        key = (id(dp.group), dims, device_type)
        if key not in self._meshes:
            if dims == dp.dim_names:  # the data-parallel group alone (also when no mesh was given)
                self._meshes[key] = dp.device_mesh(device_type)
            else:
                self._meshes[key] = dp.root_mesh[dims]
        return self._meshes[key]


def shard_spec(
    extent: ParamExtent,
    dp: DataParallelGroup,
    layout: FlatLayout | None,
    device_type: str,
    meshes: MeshCache,
) -> ShardSpec:
    """The spec of the piece of a parameter of ``extent`` (its place among the tensor- or
    expert-parallel ranks) in a bucket reduced over ``dp``: ``layout`` says where every rank's piece
    lies when the pieces are shards (``layout.dp_dims == 2``: HFSDP splits each shard again over
    the outer group; 0: every rank holds the whole, in a strided split's layout), None when every
    rank holds the whole bucket."""
    sharded = layout is not None and layout.dp_dims > 0
    split_over_outer = sharded and layout.dp_dims == 2
    dims: list[str] = []
    placements: list[Placement] = []
    distinct = 1
    if split_over_outer:
        dims += dp.outer.dim_names
        placements.append(Shard(0))
        distinct *= dp.outer.size
    dims += dp.dim_names
    placements.append(_data_parallel_shard(extent) if sharded else Replicate())
    distinct *= dp.size if sharded else 1
    if extent.is_distributed:
        dims += extent.mesh.mesh_dim_names
        placements += extent.placements
        for mesh_dim, placement in enumerate(extent.placements):
            if placement.is_shard():
                distinct *= extent.mesh.size(mesh_dim)
    else:
        dims += dp.model_parallel_dims
        placements += [Replicate()] * len(dp.model_parallel_dims)
    mesh = meshes.get(tuple(dims), dp, device_type)
    # Ranks outside the expert mesh hold other experts (megatron-core's spans one expert-parallel
    # rank's experts), so an expert's copies are counted on that mesh.
    holders = dp.root_mesh.size() if dp.holds_experts and dp.root_mesh is not None else dist.get_world_size()
    if holders % distinct:
        raise RuntimeError(f"{distinct} distinct pieces of a parameter cannot spread evenly over {holders} ranks")
    return ShardSpec(mesh, tuple(placements), extent.global_shape, holders // distinct, layout)


def _data_parallel_shard(extent: ParamExtent) -> Placement:
    """The placement on the data-parallel dim, as FSDP2 writes it: ``Shard(0)``, or where the
    parameter is tensor-parallel on dim 0 too, ``_StridedShard(0, split_factor=tp)``, which says
    that the TP split was made first (each TP piece is split again over the data-parallel ranks).
    Our own piece is a flat range whatever the placement (the layout says where); the placement
    is what DCP, redistribute and the optimizer's state-dict helpers read, and what FSDP2's
    checkpoints carry."""
    if not extent.is_distributed:
        return Shard(0)
    split_factor = 1
    for mesh_dim, placement in enumerate(extent.placements):
        if placement.is_shard() and placement.dim % len(extent.global_shape) == 0:
            split_factor *= extent.mesh.size(mesh_dim)
    return _StridedShard(0, split_factor=split_factor) if split_factor > 1 else Shard(0)


def sharded_dtensor(piece: torch.Tensor, spec: ShardSpec) -> DTensor:
    """A DTensor of the global shape over ``piece``, sharing its storage: a whole (replicated)
    piece as a plain DTensor of the local shape; a sharded one as the flat range it is."""
    if spec.layout is None and piece.numel():
        piece = piece.view(_local_shape(piece, spec))
    return piece_dtensor(piece, spec.mesh, spec.placements, spec.global_shape, spec.layout)


def _local_shape(piece: torch.Tensor, spec: ShardSpec) -> torch.Size:
    """The local shape of a piece that is a whole local tensor: the global shape with each
    tensor- or expert-parallel split applied (torch.chunk sizes)."""
    shape = list(spec.global_shape)
    for mesh_dim, placement in enumerate(spec.placements):
        if placement.is_shard():
            dim = placement.dim
            chunk = -(-shape[dim] // spec.mesh.size(mesh_dim))
            start = min(chunk * spec.mesh.get_local_rank(mesh_dim), shape[dim])
            shape[dim] = min(chunk, shape[dim] - start)
    if torch.Size(shape).numel() != piece.numel():
        raise RuntimeError(f"a piece of {piece.numel()} elements is not the local tensor of shape {shape}")
    return torch.Size(shape)


class ShardedParam:
    """One model parameter's face: the DTensor parameter users see (over ``piece``), and the
    gradient DTensor its ``.grad`` is pointed at after each gradient sync (made once,
    re-pointed in place)."""

    def __init__(self, piece: torch.Tensor, spec: ShardSpec, requires_grad: bool) -> None:
        self.spec = spec
        self.piece = piece
        self.param = as_parameter(sharded_dtensor(piece, spec), requires_grad)
        self._grad: DTensor | None = None
        # How a gradient piece is viewed as the local tensor (computed once: it asks the mesh).
        self._grad_shape = _local_shape(piece, spec) if spec.layout is None and piece.numel() else None

    def flat_range(self) -> slice:
        """This rank's range of the flattened local parameter: its piece's place in the
        parameter (upstream's ``megatron_fsdp_slice``)."""
        if self.spec.layout is None:
            return slice(0, self.piece.numel())
        start, length = self.spec.layout.mine(self.spec.mesh)
        return slice(start, start + length)

    @property
    def shown_grad(self) -> DTensor | None:
        """The gradient DTensor :meth:`show_grad` last pointed ``param.grad`` at."""
        return self._grad

    def state(self) -> DTensor:
        """A DTensor over the piece that is not the parameter: what state dicts hold."""
        return sharded_dtensor(self.piece, self.spec)

    def show_grad(self, grad_piece: torch.Tensor | None) -> None:
        """``param.grad`` becomes the DTensor over ``grad_piece`` (None: no gradient)."""
        if grad_piece is None:
            self.param.grad = None
            if self._grad is not None:
                # The cached DTensor must not keep the released gradient buffer alive.
                self._grad._local_tensor.data = self._released
            return
        local = grad_piece if self._grad_shape is None else grad_piece.view(self._grad_shape)
        if self._grad is None or self._grad.dtype != local.dtype:
            # Made over an empty tensor, then re-pointed: a local tensor that were a view of the
            # first gradient buffer would keep that buffer alive as its base for good.
            self._released = local.new_empty(0)
            self._grad = sharded_dtensor(local.new_empty(0), self.spec)
        self._grad._local_tensor.data = local
        self.param.grad = self._grad
