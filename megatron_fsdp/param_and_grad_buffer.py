"""Upstream megatron-fsdp's ``param_and_grad_buffer`` module, as far as megatron-core uses it: a
face over megatron_fsdp's buckets (megatron_fsdp/engine/buckets/buffer.py), not a second set of buffers.

- :class:`ParamAndGradBuffer`: what ``model.param_and_grad_buffer`` is. megatron-core's
  distributed optimizer calls :meth:`~ParamAndGradBuffer.copy_main_weights_to_model_weights`
  after its step and reads ``parameter_groups[*].model_weight_buffer.params``; each upstream
  parameter group is one megatron_fsdp bucket (one unit's parameters of one dtype and
  ``requires_grad``).
- :func:`make_fsdp_dtensor`: upstream's DTensor over a block of rows of a (tensor-parallel local)
  parameter, which megatron-core's checkpoint helpers build when they split fused weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.groups.distributed_index import FSDPDistributedIndex
from megatron_fsdp.engine.params.dtensor_params import (
    contiguous_strides,
    get_mcore_tensor_parallel_partition_dim,
    is_expert_param,
    using_tensor_parallel,
)
from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata, update_uneven_dtensor_chunk_metadata

__all__ = ["BufferView", "ParamAndGradBuffer", "ParameterGroup", "make_fsdp_dtensor", "to_local_if_dtensor"]


class BufferView:
    """One of a parameter group's buffers, as upstream names it: which parameters it holds and
    whether this rank holds only a shard of it (``is_data_distributed``)."""

    def __init__(self, params: list[nn.Parameter], is_data_distributed: bool) -> None:
        self.params = params
        self.is_data_distributed = is_data_distributed


class ParameterGroup:
    """Upstream's parameter group: one megatron_fsdp bucket.

    ``model_weight_buffer`` always exists (the compute weights; sharded under
    ``optim_grads_params``); ``main_weight_buffer`` exists where the main weights are a separate
    dtype, ``main_grad_buffer`` where the parameters train. ``params`` are the model's
    parameters (the compute weights), in the bucket's order."""

    def __init__(self, bucket: Bucket) -> None:
        self.params = list(bucket.params)
        self.dtype = bucket.dtype
        self.requires_grad = bucket.requires_grad
        self.is_expert_param = bool(self.params) and is_expert_param(self.params[0])
        strategy = bucket.strategy
        self.model_weight_buffer = BufferView(self.params, strategy.shards_weights)
        has_main_weights = bucket.requires_grad and bucket.dtypes.main_params != bucket.dtype
        self.main_weight_buffer = BufferView(self.params, strategy.shards_optimizer) if has_main_weights else None
        self.main_grad_buffer = BufferView(self.params, strategy.shards_grads) if bucket.requires_grad else None


class BufferOwner(Protocol):
    """What the face reads of the :class:`~megatron_fsdp.MegatronFSDP` that holds it (named so,
    not imported: the wrapper sits above this module)."""

    def all_buckets(self) -> list[Bucket]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def install_optimizer_step(self) -> None: ...

    def attach_grad_to_optimizer_state(self) -> None: ...

    def zero_grad_buffer(self) -> None: ...

    def scale_gradients(self, scaling_factor: float) -> None: ...


class ParamAndGradBuffer:
    """``model.param_and_grad_buffer`` of a :class:`~megatron_fsdp.MegatronFSDP` ``model``."""

    def __init__(self, model: BufferOwner) -> None:
        self._model = model
        self.parameter_groups = [ParameterGroup(bucket) for bucket in model.all_buckets()]

    @property
    def num_buckets(self) -> int:
        return len(self.parameter_groups)

    @property
    def optimizer_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, DTensor parameter) of every parameter: what optimizers step."""
        return list(self._model.named_parameters())

    def copy_main_weights_to_model_weights(self) -> None:
        """After an optimizer stepped the DTensor parameters: installs the main weights into the
        compute weights (gathering them under ``optim``/``optim_grads``) as megatron_fsdp's own
        optimizer step does."""
        self._model.install_optimizer_step()

    def update_main_grads(self) -> None:
        """Shows the reduced gradients as the DTensor parameters' ``.grad``."""
        self._model.attach_grad_to_optimizer_state()

    def zero_grad(self) -> None:
        """Releases the main gradients (the parameters' ``.grad`` become None)."""
        self._model.zero_grad_buffer()

    def scale_gradients(self, scaling_factor: float) -> None:
        self._model.scale_gradients(scaling_factor)

    def manual_buffer_registration(self) -> None:
        """Nothing to do: with ``nccl_ub``, megatron_fsdp registers its buffers with NCCL itself
        after the first optimizer step (megatron_fsdp/engine/buckets/user_buffers.py)."""


