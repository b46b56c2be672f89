"""State dicts for torch.distributed.checkpoint (DCP).

``model.state_dict()`` maps each parameter's original FQN to its DTensor face (sharded_params.py):
the parameter's global shape over this rank's piece of it (a view into the main parameters, or
the weights where no main parameters exist). A sharded piece is a flat range, which a
:class:`~megatron_fsdp.piece_dtensor.PieceDTensor` describes to DCP as the rectangles it
covers and gathers correctly for ``full_tensor()``. DCP then saves, loads in place and reshards
across world sizes and strategies; the files hold plain tensors of the original shapes.
Optimizer state follows the same scheme, keyed by parameter FQN.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp.buffer import Bucket
from megatron_fsdp.dtensor_params import ParamExtent, is_expert_param
from megatron_fsdp.mesh import DataParallelGroup
from megatron_fsdp.sharded_params import ShardSpec, sharded_dtensor
from megatron_fsdp.units import FSDPUnit


class ShardedModel(Protocol):
    """What state dicts read of a sharded model (a MegatronFSDP, which calls into this module:
    the dependency runs one way)."""

    module: nn.Module
    units: list[FSDPUnit]
    dp: DataParallelGroup


def _param_names(model: ShardedModel) -> dict[nn.Parameter, list[str]]:
    """Every name of every parameter, tied aliases included, in state-dict order."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, param in model.module.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    return names


def _bucket_params(model: ShardedModel) -> Iterator[tuple[Bucket, int, nn.Parameter, tuple[torch.Tensor, int]]]:
    """(bucket, index in bucket, parameter, (its checkpoint piece, where the piece starts))."""
    for unit in model.units:
        for bucket in unit.buckets:
            for index, (param, piece) in enumerate(zip(bucket.params, bucket.checkpoint_pieces())):
                yield bucket, index, param, piece


def _checkpointable_extent(bucket: Bucket, index: int) -> ParamExtent:
    if is_expert_param(bucket.params[index]) and not bucket.extents[index].is_distributed:
        raise RuntimeError(
            f"expert parameter {bucket.names[index]} is a plain tensor, so where its experts sit among all "
            "experts is unknown and ranks would overwrite each other's: make it a DTensor sharded over the "
            "expert-parallel mesh (e.g. Shard(0) over the expert dim)"
        )
    return bucket.extents[index]


def model_state_dict(model: ShardedModel) -> dict[str, Any]:
    """FQN -> DTensor for every parameter (tied ones under each name) over its face's piece (the
    same storage: ``dcp.load`` fills it in place), plus persistent buffers."""
    pieces = {}
    for bucket, index, param, _ in _bucket_params(model):
        _checkpointable_extent(bucket, index)
        pieces[param] = bucket.faces[index].state()
    return {
        key: pieces[value] if isinstance(value, nn.Parameter) else value
        for key, value in model.module.state_dict(keep_vars=True).items()
    }


def load_model_state_dict(model: ShardedModel, state_dict: dict[str, Any], strict: bool = True) -> None:
    """Loads a state dict from :func:`model_state_dict` (after ``dcp.load`` filled it in place)
    or any dict of full tensors (a plain model's ``state_dict()``), then re-installs weights."""
    expected = model.module.state_dict(keep_vars=True)
    pieces = {
        param: (bucket.extents[index], bucket.faces[index].spec, piece) for bucket, index, param, piece in _bucket_params(model)
    }
    names = _param_names(model)
    shapes = {key: (pieces[v][0].global_shape if v in pieces else v.shape) for key, v in expected.items()}
    given = {k: (v.shape if isinstance(v, torch.Tensor) else None) for k, v in state_dict.items()}
    check_keys(shapes, given, strict, "model state dict")
    with torch.no_grad():
        for param, (extent, spec, (piece, start)) in pieces.items():
            key = next((n for n in names[param] if n in state_dict), None)
            if key is not None:
                local = _local_piece(state_dict[key], piece, start, extent, spec)
                if local.data_ptr() != piece.data_ptr():  # else dcp.load wrote straight into the piece
                    piece.copy_(local)
        for key, value in expected.items():
            if not isinstance(value, nn.Parameter) and key in state_dict and state_dict[key] is not value:
                value.copy_(state_dict[key])
        for unit in model.units:
            for bucket in unit.buckets:
                bucket.sync_after_load()


def _holds_this_piece(value: DTensor, spec: ShardSpec) -> bool:
    """Whether ``value``'s local tensor is this rank's piece as ``spec`` places it (our own state
    dict, filled by ``dcp.load``, or a copy of it). Decided from metadata alone, so every rank
    decides alike and either none gathers the full tensor or all do."""
    return (
        value.device_mesh == spec.mesh
        and tuple(value.placements) == spec.placements
        and value.shape == spec.global_shape
        and getattr(value, "_flat_layout", None) == spec.layout
    )


