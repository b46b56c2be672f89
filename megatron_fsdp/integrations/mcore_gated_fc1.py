"""Megatron-LM's ``fsdp_dtensor`` layout of a gated ``linear_fc1`` (``--swiglu``), written from
megatron_fsdp's own pieces.

With ``--swiglu`` Megatron-LM stores each gated ``linear_fc1`` weight (and bias, and their
optimizer state) as two tensors, ``<key>_w`` (the gate) and ``<key>_v`` (the up projection), each
of the global shape with half the rows, so that a checkpoint reshards across tensor-parallel
sizes. megatron-core 0.19's own splitter (``handle_swiglu_in_state_dict``) cannot serve a model on
megatron_fsdp, nor on its bundled copy: it looks each parameter up under one ``module.`` more than
the key it splits carries (``AttributeError: GPTModel has no attribute module`` at the first save),
and it reshapes a rank's piece into rows, which a piece starting inside a row is not.
:func:`split_gated_linear_fc1` takes its place (library_replacements.py, when ``install()``'s hook loads it):

- a megatron_fsdp flat piece (a range of the flattened tensor-parallel-local weight) splits into
  its part before the middle and its part after, each a flat piece of its half (views, no copy),
  so a rank's piece may start and end anywhere, and ``dcp.load`` fills the weight in place;
- a strided tensor-parallel split (each rank's local rows its block of the gate, then its block of
  the up projection) gives each half this rank's block at row ``tp_rank * rows``, as
  megatron-core's DDP writes it;
- a tensor every rank holds whole splits at its local middle row.

Which keys: the ``linear_fc1`` weights and biases of dense MLPs, shared experts and both kinds of
expert layer (``linear_fc1.weight<i>``, ``local_experts.<i>.linear_fc1.weight``), in layers whose
MLP's config has ``gated_linear_unit`` (a model mixing gated and plain MLPs keeps the plain ones
fused, as megatron-core does).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp.engine.params.dtensor_params import contiguous_strides
from megatron_fsdp.engine.params.piece_dtensor import FlatLayout, piece_dtensor

#: A gated linear_fc1 key; group 1 is the path of its MLP.
GATED_FC1_KEY = re.compile(
    r"^(.*\.mlp)\.(?:experts\.local_experts\.\d+\.|experts\.|shared_experts\.)?linear_fc1\.(?:weight|bias)\d*$"
)
HALVES = ("_w", "_v")


def split_gated_linear_fc1(
    model: nn.Module, model_state_dict: dict[str, Any], optimizer_state_dict: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """megatron-core's ``handle_swiglu_in_state_dict(model, model_state_dict, optimizer_state_dict)``:
    new dicts in which every gated ``linear_fc1`` entry is replaced by its ``_w`` and ``_v`` halves
    (the optimizer state's tensors split alike, its scalars copied to both). ``model``: the
    wrapped model the keys name (any chain of ``.module`` wrappers)."""
    innermost = _innermost(model)
    model_state_dict = _split_entries(model_state_dict, innermost, gated_halves)
    if optimizer_state_dict is not None:
        optimizer_state_dict = {**optimizer_state_dict, "state": _split_entries(optimizer_state_dict["state"], innermost, _state_halves)}
    return model_state_dict, optimizer_state_dict


def _split_entries(entries: dict[str, Any], innermost: nn.Module, halves: Any) -> dict[str, Any]:
    result = {}
    for key, value in entries.items():
        if not isinstance(key, str) or not _is_gated(key, innermost):
            result[key] = value
            continue
        for suffix, half in zip(HALVES, halves(value, key)):
            result[key + suffix] = half
    return result


def _state_halves(state: dict[str, Any], key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One parameter's optimizer state for each half: its tensors of one dim or more split, the
    rest (the step count) shared."""
    first, second = {}, {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            first[name], second[name] = gated_halves(value, f"{key} {name}")
        else:
            first[name] = second[name] = value
    return first, second


def _innermost(model: nn.Module) -> nn.Module:
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _is_gated(key: str, innermost: nn.Module) -> bool:
    match = GATED_FC1_KEY.match(key)
    if match is None:
        return False
    # Keys carry one "module." per wrapper; the model's own names never start with it.
    path = match.group(1)
    while path.startswith("module."):
        path = path[len("module.") :]
    try:
        mlp = innermost.get_submodule(path)
    except AttributeError:
        mlp = innermost
    config = getattr(mlp, "config", None) or getattr(innermost, "config", None)
    return bool(getattr(config, "gated_linear_unit", True))


def gated_halves(value: torch.Tensor, key: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a gated ``linear_fc1`` tensor (a megatron_fsdp flat piece, a
    DTensor every rank holds whole, or a plain tensor), each over ``value``'s memory."""
    rows = value.shape[0]
    if rows % 2:
        raise ValueError(f"{key}: a gated linear_fc1 has an even number of rows (gate, then up), got shape {tuple(value.shape)}")
    if not isinstance(value, DTensor):
        return value[: rows // 2], value[rows // 2 :]
    shape = torch.Size((rows // 2, *value.shape[1:]))
    layout = getattr(value, "_flat_layout", None)
    if layout is not None:
        return _flat_piece_halves(value, layout, shape, key)
    local = value._local_tensor.detach().reshape(-1)
    middle = local.numel() // 2
    return tuple(
        DTensor.from_local(
            part.view(-1, *value.shape[1:]), value.device_mesh, value.placements, run_check=False,
            shape=shape, stride=contiguous_strides(shape),
        )
        for part in (local[:middle], local[middle:])
    )


def _flat_piece_halves(value: DTensor, layout: FlatLayout, shape: torch.Size, key: str) -> tuple[DTensor, DTensor]:
    local_rows = layout.local_shape[0]
    if local_rows % 2:
        raise ValueError(f"{key}: its tensor-parallel block has {local_rows} rows, which do not halve into gate and up")
    if layout.row_blocks and len(layout.row_blocks) != 2:
        raise ValueError(
            f"{key}: a gated linear_fc1 is split over tensor-parallel ranks with partition_stride 2 (gate, up), "
            f"this one in {len(layout.row_blocks)} row blocks"
        )
    # This rank's block of each half: where a strided split put its gate rows, or (a plain
    # split's rows [r * 2n, (r + 1) * 2n)) half the block's row.
    row = layout.row_blocks[0] if layout.row_blocks else layout.offset[0] // 2
    half_shape = (local_rows // 2, *layout.local_shape[1:])
    middle = torch.Size(half_shape).numel()
    gate_pieces = tuple((min(start, middle), max(0, min(start + length, middle) - start)) for start, length in layout.pieces)
    up_pieces = tuple((max(start, middle) - middle, max(0, start + length - max(start, middle))) for start, length in layout.pieces)
    start, length = layout.mine(value.device_mesh)
    local = value._local_tensor.detach().reshape(-1)
    in_gate = min(length, max(0, middle - start))
    halves = []
    for part, pieces in ((local[:in_gate], gate_pieces), (local[in_gate:], up_pieces)):
        half_layout = FlatLayout(half_shape, (row, *layout.offset[1:]), pieces, layout.dp_dims)
        halves.append(piece_dtensor(part, value.device_mesh, tuple(value.placements), shape, half_layout))
    return halves[0], halves[1]