def to_local_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (no copy); any other tensor as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _fsdp_mesh_and_placements(
    dist_index: FSDPDistributedIndex, is_sharded_param: bool, is_expert_param: bool
) -> tuple[list[str], list[Placement]]:
    """The data-parallel mesh dims of a parameter and their placements, outer dim first."""
    shard = Shard(0) if is_sharded_param else Replicate()
    if dist_index.use_hybrid_fsdp and not is_expert_param:
        outer = Shard(0) if is_sharded_param and dist_index.hsdp_outer_dp_shard else Replicate()
        return [dist_index.dp_outer_dim, dist_index.dp_shard_dim], [outer, shard]
    return [dist_index.dp_shard_dim], [shard]


def make_fsdp_dtensor(
    local_tensor: torch.Tensor,
    param: torch.Tensor,
    dist_index: FSDPDistributedIndex,
    is_sharded_param: bool = True,
    is_expert_param: bool = False,
    run_check: bool = False,
    update_uneven_dtensor_chunk_meta: bool = False,
    force_sync_tp_duplicated_param: bool = False,
) -> DTensor:
    """A DTensor of ``param``'s global shape over ``local_tensor``, this rank's block of rows of
    the (tensor-parallel local) parameter, as upstream lays it out: ``Shard(0)`` over the
    data-parallel dims (``Replicate()`` when ``is_sharded_param=False``; HSDP: the outer dim too
    under HFSDP), then for a Megatron-Core tensor-parallel parameter ``Shard(partition_dim)``
    (split) or ``Replicate()`` (duplicated) over ``dist_index.tp_dim``.

    ``param`` is only a template (shape and Megatron-Core's tensor-parallel marks; a meta tensor
    will do). ``run_check``: check that the blocks fit the global shape (a collective).
    ``update_uneven_dtensor_chunk_meta``: prepare the DTensor for DCP (a collective).
    ``force_sync_tp_duplicated_param``: copy tensor-parallel rank 0's block of a duplicated
    parameter to the other tensor-parallel ranks.
    """
    if isinstance(param, DTensor):
        raise NotImplementedError(
            "make_fsdp_dtensor() with a DTensor template: megatron_fsdp builds the DTensors of DTensor (tensor- or "
            "expert-parallel) parameters itself; pass a plain template with Megatron-Core's tensor-parallel marks"
        )
    if not is_sharded_param and param.numel() != local_tensor.numel():
        raise ValueError(
            f"an unsharded parameter of shape {tuple(param.shape)} needs its whole local tensor, got "
            f"{local_tensor.numel()} elements"
        )
    dims, placements = _fsdp_mesh_and_placements(dist_index, is_sharded_param, is_expert_param)
    global_shape = list(param.shape)
    if using_tensor_parallel(dist_index, is_expert_parallel=is_expert_param):
        tp_mesh = dist_index.get_submesh(dist_index.tp_dim, is_expert_parallel=is_expert_param)
        partition_dim = get_mcore_tensor_parallel_partition_dim(param)
        if partition_dim is None:
            placements.append(Replicate())
            if force_sync_tp_duplicated_param and local_tensor.numel():
                torch.distributed.broadcast(local_tensor, group=tp_mesh.get_group(), group_src=0)
        else:
            placements.append(Shard(partition_dim))
            global_shape[partition_dim] *= tp_mesh.size()
        dims.append(dist_index.tp_dim)
    mesh = dist_index.get_submesh(dims, is_expert_parallel=is_expert_param)
    local_shape = (-1, *param.shape[1:]) if param.dim() > 1 else (-1,)
    shape = torch.Size(global_shape)
    dtensor = DTensor.from_local(
        local_tensor.view(local_shape), mesh, placements, run_check=False, shape=shape, stride=contiguous_strides(shape)
    )
    if run_check:
        gather_and_compute_chunk_metadata(dtensor)  # raises when the blocks overrun the shape
    if update_uneven_dtensor_chunk_meta:
        update_uneven_dtensor_chunk_metadata(dtensor)
    return dtensor
