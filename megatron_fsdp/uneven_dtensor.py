"""Upstream megatron-fsdp's ``uneven_dtensor`` module, which megatron-core's ``fsdp_dtensor``
checkpoint path calls: DTensors whose ranks hold blocks of rows of different sizes.

Two kinds of DTensor reach these functions here:

- megatron_fsdp's flat pieces (:class:`~megatron_fsdp.engine.params.piece_dtensor.PieceDTensor` with a layout:
  the state dicts of a sharded model and its optimizer). They already describe themselves to
  DCP and gather themselves (``full_tensor()``), so preprocessing leaves them alone and
  :func:`uneven_dtensor_to_full_tensor` calls ``full_tensor()``. A flat piece is not one block of
  rows, so :func:`split_dtensor` and :func:`gather_and_compute_chunk_metadata` refuse it.
- any other DTensor (upstream's row blocks, e.g. from
  :func:`megatron_fsdp.param_and_grad_buffer.make_fsdp_dtensor`, or whole replicated pieces):
  handled with upstream's meaning. A rank's block starts after the blocks of the lower ranks of
  each sharded mesh dim, mesh dim 0 innermost; the blocks' sizes are exchanged with
  ``all_gather_object`` (a collective over each sharded mesh dim).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate

from megatron_fsdp.engine.params.dtensor_params import contiguous_strides

__all__ = [
    "gather_and_compute_chunk_metadata",
    "preprocess_state_dict_for_uneven_dtensor",
    "redistribute_uneven_dtensor_to_replicated",
    "split_dtensor",
    "uneven_dtensor_to_full_tensor",
    "update_uneven_dtensor_chunk_metadata",
]


def is_flat_piece(dtensor: DTensor) -> bool:
    """Whether ``dtensor`` is a megatron_fsdp flat piece (a PieceDTensor with a layout)."""
    return getattr(dtensor, "_flat_layout", None) is not None


def _refuse_flat_piece(dtensor: DTensor, what: str) -> None:
    if is_flat_piece(dtensor):
        raise NotImplementedError(
            f"{what} needs a DTensor whose ranks hold blocks of rows; this one is a megatron_fsdp flat piece (a "
            "contiguous range of the flattened parameter, which may start and end inside a row): use its "
            "full_tensor(), or its __create_chunk_list__() for the rectangles it covers"
        )


def gather_and_compute_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """Where this rank's block lies in the global tensor (a collective over each sharded mesh
    dim): its offsets count the rows of the lower ranks of each sharded dim; its sizes are the
    local tensor's shape."""
    _refuse_flat_piece(dtensor, "gather_and_compute_chunk_metadata()")
    local_shape = tuple(dtensor.to_local().shape)
    if len(local_shape) != len(dtensor.shape):
        raise ValueError(
            f"a DTensor of shape {tuple(dtensor.shape)} with a local tensor of shape {local_shape}: its local "
            "tensor must have as many dims as the DTensor to be one block"
        )
    offsets = [0] * len(local_shape)
    # The extent of the region this rank's group covers so far, growing dim by dim.
    covered = list(local_shape)
    for mesh_dim, placement in enumerate(dtensor.placements):
        if placement.is_partial():
            raise ValueError(f"a DTensor with a Partial placement ({dtensor.placements}) has no chunk of its own")
        if not placement.is_shard():
            continue
        tensor_dim = placement.dim
        group = dtensor.device_mesh.get_group(mesh_dim)
        extents: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(extents, covered, group=group)
        rank = dist.get_rank(group)
        offsets[tensor_dim] += sum(extent[tensor_dim] for extent in extents[:rank])
        covered[tensor_dim] = sum(extent[tensor_dim] for extent in extents)
    for dim, (offset, size) in enumerate(zip(offsets, local_shape)):
        if offset + size > dtensor.shape[dim]:
            raise ValueError(
                f"the ranks' blocks of a DTensor of shape {tuple(dtensor.shape)} overrun dim {dim} "
                f"(this rank's block: offsets {tuple(offsets)}, sizes {local_shape})"
            )
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local_shape))


def update_uneven_dtensor_chunk_metadata(dtensor: DTensor) -> None:
    """Tells DCP where this rank's block lies (:func:`gather_and_compute_chunk_metadata`), through
    the hooks DTensor delegates to its local tensor; flat pieces describe themselves already."""
    if is_flat_piece(dtensor):
        return
    chunk = gather_and_compute_chunk_metadata(dtensor)
    local = dtensor._local_tensor

    def create_chunk_list() -> list[ChunkStorageMetadata]:
        return [chunk]

    def create_write_items(fqn: str, obj: Any) -> list[WriteItem]:
        if local.numel() == 0:
            return []
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=TensorProperties.create_from_tensor(local), size=dtensor.shape
                ),
            )
        ]

    local.__create_chunk_list__ = create_chunk_list
    local.__create_write_items__ = create_write_items


def _chunk_of(dtensor: DTensor) -> ChunkStorageMetadata:
    hook = getattr(dtensor._local_tensor, "__create_chunk_list__", None)
    return hook()[0] if hook is not None else gather_and_compute_chunk_metadata(dtensor)