def check_keys(expected: dict[str, torch.Size], given: dict[str, torch.Size | None], strict: bool, what: str) -> None:
    """Raises naming every missing, unexpected and mis-shaped key (only mis-shaped ones when
    not ``strict``); ``None`` stands for an entry that is not a tensor."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    mis_shaped = [
        f"{k} (given {tuple(given[k])}, model {tuple(shape)})"
        for k, shape in expected.items()
        if given.get(k) is not None and shape is not None and tuple(given[k]) != tuple(shape)
    ]
    problems = []
    if mis_shaped:
        problems.append("mis-shaped: " + ", ".join(mis_shaped))
    if strict and missing:
        problems.append("missing: " + ", ".join(missing))
    if strict and unexpected:
        problems.append("unexpected: " + ", ".join(unexpected))
    if problems:
        raise RuntimeError(f"the {what} does not fit this model; " + "; ".join(problems))


def _optimizer_param_names(model: ShardedModel) -> dict[int, tuple[str, Bucket, int, int]]:
    """id(main-parameter piece) -> (parameter FQN, bucket, index in bucket, where its piece
    starts in the flattened parameter)."""
    names = _param_names(model)
    return {
        id(bucket.optim_params[index]): (names[param][0], bucket, index, start)
        for bucket, index, param, (_, start) in _bucket_params(model)
        if bucket.requires_grad
    }


def _init_optimizer_state(optimizer: torch.optim.Optimizer, step: Any) -> None:
    """Creates the state of a fresh optimizer (so DCP has tensors to load into) with one step
    of zero gradients at zero learning rate, as torch's own distributed state-dict code does."""
    if optimizer.state:
        return
    saved = []
    for group in optimizer.param_groups:
        saved.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    step()
    for group, lr in zip(optimizer.param_groups, saved):
        if lr is not None:
            group["lr"] = lr
        for param in group["params"]:
            param.grad = None


def optimizer_state_dict(optimizer: torch.optim.Optimizer, model: ShardedModel, unwrapped_step: Any) -> dict[str, Any]:
    """``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}`` with
    every per-element state tensor as a DTensor piece like the parameter's."""
    _init_optimizer_state(optimizer, unwrapped_step)
    owners = _optimizer_param_names(model)
    state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for piece in group["params"]:
            fqn, bucket, index, _ = owners[id(piece)]  # the optimizer steps exactly this piece
            spec = bucket.faces[index].spec
            entries = {}
            for name, value in optimizer.state.get(piece, {}).items():
                per_element = isinstance(value, torch.Tensor) and value.shape == piece.shape
                entries[name] = sharded_dtensor(value, spec) if per_element else value
            state[fqn] = entries
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [owners[id(p)][0] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(
    optimizer: torch.optim.Optimizer, model: ShardedModel, state_dict: dict[str, Any], unwrapped_load: Any
) -> None:
    """Loads a state dict of :func:`optimizer_state_dict` form (after ``dcp.load`` filled it in
    place) through the optimizer's own ``load_state_dict``."""
    owners = _optimizer_param_names(model)
    pieces = [piece for group in optimizer.param_groups for piece in group["params"]]
    fqns = [owners[id(piece)][0] for piece in pieces]
    saved = state_dict["state"]
    missing = [fqn for fqn in fqns if fqn not in saved]
    unexpected = [fqn for fqn in saved if fqn not in set(fqns)]
    if missing or unexpected:
        raise RuntimeError(
            "the optimizer state dict does not fit this model; "
            f"missing: {', '.join(missing) or '-'}; unexpected: {', '.join(unexpected) or '-'}"
        )
    torch_state = {}
    for position, (piece, fqn) in enumerate(zip(pieces, fqns)):
        _, bucket, index, start = owners[id(piece)]
        extent, spec = bucket.extents[index], bucket.faces[index].spec
        torch_state[position] = {
            name: _local_piece(value, piece, start, extent, spec) for name, value in saved[fqn].items()
        }
    groups, position = [], 0
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        count = len(group["params"])
        groups.append({**saved_group, "params": list(range(position, position + count))})
        position += count
    unwrapped_load({"state": torch_state, "param_groups": groups})


def _local_piece(value: Any, piece: torch.Tensor, start: int, extent: ParamExtent, spec: ShardSpec) -> Any:
    """This rank's piece of a parameter or a per-element state entry: from a DTensor holding it
    (no communication), else from the full tensor (a DTensor of another layout is gathered, on
    every rank); other entries (a step count) as they are."""
    if isinstance(value, DTensor):
        with torch.no_grad():
            if _holds_this_piece(value, spec):
                return value.to_local().reshape(piece.shape)
            value = value.full_tensor()
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return extent.local_region(value).reshape(-1)[start : start + piece.numel()]
    return value
