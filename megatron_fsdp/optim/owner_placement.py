"""Which rank steps each whole tensor of a whole-tensor optimizer, and the two exchanges that
bring the tensor's pieces to that rank and its pieces back.

Each tensor is given to one *owner* rank of the mesh its face lives on, balanced by the work its
optimizer does on it (Newton-Schulz on an ``m x n`` matrix costs ~``m n min(m, n)``): largest
first, each to the least loaded rank, ties to the lower index and rank, so every rank computes the
same owners from the faces' metadata alone (the rules, pure arithmetic the memory planner shares,
are engine/params/owner_assignment.py's). The owner receives every rank's piece of the tensor
(:func:`gather_to_owners`) and, after its step, sends each rank its piece back
(:func:`scatter_from_owners`): all-to-alls each way for all tensors of one mesh and dtype, in runs
that bring an owner at most ``EXCHANGE_CHUNK_VALUES`` values each (:func:`exchange_chunks`), moving
only the pieces (a rank receives ``N (W-1)/W`` values of each tensor it owns, and ``N/W`` of every
other one back). A face replicated over some mesh dims (HSDP's outer dim, a weight tensor parallelism
leaves whole) is exchanged within each replica, over the other dims. Over several dims (tensor or
expert parallel, HFSDP's split pieces) the exchanges run over their ranks as one dim, and a piece
is the rectangles of the global tensor it covers, which the ranks tell each other once
(:func:`routes_of`). A tensor-parallel block that data parallelism leaves whole (``no_shard``, HSDP
over a dp_shard of one rank) is such a piece too, exchanged among the ranks it is split over in
each data-parallel replica: one rectangle, where DTensor's placements put it, or for a strided
split held whole (megatron-core's SwiGLU fc1) one per row block, as its layout says. A face whole
on every rank (``no_shard``, a weight tensor parallelism leaves whole under it) has one owner among
all the ranks of its mesh, which sends each of them the whole. A face whose pieces sit off the
mesh's device has no route: the caller gathers it on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from megatron_fsdp.engine.groups.collectives import all_reduce_max, all_to_all_uneven
from megatron_fsdp.engine.params.owner_assignment import EXCHANGE_CHUNK_VALUES, exchange_chunks
from megatron_fsdp.engine.params.sharded_params import ShardSpec

# ``(offsets, sizes)`` of a block of a route's grid.
Rectangle = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Route:
    """How one tensor of ``shape`` moves between its pieces and its owner over ``mesh`` (1-D):
    ``pieces[r]`` are the rectangles of ``grid`` (the tensor's flat length, or its shape) that
    rank r's piece covers, in the piece's flat order; None where every rank holds it whole
    (``no_shard``: the owner needs nothing sent, and sends every rank the whole)."""

    mesh: DeviceMesh
    shape: torch.Size
    pieces: tuple[tuple[Rectangle, ...], ...] | None
    grid: tuple[int, ...]
    owner: int = 0

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def sent_to_owner(self, rank: int) -> int:
        """How many values rank ``rank`` sends the owner."""
        if self.pieces is None:
            return self.numel if rank == self.owner else 0
        return self.piece_length(rank)

    def piece_of(self, rank: int) -> tuple[Rectangle, ...]:
        """The rectangles of what the owner sends rank ``rank`` back (and what it sent)."""
        return (((0,), (self.numel,)),) if self.pieces is None else self.pieces[rank]

    def piece_length(self, rank: int) -> int:
        """How many values the owner sends rank ``rank`` back."""
        return sum(math.prod(sizes) for _, sizes in self.piece_of(rank))


def flat_route(mesh: DeviceMesh, shape: torch.Size, pieces: tuple[tuple[int, int], ...], owner: int = 0) -> Route:
    """The route of a tensor whose rank r holds ``pieces[r] = (start, length)`` of its flattened values."""
    return Route(mesh, shape, tuple((((start,), (length,)),) for start, length in pieces), (shape.numel(),), owner)


def _region(grid: torch.Tensor, rectangle: Rectangle) -> torch.Tensor:
    offsets, sizes = rectangle
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        grid = grid.narrow(dim, offset, size)
    return grid


def routes_of(specs: list[ShardSpec], pieces: list[torch.Tensor]) -> list[Route | None]:
    """The route of each face of ``specs`` whose local piece is ``pieces[i]``, owners not yet set;
    None where the exchanges do not apply (see the module docstring). A face on a mesh of several
    dims, or held whole and split by its own placements, needs every rank's rectangles: one object
    all-gather per such mesh (every rank of the meshes passes the same faces in the same order)."""
    routes: list[Route | None] = [None] * len(specs)
    spread: dict[DeviceMesh, list[int]] = {}
    for index, (spec, piece) in enumerate(zip(specs, pieces)):
        if piece.device.type != spec.mesh.device_type:
            continue
        flat = (spec.global_shape.numel(),)
        if spec.layout is None and all(isinstance(placement, Replicate) for placement in spec.placements):
            # Held whole on every rank (no_shard, a weight tensor parallelism leaves whole): one
            # owner among all of them steps it and sends each rank the whole.
            mesh = spec.mesh if spec.mesh.ndim == 1 else spec.mesh._flatten()
            routes[index] = Route(mesh, spec.global_shape, None, flat)
            continue
        mesh = _sharded_dims(spec)
        if mesh is None:
            continue
        layout = spec.layout
        if layout is not None and mesh.ndim == 1 and layout.dp_dims == 1 and tuple(layout.local_shape) == tuple(spec.global_shape):
            routes[index] = flat_route(mesh, spec.global_shape, layout.pieces)
        else:
            # Also a face held whole but split by its own placements (tensor or expert parallel,
            # strided or not).
            spread.setdefault(mesh, []).append(index)
    for mesh, indices in spread.items():
        # torch's way to one dim over a mesh's ranks (made once, on every rank).
        flat_mesh = mesh if mesh.ndim == 1 else mesh._flatten()
        told: list = [None] * flat_mesh.size(0)
        own = (flat_mesh.get_local_rank(0), [_own_rectangles(specs[index]) for index in indices])
        dist.all_gather_object(told, own, group=flat_mesh.get_group(0))
        by_rank = dict(told)  # by place in the mesh, as the exchanges count ranks
        for k, index in enumerate(indices):
            per_rank = tuple(by_rank[rank][k] for rank in range(flat_mesh.size(0)))
            routes[index] = Route(flat_mesh, specs[index].global_shape, per_rank, tuple(specs[index].global_shape))
    return routes


def _sharded_dims(spec: ShardSpec) -> DeviceMesh | None:
    """The mesh of the dims ``spec`` is split over: each replica (HSDP's outer dim, a parameter
    replicated over tp) exchanges among its own ranks. None where a replicated dim has no name to
    slice by."""
    replicated = [isinstance(placement, Replicate) for placement in spec.placements]
    if not any(replicated):
        return spec.mesh
    names = spec.mesh.mesh_dim_names
    if names is None:
        return None
    kept = tuple(name for name, dim_replicated in zip(names, replicated) if not dim_replicated)
    return spec.mesh[kept[0]] if len(kept) == 1 else spec.mesh[kept]


def _own_rectangles(spec: ShardSpec) -> tuple[Rectangle, ...]:
    """The rectangles of the global tensor this rank's piece of ``spec`` covers, in its flat order.
    A piece without a layout is the rank's whole local tensor: one block, cut as DTensor cuts it
    (torch.chunk's sizes), whose row-major order is the piece's."""
    if spec.layout is None:
        sizes, offsets = compute_local_shape_and_global_offset(spec.global_shape, spec.mesh, spec.placements)
        return ((tuple(offsets), tuple(sizes)),)
    start, length = spec.layout.mine(spec.mesh)
    return tuple((tuple(offsets), tuple(sizes)) for offsets, sizes, _ in spec.layout.rectangles(start, start + length))


def gather_to_owners(
    routes: list[Route], local_pieces: list[torch.Tensor], chunk_values: int = EXCHANGE_CHUNK_VALUES
) -> list[torch.Tensor | None]:
    """The whole of each tensor (flat) on its owner, None on every other rank, from each rank's
    flat ``local_pieces`` (what :meth:`Route.sent_to_owner` says it sends), one all-to-all per run
    of :func:`exchange_chunks`; an owner's own pieces go straight into its wholes. All routes share
    one mesh and the pieces one dtype; every rank of the mesh passes the same routes in the same
    order."""
    if not routes:
        return []
    mesh = routes[0].mesh
    world, me = mesh.size(0), mesh.get_local_rank(0)
    wholes: list[torch.Tensor | None] = [None] * len(routes)
    like = local_pieces[0]
    for run in exchange_chunks(routes, world, chunk_values):
        to_rank = [[i for i in run if routes[i].owner == rank] for rank in range(world)]
        mine = to_rank[me]
        others = [rank for rank in range(world) if rank != me]
        # The send buffer is gone before the wholes are made: the run's buffers are what the
        # chunking bounds.
        received = _exchange(
            [local_pieces[i].reshape(-1)[: routes[i].sent_to_owner(me)] for rank in others for i in to_rank[rank]],
            [0 if rank == me else sum(routes[i].sent_to_owner(me) for i in to_rank[rank]) for rank in range(world)],
            [0 if rank == me else sum(routes[i].sent_to_owner(rank) for i in mine) for rank in range(world)],
            like,
            mesh,
        )
        for i in mine:
            wholes[i] = like.new_empty(routes[i].numel)
            _place(wholes[i], routes[i], me, local_pieces[i].reshape(-1))
        offset = 0
        for rank in others:
            for i in mine:
                length = routes[i].sent_to_owner(rank)
                _place(wholes[i], routes[i], rank, received[offset : offset + length])
                offset += length
    return wholes


def _exchange(
    parts: list[torch.Tensor], sent_splits: list[int], received_splits: list[int], like: torch.Tensor, mesh: DeviceMesh
) -> torch.Tensor:
    """One uneven all-to-all over ``mesh``: ``parts`` back to back, ``sent_splits[r]`` values of
    them to rank r; returns what each rank sent this one, in rank order."""
    send = torch.cat(parts) if parts else like.new_empty(0)
    received = like.new_empty(sum(received_splits))
    all_to_all_uneven(received, send, received_splits, sent_splits, mesh.get_group(0))
    return received


def _place(whole: torch.Tensor, route: Route, rank: int, values: torch.Tensor) -> None:
    """Writes rank ``rank``'s piece, ``values`` (flat, in the piece's order), into ``whole``."""
    if route.sent_to_owner(rank) == 0:
        return
    grid, offset = whole.view(route.grid), 0
    for rectangle in route.piece_of(rank):
        length = math.prod(rectangle[1])
        _region(grid, rectangle).copy_(values[offset : offset + length].view(rectangle[1]))
        offset += length


def scatter_from_owners(
    routes: list[Route], wholes: list[torch.Tensor | None], into: list[torch.Tensor], chunk_values: int = EXCHANGE_CHUNK_VALUES
) -> None:
    """Writes this rank's piece of each tensor, sent by its owner from ``wholes`` (the owner's
    whole tensors; None for the tensors it does not own), into the flat ``into[i]`` (of
    :meth:`Route.piece_length` values), one all-to-all per run of :func:`exchange_chunks`; an
    owner's own pieces go straight from its wholes."""
    if not routes:
        return
    mesh = routes[0].mesh
    world, me = mesh.size(0), mesh.get_local_rank(0)
    like = into[0]
    for run in exchange_chunks(routes, world, chunk_values):
        from_rank = [[i for i in run if routes[i].owner == rank] for rank in range(world)]
        mine = from_rank[me]
        others = [rank for rank in range(world) if rank != me]
        received = _exchange(
            [_piece(wholes[i], routes[i], rank) for rank in others for i in mine],
            [0 if rank == me else sum(routes[i].piece_length(rank) for i in mine) for rank in range(world)],
            [0 if rank == me else sum(routes[i].piece_length(me) for i in from_rank[rank]) for rank in range(world)],
            like,
            mesh,
        )
        for i in mine:
            into[i].copy_(_piece(wholes[i], routes[i], me))
        offset = 0
        for rank in others:
            for i in from_rank[rank]:
                length = routes[i].piece_length(me)
                into[i].copy_(received[offset : offset + length])
                offset += length


def _piece(whole: torch.Tensor, route: Route, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``whole``, flat in the piece's order (a view where it is one
    contiguous range)."""
    grid = whole.view(route.grid)
    regions = [_region(grid, rectangle).reshape(-1) for rectangle in route.piece_of(rank)]
    if len(regions) == 1:
        return regions[0]
    return torch.cat(regions) if regions else whole.new_empty(0)


def any_rank_failed(meshes: list[DeviceMesh], failed: bool) -> bool:
    """Whether any rank of any of ``meshes`` passed ``failed``: a step that raised on an owner
    only must stop the others before the exchange back (one small all-reduce per mesh)."""
    flag = torch.tensor([1.0 if failed else 0.0])
    for mesh in meshes:
        on_device = flag.to(mesh.device_type)
        all_reduce_max(on_device, mesh.get_group(0))
        flag = on_device.cpu()
    return bool(flag.item())