def _dtensors(state_dict: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], DTensor]]:
    for key, value in state_dict.items():
        if isinstance(value, dict):
            yield from _dtensors(value, (*path, key))
        elif isinstance(value, DTensor):
            yield (*path, key), value


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Prepares every DTensor in the (nested) ``state_dict`` for ``dcp.save``/``dcp.load``
    (:func:`update_uneven_dtensor_chunk_metadata`), in sorted key order so every rank runs the
    same collectives; returns ``state_dict``."""
    for _, dtensor in sorted(_dtensors(state_dict), key=lambda item: [str(k) for k in item[0]]):
        update_uneven_dtensor_chunk_metadata(dtensor)
    return state_dict


def uneven_dtensor_to_full_tensor(dtensor: DTensor) -> torch.Tensor:
    """The whole tensor on every rank of the mesh (a collective over each sharded mesh dim)."""
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"expected a DTensor, got {type(dtensor).__name__}")
    if is_flat_piece(dtensor):
        return dtensor.full_tensor()
    chunk = _chunk_of(dtensor)
    # (offsets, block) of every rank whose blocks this rank has gathered so far.
    blocks = [(tuple(chunk.offsets), dtensor.to_local().detach().contiguous())]
    for mesh_dim, placement in enumerate(dtensor.placements):
        if placement.is_partial():
            raise ValueError(f"a DTensor with a Partial placement ({dtensor.placements}) cannot be gathered as is")
        if placement.is_shard():
            blocks = _gather_blocks(blocks, dtensor.device_mesh.get_group(mesh_dim))
    full = torch.zeros(dtensor.shape, dtype=dtensor.dtype, device=dtensor.to_local().device)
    for offsets, block in blocks:
        full[tuple(slice(o, o + s) for o, s in zip(offsets, block.shape))] = block
    return full


def _gather_blocks(blocks: list[tuple[tuple[int, ...], torch.Tensor]], group: dist.ProcessGroup) -> list:
    """Every rank of ``group``'s blocks: their places by ``all_gather_object``, their values by
    one padded all-gather."""
    described: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(described, [(offsets, tuple(block.shape)) for offsets, block in blocks], group=group)
    flat = torch.cat([block.reshape(-1) for _, block in blocks])
    counts = [sum(torch.Size(shape).numel() for _, shape in rank_blocks) for rank_blocks in described]
    longest = max(counts)
    padded = flat.new_zeros(longest)
    padded[: flat.numel()] = flat
    received = [flat.new_empty(longest) for _ in described]
    dist.all_gather(received, padded, group=group)
    gathered = []
    for rank_blocks, data in zip(described, received):
        start = 0
        for offsets, shape in rank_blocks:
            numel = torch.Size(shape).numel()
            gathered.append((offsets, data[start : start + numel].view(shape)))
            start += numel
    return gathered


def redistribute_uneven_dtensor_to_replicated(dtensor: DTensor) -> DTensor:
    """``dtensor`` as a DTensor replicated on its mesh (:func:`uneven_dtensor_to_full_tensor`)."""
    full = uneven_dtensor_to_full_tensor(dtensor)
    return DTensor.from_local(full, dtensor.device_mesh, [Replicate()] * dtensor.device_mesh.ndim, run_check=False)


def split_dtensor(
    dtensor: DTensor,
    split_size_or_sections: int | list[int],
    dim: int = 0,
    update_uneven_dtensor_chunk_meta: bool = False,
) -> Iterator[DTensor]:
    """Splits ``dtensor`` along ``dim`` into sections of the global tensor (``torch.split``'s
    sizes), each a DTensor over this rank's part of its block (no copy, no communication beyond
    the chunk metadata); ``update_uneven_dtensor_chunk_meta`` prepares each for DCP."""
    _refuse_flat_piece(dtensor, "split_dtensor()")
    total = dtensor.shape[dim]
    if isinstance(split_size_or_sections, int):
        bounds = list(range(0, total, split_size_or_sections)) + [total]
    else:
        if sum(split_size_or_sections) != total:
            raise ValueError(f"sections {split_size_or_sections} do not add up to dim {dim}'s size {total}")
        bounds = [0]
        for size in split_size_or_sections:
            bounds.append(bounds[-1] + size)
    chunk = gather_and_compute_chunk_metadata(dtensor)
    mine_start = chunk.offsets[dim]
    mine_end = mine_start + chunk.sizes[dim]
    local = dtensor.to_local()
    for start, end in zip(bounds[:-1], bounds[1:]):
        lo, hi = max(start, mine_start), min(end, mine_end)
        part = local.narrow(dim, lo - mine_start, max(hi - lo, 0)) if hi > lo else local.narrow(dim, 0, 0)
        shape = list(dtensor.shape)
        shape[dim] = end - start
        section = DTensor.from_local(
            part, dtensor.device_mesh, dtensor.placements, run_check=False, shape=torch.Size(shape),
            stride=contiguous_strides(torch.Size(shape)),
        )
        if update_uneven_dtensor_chunk_meta:
            update_uneven_dtensor_chunk_metadata(section)
        yield section
