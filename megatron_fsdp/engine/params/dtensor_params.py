"""Parameters that are DTensors (tensor parallelism, expert parallelism): the local tensor FSDP
flattens into its buckets, and where that local tensor sits in the parameter's global tensor.

FSDP shards a DTensor parameter's *local* tensor over the data-parallel group, on top of the
tensor-/expert-parallel placement. The parameter object stays the user's DTensor (optimizer and
hooks keep their identity); its local tensor object stays too, and only that tensor's ``.data``
is pointed at bucket memory, exactly as a plain parameter's ``.data`` is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

if TYPE_CHECKING:
    from megatron_fsdp.engine.groups.distributed_index import FSDPDistributedIndex

logger = logging.getLogger(__name__)

# megatron-core's FSDP adapter marks tensor-parallel parameters with a mode instead of a dim.
_MODE_DIMS = {"column": 0, "row": 1}


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor whose ``.data`` holds this rank's values of ``param``.

    For a DTensor that is its ``_local_tensor``: DTensor has no public way to re-point a
    parameter's local data in place (``to_local()`` returns a fresh alias on newer torch), and
    replacing the Parameter object would break the optimizer's and the hooks' references.
    tests/test_tensor_parallel.py checks that re-pointing it moves the DTensor's values.
    """
    return param._local_tensor if isinstance(param, DTensor) else param


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient of this rank's local values, in the parameter's own placement."""
    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad
    if tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad.to_local()


def is_expert_param(param: nn.Parameter) -> bool:
    """Megatron-Core's mark for an expert-parallel parameter: ``param.allreduce = False``."""
    return getattr(param, "allreduce", True) is False


@dataclass(frozen=True)
class ParamExtent:
    """Where this rank's local tensor lies in the parameter's global tensor: a rectangle at
    ``offset`` of ``local_shape`` (the whole tensor for a plain parameter); for megatron-core's
    strided split, ``row_blocks`` more rectangles (see :func:`region_of`)."""

    global_shape: torch.Size
    local_shape: torch.Size
    offset: tuple[int, ...]
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] = ()
    row_blocks: tuple[int, ...] = ()

    @property
    def is_distributed(self) -> bool:
        return self.mesh is not None

    def local_region(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor of the global shape, in the local tensor's shape."""
        return region_of(full, self.local_shape, self.offset, self.row_blocks)

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every rank's local tensor (a collective over the mesh)."""
        if not self.is_distributed:
            return local
        gathered = DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.global_shape, stride=contiguous_strides(self.global_shape)
        ).full_tensor()
        return rows_in_global_order(gathered, self.local_shape[0], len(self.row_blocks)) if self.row_blocks else gathered


def region_of(
    full: torch.Tensor, local_shape: tuple[int, ...], offset: tuple[int, ...], row_blocks: tuple[int, ...] = ()
) -> torch.Tensor:
    """The local tensor's part of ``full`` (the global tensor): the rectangle of ``local_shape`` at
    ``offset``; with ``row_blocks`` (a strided split), the local rows are that many equal blocks,
    block ``j`` starting at global row ``row_blocks[j]`` (the other dims at ``offset``)."""
    if not row_blocks:
        return full[tuple(slice(o, o + s) for o, s in zip(offset, local_shape))]
    rows = local_shape[0] // len(row_blocks)
    rest = tuple(slice(o, o + s) for o, s in zip(offset[1:], local_shape[1:]))
    return torch.cat([full[(slice(start, start + rows), *rest)] for start in row_blocks])


def rows_in_global_order(gathered: torch.Tensor, local_rows: int, blocks: int) -> torch.Tensor:
    """A strided split's local tensors stacked rank after rank (what a ``Shard(0)`` gather
    gives) -> the global tensor: rank ``r``'s block ``j`` is global block ``j * ranks + r``."""
    ranks = gathered.shape[0] // local_rows
    grid = gathered.reshape(ranks, blocks, local_rows // blocks, *gathered.shape[1:])
    return grid.transpose(0, 1).reshape(gathered.shape)


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))


