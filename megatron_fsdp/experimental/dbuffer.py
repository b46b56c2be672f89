"""Upstream's v2 ``DBuffer``: several logical tensors of one dtype in one flat buffer, distributed
over a device mesh with one :mod:`~megatron_fsdp.experimental.placement` per mesh axis.

The global buffer is laid out by the engine's bucket arithmetic (:func:`build_bucket_layout`):
the tensors back to back, each starting at a multiple of ``alignment``, the whole padded to a
multiple of ``mesh.size() * alignment``. ``alignment`` is the least common multiple of the
tensors' row lengths (``shape[1:].numel()``), so every range a ``Flat`` axis cuts holds whole
rows of each tensor: a rank's share of a tensor is a view of shape ``(rows, *shape[1:])``. The
layout is the same for every placement (it depends on the shapes and ``mesh.size()`` alone),
so a redistribution moves ranges and never repacks.

With ``Flat`` on the last axes, a rank's local buffer is the range the nested split gives: the
last ``Flat`` axis cuts the buffer into its size's ranges, the one before it cuts each of those,
and so on (the engine's HFSDP split of a shard over the outer group, for ``(Flat(), Flat())``).

Every check runs before any collective and depends on the arguments alone, so a wrong call
raises the same error on every rank. As with torch's DTensor, each rank must make the same calls
with the same mesh, placements and shapes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor import Partial as DTensorPartial
from torch.distributed.tensor import Replicate as DTensorReplicate

from megatron_fsdp.engine.groups.collectives import all_gather_shards, all_reduce_sum, reduce_scatter_sum
from megatron_fsdp.engine.params.layout import BucketLayout, build_bucket_layout
from megatron_fsdp.engine.params.piece_dtensor import FlatLayout, piece_dtensor
from megatron_fsdp.experimental.placement import Flat, Partial, Placement, Replicate

MeshAxis = int | str

_SUPPORTED_TRANSITIONS = (
    "Flat -> Replicate (all-gather), Partial -> Replicate (all-reduce), Partial -> Flat (reduce-scatter), "
    "Replicate -> Flat (a local view) and Replicate -> Partial (local)"
)


class DBuffer:
    """A group of logical tensors of one dtype in one flat buffer on ``mesh``, placed by
    ``placements`` (one per mesh axis). See the module docstring for the layout.

    ``DBuffer(mesh, placements, tensor_shapes, dtype, device)`` allocates this rank's local
    buffer, uninitialised (as ``torch.empty``); ``device`` must be of ``mesh``'s device type.

    Attributes: ``mesh``, ``placements``, ``tensor_shapes`` (global shapes, in order),
    ``layout`` (the engine's :class:`BucketLayout` over ``mesh.size()`` ranks:
    ``layout.slots[i].offset`` is tensor i's global offset, ``layout.padded_numel`` the global
    size), ``offset`` (where this rank's range starts in the global buffer) and
    ``local_buffer`` (this rank's range, a flat contiguous tensor).
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    tensor_shapes: tuple[torch.Size, ...]
    layout: BucketLayout
    offset: int
    local_buffer: torch.Tensor

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Iterable[Placement],
        tensor_shapes: Iterable[Sequence[int]],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        device = torch.device(device)
        numel = self._place(mesh, placements, tensor_shapes, dtype, device)
        self.local_buffer = torch.empty(numel, dtype=dtype, device=device)
        self._owns_storage = True

    def _place(
        self, mesh: DeviceMesh, placements: Iterable[Placement], tensor_shapes: Iterable[Sequence[int]],
        dtype: torch.dtype, device: torch.device,
    ) -> int:
        """Checks the arguments and sets the layout and this rank's range; returns its length."""
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
        if device.type != mesh.device_type:
            raise ValueError(
                f"a DBuffer on {device} cannot take part in a {mesh.device_type} mesh's collectives: put the buffer "
                f"on {mesh.device_type}"
            )
        self.mesh = mesh
        self.placements = _checked_placements(mesh, placements, dtype)
        self.tensor_shapes = _checked_shapes(tensor_shapes)
        self.layout = _global_layout(self.tensor_shapes, mesh.size())
        self.offset, numel = _local_range(self.layout, mesh, self.placements)
        return numel

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def from_local(
        cls,
        local_buffer: torch.Tensor,
        mesh: DeviceMesh,
        placements: Iterable[Placement],
        tensor_shapes: Iterable[Sequence[int]],
    ) -> DBuffer:
        """A DBuffer over ``local_buffer`` (no copy): a flat contiguous tensor of exactly this
        rank's range's length, which collectives then read and write in place."""
        if not isinstance(local_buffer, torch.Tensor) or isinstance(local_buffer, DTensor):
            raise TypeError(f"local_buffer must be a plain torch.Tensor, got {type(local_buffer).__name__}")
        buffer = cls.__new__(cls)
        numel = buffer._place(mesh, placements, tensor_shapes, local_buffer.dtype, local_buffer.device)
        if local_buffer.dim() != 1 or not local_buffer.is_contiguous():
            raise ValueError(
                f"local_buffer must be flat and contiguous (collectives read it as one range), got shape "
                f"{tuple(local_buffer.shape)} with strides {local_buffer.stride()}: pass .reshape(-1).contiguous()"
            )
        if local_buffer.numel() != numel:
            raise ValueError(
                f"local_buffer has {local_buffer.numel()} elements, but this rank's range of a buffer of "
                f"{buffer.layout.padded_numel} on placements {buffer.placements} holds {numel}: allocate that many "
                "(DBuffer(mesh, placements, tensor_shapes, dtype, device) does it for you)"
            )
        buffer.local_buffer = local_buffer
        buffer._owns_storage = _spans_storage(local_buffer)
        return buffer

    @classmethod
    def distribute_tensors(
        cls, tensors: Iterable[torch.Tensor], mesh: DeviceMesh, placements: Iterable[Placement]
    ) -> DBuffer:
        """A new DBuffer holding ``tensors`` (whole on every rank, one dtype), on ``mesh``'s device.
        Padding is zero. Along a ``Partial(SUM)`` axis the values go to the axis's first rank and
        the others hold zeros (so the sum is the tensor); along ``Partial(AVG)`` every rank holds
        them."""
        tensors = [t.detach() for t in tensors]
        if not tensors:
            raise ValueError("DBuffer.distribute_tensors needs at least one tensor")
        dtypes = sorted({str(t.dtype) for t in tensors})
        if len(dtypes) > 1:
            raise ValueError(f"a DBuffer holds one dtype, got tensors of {dtypes}: cast them to one first")
        buffer = cls(mesh, placements, [t.shape for t in tensors], tensors[0].dtype, mesh.device_type)
        buffer.local_buffer.zero_()
        if buffer._holds_sum_values():
            for index, tensor in enumerate(tensors):
                start, length, local_start = buffer._piece(index)
                values = tensor.reshape(-1)[start : start + length]
                buffer.local_buffer[local_start : local_start + length].copy_(values)
        return buffer

    # -- properties and storage ----------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.local_buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.local_buffer.device

    def release_storage(self) -> None:
        """Frees the local buffer's memory, keeping its storage object, so views taken before
        (``get_local_tensor``, the DTensors, autograd's saved tensors) come back with
        :meth:`reallocate_storage`. Until then any use of the buffer raises."""
        self._check_owner("release_storage")
        self.local_buffer.untyped_storage().resize_(0)

    def reallocate_storage(self) -> None:
        """Gives the local buffer memory again (uninitialised) after :meth:`release_storage`."""
        self._check_owner("reallocate_storage")
        self.local_buffer.untyped_storage().resize_(self.local_buffer.numel() * self.local_buffer.element_size())

    def rendezvous(self, mesh_axis: MeshAxis) -> None:
        """Upstream registers the buffer for CUDA symmetric-memory collectives; here every
        collective goes through the mesh's process groups, so there is nothing to register."""
        raise NotImplementedError(
            "DBuffer.rendezvous: megatron_fsdp's DBuffer runs its collectives over the mesh's process groups, "
            "not symmetric memory; leave the call out"
        )

    def _check_owner(self, what: str) -> None:
        if not self._owns_storage:
            raise ValueError(
                f"DBuffer.{what}: this buffer views part of a larger storage (a Replicate -> Flat redistribute, or "
                "from_local of a slice), which resizing would free or grow as a whole; call it on the DBuffer that "
                "owns the storage"
            )

    def _check_storage(self, what: str) -> None:
        buffer = self.local_buffer
        needed = (buffer.storage_offset() + buffer.numel()) * buffer.element_size()
        if buffer.untyped_storage().nbytes() < needed:
            raise RuntimeError(f"DBuffer.{what}: the buffer's storage was released; call reallocate_storage() first")

    # -- per-tensor views ----------------------------------------------------------------------

    def get_local_tensor(self, index: int) -> torch.Tensor:
        """This rank's rows of tensor ``index``: a view into the local buffer of shape
        ``(rows, *shape[1:])`` (the whole tensor where no axis is ``Flat``; zero rows where this
        rank's range holds none of it)."""
        self._check_storage("get_local_tensor")
        shape = self.tensor_shapes[self._index(index)]
        _, length, local_start = self._piece(index)
        rows = length // _row_numel(shape)
        return self.local_buffer[local_start : local_start + length].view(rows, *shape[1:])

    def get_dtensor(self, index: int) -> DTensor:
        """Tensor ``index`` as a DTensor of its global shape on ``mesh``, over this rank's rows
        (no copy). ``Flat`` shows as ``Shard(0)``, ``Replicate``/``Partial`` as torch's. Where an
        axis is ``Flat`` the rows are this layout's, not ``torch.chunk``'s, and the DTensor is
        megatron_fsdp's flat-sharded one: ``full_tensor()``, ``redistribute()`` and DCP's
        save/load (at any world size) give the right values; its local tensor is the flat piece.

        Needs every axis ``Flat`` (a mesh of one or two axes) or none."""
        self._check_storage("get_dtensor")
        index = self._index(index)
        shape = self.tensor_shapes[index]
        flat = [isinstance(p, Flat) for p in self.placements]
        if not any(flat):
            whole = self.get_local_tensor(index).view(shape)
            return piece_dtensor(whole, self.mesh, self._dtensor_placements(), shape, None)
        if not all(flat) or self.mesh.ndim > 2:
            raise NotImplementedError(
                f"DBuffer.get_dtensor on placements {self.placements}: a DTensor here needs every mesh axis Flat (on a "
                "mesh of one or two axes) or none; redistribute first (to Flat from Replicate is a local view, from "
                "Partial a reduce-scatter; Flat -> Replicate an all-gather)"
            )
        if shape.numel() == 0:
            # No rank holds any of it, as torch.chunk's rows of an empty tensor (DCP has no
            # chunk to write of a flat piece of nothing).
            local = self.get_local_tensor(index)
            return piece_dtensor(local, self.mesh, (Shard(0),) * self.mesh.ndim, shape, None)
        split = _split_layout(self.layout, self.mesh, self.placements)
        slot = self.layout.slots[index]
        pieces = []
        for piece_index in range(split.world_size):
            lo, hi = split.local_range(index, piece_index)
            pieces.append((min(max(lo, slot.offset), slot.end) - slot.offset, hi - lo))
        layout = FlatLayout(tuple(shape), (0,) * len(shape), tuple(pieces), self.mesh.ndim)
        _, length, local_start = self._piece(index)
        local = self.local_buffer[local_start : local_start + length]
        return piece_dtensor(local, self.mesh, (Shard(0),) * self.mesh.ndim, shape, layout)

    def _dtensor_placements(self) -> tuple:
        return tuple(
            DTensorPartial("avg" if p.reduce_op == dist.ReduceOp.AVG else "sum") if isinstance(p, Partial)
            else DTensorReplicate()
            for p in self.placements
        )

    def _index(self, index: int) -> int:
        count = len(self.tensor_shapes)
        if isinstance(index, bool) or not isinstance(index, int) or not -count <= index < count:
            raise IndexError(f"tensor index {index!r} out of range: this DBuffer holds {count} tensors")
        return index % count

    def _piece(self, index: int) -> tuple[int, int, int]:
        """This rank's part of tensor ``index``: (start in the flattened tensor, length, start in
        the local buffer)."""
        index = self._index(index)
        split = _split_layout(self.layout, self.mesh, self.placements)
        lo, hi = split.local_range(index, _piece_index(self.mesh, self.placements))
        slot = self.layout.slots[index]
        if lo == hi:
            return 0, 0, 0
        return lo - slot.offset, hi - lo, lo - self.offset

    def _holds_sum_values(self) -> bool:
        """Whether this rank is the first along every ``Partial(SUM)`` axis."""
        return all(
            self.mesh.get_local_rank(axis) == 0
            for axis, p in enumerate(self.placements)
            if isinstance(p, Partial) and p.reduce_op == dist.ReduceOp.SUM
        )

    # -- redistribution ------------------------------------------------------------------------

    def redistribute(self, new_placements: Iterable[Placement], *, out: DBuffer | None = None) -> DBuffer:
        """This buffer on ``new_placements``, which change at most one axis: supported are
        Flat -> Replicate (all-gather), Partial -> Replicate (all-reduce), Partial -> Flat
        (reduce-scatter), Replicate -> Flat (a view of the local buffer, or a copy into ``out``)
        and Replicate -> Partial (the same buffer for AVG; for SUM a copy holding the values on
        the axis's first rank, zeros elsewhere). ``out``: a DBuffer of the result's mesh,
        placements, shapes, dtype and device to write into. Unchanged placements return
        ``self`` (or copy into ``out``)."""
        self._check_storage("redistribute")
        new = _checked_placements(self.mesh, new_placements, self.dtype)
        changed = [axis for axis, (old, p) in enumerate(zip(self.placements, new)) if old != p]
        if not changed:
            if out is None:
                return self
            out = self._out(out, new, self.dtype)
            out.local_buffer.copy_(self.local_buffer)
            return out
        if len(changed) > 1:
            raise NotImplementedError(
                f"DBuffer.redistribute from {self.placements} to {new} changes axes {changed}: change one axis per "
                f"call ({_SUPPORTED_TRANSITIONS})"
            )
        (axis,) = changed
        old, target = self.placements[axis], new[axis]
        if isinstance(old, Flat) and isinstance(target, Replicate):
            return self.allgather(axis, out=out)
        if isinstance(old, Partial) and isinstance(target, Replicate):
            return self.allreduce(axis, out=out)
        if isinstance(old, Partial) and isinstance(target, Flat):
            return self.reduce_scatter(axis, target, out=out)
        if isinstance(old, Replicate) and isinstance(target, Flat):
            return self.scatter(axis, target, out=out)
        if isinstance(old, Replicate) and isinstance(target, Partial):
            return self._to_partial(axis, new, out)
        raise NotImplementedError(
            f"DBuffer.redistribute {old} -> {target} on axis {axis} is not supported ({_SUPPORTED_TRANSITIONS}); "
            "go through Replicate (e.g. Flat -> Replicate -> Partial)"
        )

    def allgather(self, mesh_axis: MeshAxis, *, out: DBuffer | None = None) -> DBuffer:
        """Flat -> Replicate on ``mesh_axis``: every rank gets the axis's ranges (one all-gather)."""
        axis = self._axis(mesh_axis)
        self._expect(axis, Flat, "allgather")
        out = self._out(out, self._replaced(axis, Replicate()), self.dtype)
        self._check_storage("allgather")
        all_gather_shards(out.local_buffer, self.local_buffer, self.mesh.get_group(axis))
        return out

    def allreduce(self, mesh_axis: MeshAxis, *, out: DBuffer | None = None) -> DBuffer:
        """Partial -> Replicate on ``mesh_axis``: the sum (or mean) on every rank (one all-reduce)."""
        axis = self._axis(mesh_axis)
        partial = self._expect(axis, Partial, "allreduce")
        out = self._out(out, self._replaced(axis, Replicate()), self.dtype)
        self._check_storage("allreduce")
        if out.local_buffer.data_ptr() != self.local_buffer.data_ptr():
            out.local_buffer.copy_(self.local_buffer)
        all_reduce_sum(out.local_buffer, self.mesh.get_group(axis))
        self._finish_average(partial, out, axis)
        return out

    def reduce_scatter(self, mesh_axis: MeshAxis, new_placement: Placement, *, out: DBuffer | None = None) -> DBuffer:
        """Partial -> Flat on ``mesh_axis``: each rank gets its range of the sum (or mean)."""
        axis = self._axis(mesh_axis)
        partial = self._expect(axis, Partial, "reduce_scatter")
        _expect_flat(new_placement, "reduce_scatter")
        out = self._out(out, self._replaced(axis, new_placement), self.dtype)
        self._check_storage("reduce_scatter")
        reduce_scatter_sum(out.local_buffer, self.local_buffer, self.mesh.get_group(axis))
        self._finish_average(partial, out, axis)
        return out

    def scatter(self, mesh_axis: MeshAxis, new_placement: Placement, *, out: DBuffer | None = None) -> DBuffer:
        """Replicate -> Flat on ``mesh_axis``, without communication: a DBuffer viewing this
        rank's range of the local buffer, or a copy of it into ``out``."""
        axis = self._axis(mesh_axis)
        self._expect(axis, Replicate, "scatter")
        _expect_flat(new_placement, "scatter")
        placements = self._replaced(axis, new_placement)
        if out is not None:
            out = self._out(out, placements, self.dtype)
        self._check_storage("scatter")
        offset, numel = _local_range(self.layout, self.mesh, placements)
        mine = self.local_buffer[offset - self.offset : offset - self.offset + numel]
        if out is None:
            return DBuffer.from_local(mine, self.mesh, placements, self.tensor_shapes)
        out.local_buffer.copy_(mine)
        return out

    def cast(self, dtype: torch.dtype, *, out: DBuffer | None = None) -> DBuffer:
        """This buffer in ``dtype``, same placements and layout (``self`` when nothing changes)."""
        self._check_storage("cast")
        if dtype == self.dtype and out is None:
            return self
        out = self._out(out, self.placements, dtype)
        out.local_buffer.copy_(self.local_buffer)
        return out

    def _to_partial(self, axis: int, placements: tuple[Placement, ...], out: DBuffer | None) -> DBuffer:
        """Replicate -> Partial: the mean of equal values is the value; their sum is not, so for
        SUM only the axis's first rank keeps them."""
        average = placements[axis].reduce_op == dist.ReduceOp.AVG
        if average and out is None:
            return DBuffer.from_local(self.local_buffer, self.mesh, placements, self.tensor_shapes)
        out = self._out(out, placements, self.dtype)
        if average or self.mesh.get_local_rank(axis) == 0:
            out.local_buffer.copy_(self.local_buffer)
        else:
            out.local_buffer.zero_()
        return out

    def _finish_average(self, partial: Partial, out: DBuffer, axis: int) -> None:
        if partial.reduce_op == dist.ReduceOp.AVG:
            out.local_buffer.div_(self.mesh.size(axis))

    def _axis(self, mesh_axis: MeshAxis) -> int:
        names = tuple(self.mesh.mesh_dim_names or ())
        if isinstance(mesh_axis, str):
            if mesh_axis not in names:
                raise ValueError(f"the mesh has no axis named {mesh_axis!r} (its axes: {names})")
            return names.index(mesh_axis)
        ndim = self.mesh.ndim
        if isinstance(mesh_axis, bool) or not isinstance(mesh_axis, int) or not -ndim <= mesh_axis < ndim:
            raise ValueError(f"mesh axis {mesh_axis!r} is not one of this {ndim}-axis mesh's (names: {names})")
        return mesh_axis % ndim

    def _expect(self, axis: int, kind: type, what: str) -> Placement:
        placement = self.placements[axis]
        if not isinstance(placement, kind):
            raise ValueError(
                f"DBuffer.{what} needs {kind.__name__} on mesh axis {axis}, but the buffer's placements are "
                f"{self.placements}"
            )
        return placement

    def _replaced(self, axis: int, placement: Placement) -> tuple[Placement, ...]:
        placements = self.placements[:axis] + (placement,) + self.placements[axis + 1 :]
        return _checked_placements(self.mesh, placements, self.dtype)

    def _out(self, out: DBuffer | None, placements: tuple[Placement, ...], dtype: torch.dtype) -> DBuffer:
        """``out`` checked against what the result must be, or a new DBuffer of it."""
        if out is None:
            return DBuffer(self.mesh, placements, self.tensor_shapes, dtype, self.device)
        if not isinstance(out, DBuffer):
            raise TypeError(f"out must be a DBuffer, got {type(out).__name__}")
        result = {
            "mesh": self.mesh, "placements": placements, "tensor_shapes": self.tensor_shapes, "dtype": dtype,
            "device": self.device,
        }
        wrong = [f"{name} {getattr(out, name)} (want {want})" for name, want in result.items() if getattr(out, name) != want]
        if wrong:
            raise ValueError(f"out does not match the result: {', '.join(wrong)}; leave out=None for a new buffer")
        out._check_storage("(out)")
        return out


# -- pure arithmetic ----------------------------------------------------------------------------


def _row_numel(shape: torch.Size) -> int:
    return math.prod(shape[1:])


def _checked_shapes(tensor_shapes: Iterable[Sequence[int]]) -> tuple[torch.Size, ...]:
    shapes = []
    for index, shape in enumerate(tensor_shapes):
        size = torch.Size(shape)
        if len(size) == 0:
            raise ValueError(
                f"tensor {index} has shape (): a DBuffer holds tensors of rows (one or more dims); give it shape (1,)"
            )
        if any(d < 0 for d in size) or _row_numel(size) == 0:
            raise ValueError(
                f"tensor {index} has shape {tuple(size)}: a DBuffer needs non-negative sizes and rows of at least one "
                "element (only dim 0 may be 0)"
            )
        shapes.append(size)
    return tuple(shapes)


def _checked_placements(mesh: DeviceMesh, placements: Iterable[Placement], dtype: torch.dtype) -> tuple[Placement, ...]:
    """The placements as a tuple; raises unless they fit ``mesh`` and keep every local buffer one
    contiguous range."""
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"a DBuffer takes one placement per mesh axis: the mesh has {mesh.ndim} {mesh.mesh_dim_names}, got "
            f"{len(placements)} ({placements})"
        )
    for placement in placements:
        if not isinstance(placement, (Flat, Replicate, Partial)):
            raise TypeError(
                f"{placement!r} is not a DBuffer placement: use megatron_fsdp.experimental's Flat(), Replicate() or "
                "Partial(reduce_op) (Flat() for DTensor's Shard(0))"
            )
        if isinstance(placement, Partial):
            if placement.reduce_op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                raise NotImplementedError(
                    f"Partial({placement.reduce_op}): a DBuffer reduces with ReduceOp.SUM or ReduceOp.AVG"
                )
            if placement.reduce_op == dist.ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
                raise ValueError(f"Partial(ReduceOp.AVG) needs a floating-point buffer, not {dtype}: use SUM")
    flat = [isinstance(p, Flat) for p in placements]
    if any(flat) and not all(flat[flat.index(True) :]):
        raise ValueError(
            f"placements {placements}: the Flat axes must be the last ones (each rank's local buffer is then one "
            "contiguous range); change axes in an order that keeps them last (all-gather the first Flat axis "
            "before later ones; reduce-scatter into the axis just before them)"
        )
    return placements


def _global_layout(shapes: tuple[torch.Size, ...], mesh_size: int) -> BucketLayout:
    """The engine's bucket layout with every tensor row-aligned (see the module docstring)."""
    alignment = math.lcm(1, *(_row_numel(s) for s in shapes))
    return build_bucket_layout([s.numel() for s in shapes], mesh_size, alignment)


def _split_layout(layout: BucketLayout, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> BucketLayout:
    """``layout`` cut into one range per combination of the Flat axes' ranks (all of it, one
    range, without Flat axes). ``padded_numel`` is a multiple of ``mesh.size()``, so it divides."""
    count = math.prod(mesh.size(axis) for axis, p in enumerate(placements) if isinstance(p, Flat))
    return dataclasses.replace(layout, world_size=count)


def _piece_index(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> int:
    """Which range of :func:`_split_layout` is this rank's: the last Flat axis's rank counts most
    (it cuts first), the first Flat axis's least."""
    index = 0
    for axis in reversed(range(mesh.ndim)):
        if isinstance(placements[axis], Flat):
            index = index * mesh.size(axis) + mesh.get_local_rank(axis)
    return index


def _local_range(layout: BucketLayout, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[int, int]:
    """(offset, length) of this rank's local buffer in the global one."""
    start, end = _split_layout(layout, mesh, placements).shard_range(_piece_index(mesh, placements))
    return start, end - start


def _spans_storage(tensor: torch.Tensor) -> bool:
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _expect_flat(placement: Placement, what: str) -> None:
    if not isinstance(placement, Flat):
        raise NotImplementedError(f"DBuffer.{what} shards into Flat() only, got {placement!r}")
