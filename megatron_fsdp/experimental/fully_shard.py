"""Upstream's v2 ``fully_shard`` and its context, translated into
:func:`megatron_fsdp.fsdp2.api.shard_in_place`.

- ``fully_shard_context(device=None, *, use_symmetric_memory=False, unify_communication_stream=False)``:
  the modules sharded inside share one step (here every module sharded in place under a root
  does anyway); ``fully_shard`` outside one raises, as upstream's. Any device (upstream: CUDA
  only); the two keywords tune upstream's streams and buffers and are accepted.
- ``fully_shard(module, mesh, placements, mixed_precision_policy=None, grad_divisor=1)``: shards
  ``module`` in place (returns None, as upstream's). ``placements`` must shard parameters,
  gradients and optimizer state (upstream's ``Flat()``, or DTensor's ``Shard(0)``) over the one
  dim of a 1-D mesh: the ``optim_grads_params`` strategy. ``mixed_precision_policy`` is
  megatron_fsdp's (upstream's fields): the model's dtype computes, main weights in
  ``main_params_dtype`` (default fp32).
  ``grad_divisor`` divides the reduced gradients on top of the average over the mesh.
- ``microbatch(context, is_last)``: upstream needs it for HSDP accumulation only; over a 1-D mesh
  every backward finishes its gradients, here as there.
- ``fully_shard_optimizer(optimizer, *, precision_aware=False)``: nothing to attach here: the
  DTensor parameters' ``.grad`` already have their dtype, and the next gather reads the stepped
  main weights. It checks that the optimizer steps DTensor parameters (built after sharding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from megatron_fsdp.experimental.placement import Flat
from megatron_fsdp.fsdp2.api import check_module, shard_in_place
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy

MeshAxis = int | str


@dataclass(frozen=True)
class Placements:
    """Upstream's per-data-parallel-axis placements: ``dp_axes`` names the mesh's data-parallel
    dims; ``parameter``, ``gradient`` and ``optimizer`` give one placement per axis (upstream's
    ``Flat()``, or DTensor's ``Shard(0)``, the same here)."""

    dp_axes: Sequence[MeshAxis]
    parameter: Sequence[Placement]
    gradient: Sequence[Placement]
    optimizer: Sequence[Placement]

    def __post_init__(self) -> None:
        for name in ("parameter", "gradient", "optimizer"):
            if len(getattr(self, name)) != len(self.dp_axes):
                raise ValueError(f"Expected {len(self.dp_axes)} {name} placements, got {len(getattr(self, name))}.")


@dataclass
class FullyShardContext:
    """What ``fully_shard_context`` yields: the device and the modules sharded inside it."""

    device: torch.device
    modules: list[nn.Module] = field(default_factory=list)
    is_last_microbatch: bool = True


_CURRENT: list[FullyShardContext] = []


@contextlib.contextmanager
def fully_shard_context(
    device: torch.device | None = None, *, use_symmetric_memory: bool = False, unify_communication_stream: bool = False
) -> Iterator[FullyShardContext]:
    """See the module docstring."""
    if _CURRENT:
        raise RuntimeError("fully_shard_context does not support nesting.")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    _CURRENT.append(FullyShardContext(torch.device(device)))
    try:
        yield _CURRENT[0]
    finally:
        _CURRENT.clear()


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    grad_divisor: int = 1,
) -> None:
    """See the module docstring."""
    if not _CURRENT:
        raise RuntimeError("fully_shard must run inside fully_shard_context.")
    check_module(module)
    _check_placements(mesh, placements)
    if mixed_precision_policy is not None and not isinstance(mixed_precision_policy, MixedPrecisionPolicy):
        raise TypeError(f"mixed_precision_policy must be a megatron_fsdp.MixedPrecisionPolicy, got {mixed_precision_policy!r}")
    if isinstance(grad_divisor, bool) or not isinstance(grad_divisor, (int, float)) or not grad_divisor > 0:
        raise ValueError(f"grad_divisor must be a number > 0, got {grad_divisor!r}")
    shard_in_place(
        [module], mesh, engine_policy=mixed_precision_policy or MixedPrecisionPolicy(), grad_divisor=float(grad_divisor)
    )
    _CURRENT[0].modules.append(module)


def _check_placements(mesh: DeviceMesh, placements: Placements) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    if not isinstance(placements, Placements):
        raise TypeError(f"placements must be megatron_fsdp.experimental.Placements, got {type(placements).__name__}")
    if mesh.ndim != 1 or len(placements.dp_axes) != 1:
        raise NotImplementedError(
            f"a {mesh.ndim}-D mesh with dp_axes {tuple(placements.dp_axes)} (HSDP) is not supported by "
            "megatron_fsdp.experimental yet: use one data-parallel axis, the whole of a 1-D mesh"
        )
    (axis,) = placements.dp_axes
    if axis not in (0, -1) and axis not in (mesh.mesh_dim_names or ()):
        raise ValueError(f"Mesh axis {axis!r} is not present in mesh dim names {mesh.mesh_dim_names}.")
    given = {"parameter": placements.parameter, "gradient": placements.gradient, "optimizer": placements.optimizer}
    unsupported = {name: tuple(value) for name, value in given.items() if tuple(value) not in ((Shard(0),), (Flat(),))}
    if unsupported:
        raise NotImplementedError(
            f"placements {unsupported}: megatron_fsdp.experimental shards parameters, gradients and optimizer state "
            "alike (Flat() or Shard(0) for each); for replicated parameters or gradients use "
            "fully_shard_model(..., zero_dp_strategy='optim_grads' or 'optim')"
        )


@contextlib.contextmanager
def microbatch(context: FullyShardContext, is_last: bool) -> Iterator[None]:
    """See the module docstring."""
    previous, context.is_last_microbatch = context.is_last_microbatch, is_last
    try:
        yield
    finally:
        context.is_last_microbatch = previous


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, *, precision_aware: bool = False) -> None:
    """See the module docstring: raises unless every parameter the optimizer steps is a DTensor
    (a piece sharded in place)."""
    plain = [p for group in optimizer.param_groups for p in group["params"] if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(
            f"fully_shard_optimizer: {len(plain)} of the optimizer's parameters are plain tensors, not sharded by "
            "megatron_fsdp.experimental.fully_shard: build the optimizer after sharding, over model.parameters()"
        )
