"""State dicts for torch.distributed.checkpoint (DCP).

``model.state_dict()`` maps each parameter's original FQN to its DTensor face (sharded_params.py):
the parameter's global shape over this rank's piece of it (a view into the main parameters, or
the weights where no main parameters exist). A sharded piece is a flat range, which a
:class:`~megatron_fsdp.engine.params.piece_dtensor.PieceDTensor` describes to DCP as the rectangles it
covers and gathers correctly for ``full_tensor()``. DCP then saves, loads in place and reshards
across world sizes and strategies; the files hold plain tensors of the original shapes.
Optimizer state entries are DTensors of the same layouts (the optimizer holds the faces:
optimizer.py); checkpoint files key them by parameter FQN.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.buckets.faces import local_piece
from megatron_fsdp.engine.params.dtensor_params import ParamExtent, is_expert_param
from megatron_fsdp.engine.step.sharded_model import ShardedModel

# The key under which nn.Module stores what its get_extra_state() returns.
EXTRA_STATE = "_extra_state"


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


def _checkpointable_extent(model: ShardedModel, bucket: Bucket, index: int) -> ParamExtent:
    # A plain expert weight's extent may place it over the expert-tensor-parallel ranks, never
    # among the experts of other expert-parallel ranks: only a DTensor's mesh says where that is.
    param = bucket.params[index]
    plain_expert = is_expert_param(param) and not isinstance(param, DTensor)
    if plain_expert and not model.expert_keys_made_global:
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
        _checkpointable_extent(model, bucket, index)
        pieces[param] = bucket.faces[index].state()
    # An OrderedDict, as nn.Module.state_dict's: Accelerate's save_state checks such a dict's
    # storages on every rank, where the pieces refuse it (piece_dtensor.ShardedSaveError).
    return OrderedDict(
        (key, pieces[value] if isinstance(value, nn.Parameter) else value)
        for key, value in model.module.state_dict(keep_vars=True).items()
    )


def load_model_state_dict(model: ShardedModel, state_dict: dict[str, Any], strict: bool = True) -> None:
    """Loads a state dict from :func:`model_state_dict` (after ``dcp.load`` filled it in place)
    or any dict of full tensors (a plain model's ``state_dict()``), then re-installs weights."""
    expected = model.module.state_dict(keep_vars=True)
    pieces = {
        param: (bucket.extents[index], bucket.faces[index].spec, piece) for bucket, index, param, piece in _bucket_params(model)
    }
    names = _param_names(model)
    shapes = {
        key: pieces[v][0].global_shape if isinstance(v, nn.Parameter) and v in pieces else getattr(v, "shape", None)
        for key, v in expected.items()
    }
    given = {k: (v.shape if isinstance(v, torch.Tensor) else None) for k, v in state_dict.items()}
    check_keys(shapes, given, strict, "model state dict")
    with torch.no_grad():
        for param, (extent, spec, (piece, start)) in pieces.items():
            key = next((n for n in names[param] if n in state_dict), None)
            if key is not None:
                local = local_piece(state_dict[key], piece, start, extent, spec)
                if local.data_ptr() != piece.data_ptr():  # else dcp.load wrote straight into the piece
                    piece.copy_(local)
        for key, value in expected.items():
            if isinstance(value, nn.Parameter) or key not in state_dict or state_dict[key] is value:
                continue
            if key == EXTRA_STATE or key.endswith("." + EXTRA_STATE):
                owner = key[: -len(EXTRA_STATE)].rstrip(".")
                model.module.get_submodule(owner).set_extra_state(state_dict[key])
            else:
                value.copy_(state_dict[key])
        for unit in model.units:
            for bucket in unit.buckets:
                bucket.sync_after_load()


def incompatible_keys(model: ShardedModel, state_dict: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The keys ``state_dict`` lacks and those the model does not know, as a plain module's
    ``load_state_dict`` reports them (a tied weight's other name counts as missing, as there)."""
    expected = model.module.state_dict(keep_vars=True)
    return [key for key in expected if key not in state_dict], [key for key in state_dict if key not in expected]


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


def fqn_keyed_optimizer_state_dict(
    state_dict: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter FQN instead of position, as
    ``get_optimizer_state_dict`` returns it: checkpoint files then name what they hold.
    ``optimizer.load_state_dict`` takes either form (torch matches them by position)."""
    names = {face: fqn for fqn, face in model.named_parameters()}
    fqns = [names[face] for group in optimizer.param_groups for face in group["params"]]
    positions = [key for group in state_dict["param_groups"] for key in group["params"]]
    to_fqn = dict(zip(positions, fqns))
    return {
        "state": {to_fqn[key]: value for key, value in state_dict["state"].items()},
        "param_groups": [{**group, "params": [to_fqn[key] for key in group["params"]]} for group in state_dict["param_groups"]],
    }