def param_extent(name: str, param: torch.Tensor, tensor_parallel_mesh: DeviceMesh | None = None) -> ParamExtent:
    """The extent of ``param`` on this rank. DTensor placements must be Shard/Replicate, each
    tensor dim sharded over at most one mesh dim (what Colwise/Rowwise plans and expert
    sharding make). A plain parameter that Megatron-Core marks as split across
    ``tensor_parallel_mesh`` (of more than one rank) is this rank's block of the global one."""
    if not isinstance(param, DTensor):
        if tensor_parallel_mesh is not None and tensor_parallel_mesh.size() > 1 and is_mcore_tensor_model_parallel(param):
            return _mcore_tensor_parallel_extent(param, tensor_parallel_mesh)
        return ParamExtent(param.shape, param.shape, (0,) * param.dim())
    mesh, placements = param.device_mesh, tuple(param.placements)
    offset = [0] * param.dim()
    expected = list(param.shape)  # this rank's local shape under torch.chunk splits
    sharded_dims = set()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard) or placement.dim % param.dim() in sharded_dims:
            raise ValueError(
                f"parameter {name} has placements {placements}; megatron_fsdp supports DTensor parameters "
                "whose placements are Shard(d) or Replicate(), each tensor dim sharded over one mesh dim"
            )
        dim = placement.dim % param.dim()
        sharded_dims.add(dim)
        # DTensor shards like torch.chunk: ceil-sized pieces, the last ones short or empty.
        chunk = -(-param.shape[dim] // mesh.size(mesh_dim))
        offset[dim] = min(chunk * mesh.get_local_rank(mesh_dim), param.shape[dim])
        expected[dim] = min(chunk, param.shape[dim] - offset[dim])
    extent = ParamExtent(param.shape, local_tensor(param).shape, tuple(offset), mesh, placements)
    if tuple(extent.local_shape) != tuple(expected):
        raise ValueError(
            f"parameter {name}: local shape {tuple(extent.local_shape)} is not the even torch.chunk split "
            f"{tuple(expected)} of {tuple(param.shape)} over {placements}; megatron_fsdp cannot place it in checkpoints"
        )
    return extent


def _mcore_tensor_parallel_extent(param: torch.Tensor, mesh: DeviceMesh) -> ParamExtent:
    """Megatron-Core splits a tensor-parallel weight into equal blocks along ``partition_dim``,
    tensor-parallel rank r holding block r: as ``Shard(partition_dim)`` over the mesh.

    A gated MLP's ``linear_fc1`` (SwiGLU) is split strided (``partition_stride`` s = 2): its
    global rows are ``s * ranks`` equal blocks and rank r holds blocks ``r, r + ranks, ...`` (its
    slice of the gate, then of the up projection). The placement stays ``Shard(0)``; the extent's
    ``row_blocks`` say where each local block lies, so checkpoints and gathered tensors keep the
    global row order and reshard across tensor-parallel sizes. Refused (before any collective):
    a stride along another dim, or local rows that do not split into ``s`` equal blocks."""
    stride = getattr(param, "partition_stride", 1)
    dim = get_mcore_tensor_parallel_partition_dim(param)
    if stride != 1 and (dim != 0 or param.shape[0] % stride):
        raise ValueError(
            f"a Megatron-Core tensor-parallel parameter of local shape {tuple(param.shape)} has partition_stride="
            f"{stride} along partition_dim {dim}: megatron_fsdp places strided splits along dim 0 into equal row "
            "blocks (megatron-core's gated linear_fc1), not this one; build the layer without a strided partition"
        )
    global_shape, offset = list(param.shape), [0] * param.dim()
    global_shape[dim] *= mesh.size()
    offset[dim] = param.shape[dim] * mesh.get_local_rank()
    row_blocks: tuple[int, ...] = ()
    if stride > 1:
        rows = param.shape[0] // stride
        row_blocks = tuple((block * mesh.size() + mesh.get_local_rank()) * rows for block in range(stride))
        offset[0] = row_blocks[0]
    return ParamExtent(torch.Size(global_shape), param.shape, tuple(offset), mesh, (Shard(dim),), row_blocks)


def check_parallel_params(module: nn.Module, tp_mesh: DeviceMesh | None, expert_mesh_given: bool) -> None:
    """Raises, before any collective, when the model's DTensor or expert parameters do not fit
    the meshes given: dense DTensor parameters must live on ``device_mesh[tp_dim]``, and
    expert parameters need ``expt_device_mesh`` (and it needs them)."""
    experts = []
    for name, param in module.named_parameters():
        if is_expert_param(param):
            experts.append(name)
        elif isinstance(param, DTensor):
            if tp_mesh is None:
                raise ValueError(
                    f"parameter {name} is a DTensor on mesh dims {param.device_mesh.mesh_dim_names}: pass tp_dim "
                    "naming that tensor-parallel dim of device_mesh"
                )
            if param.device_mesh != tp_mesh:
                raise ValueError(
                    f"parameter {name} is a DTensor on mesh {param.device_mesh}, not on device_mesh[tp_dim] "
                    f"{tp_mesh}: tensor-parallelise the model on device_mesh[tp_dim]"
                )
        if isinstance(param, DTensor):
            param_extent(name, param)
    if experts and not expert_mesh_given:
        raise ValueError(
            f"parameters {', '.join(experts[:3])}{' ...' if len(experts) > 3 else ''} are marked as expert-parallel "
            "(allreduce=False) but no expt_device_mesh was given: pass the expert mesh"
        )
    if expert_mesh_given and not experts:
        raise ValueError(
            "expt_device_mesh was given but no parameter is marked as an expert parameter: set "
            "param.allreduce = False on the expert weights (Megatron-Core's convention)"
        )


def get_mcore_tensor_parallel_partition_dim(param: torch.Tensor) -> int | None:
    """The dim Megatron-Core splits ``param`` along across tensor-parallel ranks; None for a
    parameter every tensor-parallel rank holds whole."""
    mode_dim = _MODE_DIMS.get(getattr(param, "_tensor_parallel_mode", None))
    if mode_dim is not None:
        return mode_dim
    if getattr(param, "tensor_model_parallel", False):
        partition_dim = getattr(param, "partition_dim", None)
        if partition_dim is not None and partition_dim >= 0:
            return int(partition_dim)
    return None


def is_mcore_tensor_model_parallel(param: torch.Tensor) -> bool:
    """Whether Megatron-Core splits ``param`` across tensor-parallel ranks."""
    return get_mcore_tensor_parallel_partition_dim(param) is not None


def is_mcore_tensor_parallel_duplicated(param: torch.Tensor) -> bool:
    """Whether every tensor-parallel rank holds ``param`` whole."""
    return get_mcore_tensor_parallel_partition_dim(param) is None


def using_tensor_parallel(dist_index: FSDPDistributedIndex, is_expert_parallel: bool = False) -> bool:
    """Whether ``dist_index`` names a tensor-parallel dim of more than one rank."""
    if dist_index.tp_dim is None:
        return False
    return dist_index.get_submesh(dist_index.tp_dim, is_expert_parallel=is_expert_parallel).size() > 1


def mark_experts_by_name(module: nn.Module) -> None:
    """Given an expert mesh, a model whose parameters carry no expert mark (``allreduce =
    False``, set by Transformer Engine's layers) has its experts found by name, as upstream
    finds them: every parameter under an ``experts`` module (megatron-core's local MoE layers
    set no mark). The mark is megatron-core's own, so its optimizer and gradient code agree."""
    params = list(module.named_parameters())
    if any(is_expert_param(param) for _, param in params):
        return
    named = [(name, param) for name, param in params if ".experts." in f".{name}"]
    for _, param in named:
        param.allreduce = False
    if named:
        logger.info("expt_device_mesh: %d parameters under an 'experts' module are expert parameters", len(named))
