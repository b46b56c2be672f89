"""Which rank of its shard group steps each whole tensor of a whole-tensor optimizer, and the two
exchanges that bring the tensor's pieces to that rank and its pieces back.

Each tensor is given to one *owner* rank of the 1-D mesh its face is sharded over, balanced by the
work its optimizer does on it (Newton-Schulz on an ``m x n`` matrix costs ~``m n min(m, n)``):
largest first, each to the least loaded rank, ties to the lower index and rank, so every rank
computes the same owners from the faces' metadata alone. The owner receives every rank's piece of
the tensor (:func:`gather_to_owners`) and, after its step, sends each rank its piece back
(:func:`scatter_from_owners`): one all-to-all each way for all tensors of one mesh and dtype, moving
only the pieces (a rank receives ``N (W-1)/W`` values of each tensor it owns, and ``N/W`` of every
other one back). A face whose mesh has more dims (tensor or expert parallel, HFSDP's split pieces)
or whose pieces sit off the mesh's device has no route: the caller gathers it on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from megatron_fsdp.engine.groups.collectives import all_to_all_uneven
from megatron_fsdp.engine.params.sharded_params import ShardSpec


def step_cost(shape: torch.Size | tuple[int, ...]) -> int:
    """The relative cost of a whole-tensor step on a tensor of ``shape``: Newton-Schulz on the
    matrix its first dim and the rest make, ``m n min(m, n)`` (a vector: its length)."""
    numel = 1
    for size in shape:
        numel *= size
    if len(shape) < 2 or numel == 0:
        return numel
    rows = shape[0]
    return numel * min(rows, numel // rows)


def assign_owners(shapes: list[torch.Size | tuple[int, ...]], world: int) -> list[int]:
    """The owner rank (``0 <= owner < world``) of each tensor of ``shapes``: largest
    :func:`step_cost` first, each to the rank with the least cost so far (ties: lower index, lower
    rank). Deterministic, so every rank computes the same owners."""
    load = [0] * world
    owners = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-step_cost(shapes[i]), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += step_cost(shapes[index])
    return owners


@dataclass(frozen=True)
class Route:
    """How one tensor moves between its pieces and its owner on ``mesh`` (1-D): ``pieces[r]`` is
    ``(start, length)`` of rank r's piece in the flattened tensor, or None where every rank holds
    it whole (``no_shard``: the owner needs nothing sent, and sends every rank the whole)."""

    mesh: DeviceMesh
    shape: torch.Size
    pieces: tuple[tuple[int, int], ...] | None
    owner: int = 0

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def sent_to_owner(self, rank: int) -> int:
        """How many values rank ``rank`` sends the owner."""
        if self.pieces is None:
            return self.numel if rank == self.owner else 0
        return self.pieces[rank][1]

    def piece_of(self, rank: int) -> tuple[int, int]:
        """``(start, length)`` of what the owner sends rank ``rank`` back."""
        return (0, self.numel) if self.pieces is None else self.pieces[rank]


def route_of(spec: ShardSpec, piece: torch.Tensor) -> Route | None:
    """The route of a face of ``spec`` whose local piece is ``piece``, owner not yet set; None
    where the exchanges do not apply (see the module docstring)."""
    if spec.mesh.ndim != 1 or piece.device.type != spec.mesh.device_type:
        return None
    if spec.layout is None:
        return Route(spec.mesh, spec.global_shape, None) if spec.placements == (Replicate(),) else None
    if spec.layout.dp_dims != 1 or tuple(spec.layout.local_shape) != tuple(spec.global_shape):
        return None
    return Route(spec.mesh, spec.global_shape, spec.layout.pieces)


def gather_to_owners(routes: list[Route], local_pieces: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The whole of each tensor (flat) on its owner, None on every other rank, from each rank's
    flat ``local_pieces`` (what :meth:`Route.sent_to_owner` says it sends). All routes share one
    mesh and the pieces one dtype; every rank of the mesh passes the same routes in the same order."""
    if not routes:
        return []
    mesh = routes[0].mesh
    world, me = mesh.size(0), mesh.get_local_rank(0)
    sent = [[i for i, route in enumerate(routes) if route.owner == rank] for rank in range(world)]
    mine = sent[me]
    send = torch.cat([local_pieces[i].reshape(-1)[: routes[i].sent_to_owner(me)] for rank in range(world) for i in sent[rank]])
    send_splits = [sum(routes[i].sent_to_owner(me) for i in sent[rank]) for rank in range(world)]
    received_splits = [sum(routes[i].sent_to_owner(rank) for i in mine) for rank in range(world)]
    received = send.new_empty(sum(received_splits))
    all_to_all_uneven(received, send, received_splits, send_splits, mesh.get_group(0))
    wholes: list[torch.Tensor | None] = [None] * len(routes)
    for i in mine:
        wholes[i] = send.new_empty(routes[i].numel)
    offset = 0
    for rank in range(world):
        for i in mine:
            length = routes[i].sent_to_owner(rank)
            start = routes[i].piece_of(rank)[0]
            wholes[i][start : start + length].copy_(received[offset : offset + length])
            offset += length
    return wholes


def scatter_from_owners(routes: list[Route], wholes: list[torch.Tensor | None], like: torch.Tensor) -> list[torch.Tensor]:
    """This rank's piece (flat) of each tensor, sent by its owner from ``wholes`` (the owner's
    whole tensors; None for the tensors it does not own). ``like`` gives the dtype and device."""
    if not routes:
        return []
    mesh = routes[0].mesh
    world, me = mesh.size(0), mesh.get_local_rank(0)
    mine = [i for i, route in enumerate(routes) if route.owner == me]
    parts = []
    for rank in range(world):
        for i in mine:
            start, length = routes[i].piece_of(rank)
            parts.append(wholes[i].reshape(-1)[start : start + length])
    send = torch.cat(parts) if parts else like.new_empty(0)
    send_splits = [sum(routes[i].piece_of(rank)[1] for i in mine) for rank in range(world)]
    from_rank = [[i for i, route in enumerate(routes) if route.owner == rank] for rank in range(world)]
    received_splits = [sum(routes[i].piece_of(me)[1] for i in from_rank[rank]) for rank in range(world)]
    received = like.new_empty(sum(received_splits))
    all_to_all_uneven(received, send, received_splits, send_splits, mesh.get_group(0))
    pieces: list[torch.Tensor] = [like.new_empty(0)] * len(routes)
    offset = 0
    for rank in range(world):
        for i in from_rank[rank]:
            length = routes[i].piece_of(me)[1]
            pieces[i] = received[offset : offset + length]
            offset += length
    return pieces


def any_rank_failed(meshes: list[DeviceMesh], failed: bool) -> bool:
    """Whether any rank of any of ``meshes`` passed ``failed``: a step that raised on an owner
    only must stop the others before the exchange back (one small all-reduce per mesh)."""
    flag = torch.tensor([1.0 if failed else 0.0])
    for mesh in meshes:
        on_device = flag.to(mesh.device_type)
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=mesh.get_group(0))
        flag = on_device.cpu()
    return bool(flag.item())
