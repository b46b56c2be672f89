"""How the simulated rank's model is sharded: through megatron_fsdp's whole-model door
(``fully_shard(model, optimizer, fsdp_unit_modules=...)``) or its FSDP2 door
(``megatron_fsdp.fsdp2.fully_shard`` on every unit, then the root).

Torch's own FSDP2 is not a door here: it frees a gathered parameter by resizing its storage to
nothing, which the allocation log (memory.py: storages made and destroyed) does not see. It is
simulated beside ours by torch_fsdp2.py, its memory read by torch's FSDPMemTracker.

The FSDP2 door is called as torchtitan calls FSDP2: the parameters in float32 (they are what
the optimizer steps) and ``MixedPrecisionPolicy(param_dtype=<the model's dtype>,
reduce_dtype=float32)``; HSDP is a 2-D (dp_outer, dp_shard) mesh. Context-parallel ranks join
the shard group (dp_shard and cp flattened into ``dp_cp``) through either door. Pipeline
parallelism shards each stage module through the FSDP2 door (pipeline.py), as plan_memory
plans it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from megatron_fsdp.engine.step.units import FSDPUnit
from megatron_fsdp.fsdp2 import fully_shard as fsdp2_fully_shard
from megatron_fsdp.fsdp2.state import shared_resources, state_of
from megatron_fsdp.fully_shard import fully_shard
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.simulate.world import MeshSizes

DOORS = ("whole_model", "fsdp2")

TP_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}

# plan_memory's optimizer names this simulator can build (torch's own classes, defaults as torch's).
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-4),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-4, momentum=0.9),
}


@dataclass
class ShardedRank:
    """``model``: what forward is called on; ``module``: the user's model under it; ``units``:
    the engine's units; ``pool``: the engine's bucket pool."""

    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    units: list[FSDPUnit]
    pool: Any


def planned_as(door: str, policy: MixedPrecisionPolicy | None) -> tuple[bool, MixedPrecisionPolicy | None]:
    """What plan_memory is given for a rank sharded through ``door``: whether to plan the model
    in float32, and the precision policy. The whole-model door as called; the FSDP2 door as this
    simulator calls it (module docstring): float32 parameters are the main weights the optimizer
    steps, gradients kept and reduced in float32."""
    if door == "whole_model":
        return False, policy
    return True, MixedPrecisionPolicy(main_params_dtype=None, main_grads_dtype=torch.float32, grad_comm_dtype=torch.float32)


def check_door(door: str, mesh: MeshSizes, zero_dp_strategy: str, outer_dp_sharding_strategy: str) -> None:
    if door not in DOORS:
        raise ValueError(f"door {door!r}: use one of {', '.join(DOORS)}")
    if mesh.pp > 1 and door != "fsdp2":
        raise ValueError(
            f"pp={mesh.pp}: pipeline parallelism runs torch's schedules over stage modules sharded by FSDP2's door, as "
            "plan_memory plans it: pass door='fsdp2' (--door fsdp2)"
        )
    if door == "fsdp2" and mesh.ep > 1:
        raise ValueError("the fsdp2 door takes no expert mesh: simulate expert parallelism through the whole_model door")
    if door == "fsdp2" and (zero_dp_strategy != "optim_grads_params" or outer_dp_sharding_strategy != "no_shard"):
        raise ValueError(
            "the fsdp2 door shards as FSDP2 does (optim_grads_params; HSDP replicas with no_shard): "
            "use the whole_model door for other strategies"
        )


def apply_tensor_parallel(module: nn.Module, device_mesh: DeviceMesh, mesh: MeshSizes,
                          tensor_parallel_plan: dict[str, str] | None) -> None:
    """``tensor_parallel_plan`` ({module pattern: 'colwise' | 'rowwise'}) applied over the tp dim."""
    if mesh.tp > 1:
        styles = {pattern: TP_STYLES[style]() for pattern, style in tensor_parallel_plan.items()}
        parallelize_module(module, device_mesh["tp"], styles)


def fsdp2_mesh(device_mesh: DeviceMesh, mesh: MeshSizes) -> DeviceMesh:
    """What the FSDP2 door shards over: the shard dim, under HSDP with the replicas before it."""
    return device_mesh["dp_outer", mesh.shard_dim] if mesh.dp_outer > 1 else device_mesh[mesh.shard_dim]


def fsdp2_shard(module: nn.Module, fsdp_mesh: DeviceMesh, fsdp_unit_modules: Sequence[type], compute_dtype: torch.dtype,
                reshard_after_forward: bool | None = None) -> list[FSDPUnit]:
    """``megatron_fsdp.fsdp2.fully_shard`` on every unit of ``module``, then on ``module``, as
    torchtitan calls FSDP2 (the module docstring); returns the units made."""
    policy = TorchMixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = [m for m in module.modules() if isinstance(m, tuple(fsdp_unit_modules))]
    for block in [*blocks, module]:
        fsdp2_fully_shard(block, mesh=fsdp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return [state.unit for m in [*blocks, module] if (state := state_of(m)) is not None]


def shard(door: str, module: nn.Module, device_mesh: DeviceMesh, mesh: MeshSizes, optimizer: str,
          fsdp_unit_modules: Sequence[type], compute_dtype: torch.dtype, expert_mesh: DeviceMesh | None = None,
          **shard_options) -> ShardedRank:
    """``module`` (fake tensors, tensor parallelism applied; float32 for the FSDP2 door, built
    in ``compute_dtype``) sharded through ``door``, with a torch ``optimizer`` over it;
    ``expert_mesh``: the whole-model door's ``expt_device_mesh``."""
    if door == "whole_model":
        names = dict(device_mesh=device_mesh, dp_shard_dim=mesh.shard_dim)
        if mesh.dp_outer > 1:
            names["dp_outer_dim"] = "dp_outer"
        if mesh.tp > 1:
            names["tp_dim"] = "tp"
        if expert_mesh is not None:
            names["expt_device_mesh"] = expert_mesh
        model, optim = fully_shard(module, OPTIMIZERS[optimizer](module.parameters()), fsdp_unit_modules=fsdp_unit_modules,
                                   **names, **shard_options)
        return ShardedRank(model, model.module, optim, model.units, model.pool)
    units = fsdp2_shard(module, fsdp2_mesh(device_mesh, mesh), fsdp_unit_modules, compute_dtype)
    optim = OPTIMIZERS[optimizer](module.parameters())
    return ShardedRank(module, module, optim, units, shared_resources().pool)
