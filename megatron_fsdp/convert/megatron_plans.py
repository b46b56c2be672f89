"""Plans between Megatron-LM GPT checkpoints and Hugging Face models, and between Megatron-LM's
two formats, from the table in ``megatron_gpt`` and the views of ``megatron_layouts``."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.gpt_dims import GptDims
from megatron_fsdp.convert.megatron_gpt import (
    FUSED_FC1,
    Slot,
    fuse_qkv,
    gpt_slots,
    megatron_name,
    split_fc1,
    split_qkv,
)
from megatron_fsdp.convert.megatron_layouts import (
    FSDP_DTENSOR,
    MAIN_PARAM,
    OPTIMIZER_STATE,
    STATE_KEYS,
    TORCH_DIST,
    MegatronView,
    module_norm_name,
    stacked_name,
    torch_dist_norm_name,
)
from megatron_fsdp.convert.plan import Plan, Read, Step, Write, expect_shape, refuse_unknown, require, same
from megatron_fsdp.convert.sources import TensorInfo

_UNKNOWN_FIX = (
    "The Megatron-LM -> Hugging Face table covers Llama-, Mistral-, Qwen2- and Mixtral-style GPTs; a tensor it "
    "does not know would be lost. If the checkpoint's args are not this model's, give --config"
)


def _present(view: MegatronView, slot: Slot) -> str:
    """Which of the slot's Megatron-LM names the checkpoint has (the first, for an error)."""
    for name in slot.megatron:
        if name in view.model or name + "_w" in view.model:
            return name
    return slot.megatron[0]


def _fc1_reads(view: MegatronView, name: str, slot: Slot) -> tuple[list[Read], list[str]]:
    """The reads of an fc1 (its ``_w`` / ``_v`` halves, or the whole) and the names they consume."""
    if name + "_w" in view.model:
        halves = [name + "_w", name + "_v"]
        require(view.model, halves, "the SwiGLU fc1")
        for half, shape in zip(halves, slot.hf_shapes):
            expect_shape(view.model[half].name, view.infos[half], shape, "the config's ffn_hidden_size and hidden_size")
        return [view.model[half] for half in halves], halves
    expect_shape(view.model[name].name, view.infos[name], slot.megatron_shape, "the config's 2 * ffn_hidden_size and hidden_size")
    return [view.model[name]], [name]


def _split_fc1_halves(blocks: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return tensors if len(tensors) == 2 else split_fc1(tensors[0], blocks)


def megatron_to_hf(view: MegatronView, dims: GptDims, dtype: torch.dtype | None) -> Plan:
    """Megatron-LM GPT (either format) -> Llama / Mistral / Qwen2 / Mixtral names and layouts."""
    plan = Plan()
    used: set[str] = set()
    for slot in gpt_slots(dims):
        name = _present(view, slot)
        if slot.kind == "fc1":
            reads, consumed = _fc1_reads(view, name, slot)
            build = functools.partial(_split_fc1_halves, view.fc1_blocks)
        else:
            require(view.model, [name], f"the {dims.family} model of these dimensions")
            expect_shape(view.model[name].name, view.infos[name], slot.megatron_shape, "the config")
            reads, consumed = [view.model[name]], [name]
            build = functools.partial(_split_qkv_of, dims) if slot.kind == "qkv" else same
        source_dtype = view.infos[consumed[0]].dtype
        plan.add(reads, [(hf, TensorInfo(shape, dtype or source_dtype)) for hf, shape in zip(slot.hf, slot.hf_shapes)], build)
        used.update(consumed)
    refuse_unknown([view.model[name].name for name in view.model if name not in used], "the Megatron-LM GPT table", _UNKNOWN_FIX)
    return plan


def _split_qkv_of(dims: GptDims, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return split_qkv(tensors[0], dims)


def _fuse_qkv_of(dims: GptDims, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [fuse_qkv(*tensors, dims)]


def _cat_halves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(tensors)]


def hf_to_megatron(
    hf_tensors: dict[str, TensorInfo], dims: GptDims, model_prefix: str, spec: str, experts: str, fc1_form: str, dtype: torch.dtype | None
) -> Plan:
    """Hugging Face names -> Megatron-LM's fsdp_dtensor names (``model_prefix`` + canonical), fc1
    as megatron-core's ``_w`` / ``_v`` halves (``split``, what megatron-core's loader asks for with
    --swiglu) or whole (``fused``)."""
    plan = Plan()
    used: set[str] = set()
    for slot in gpt_slots(dims):
        require(hf_tensors, list(slot.hf), f"the Megatron-LM {dims.family} table")
        for hf, shape in zip(slot.hf, slot.hf_shapes):
            expect_shape(hf, hf_tensors[hf], shape, "config.json")
        used.update(slot.hf)
        reads = [Read(hf) for hf in slot.hf]
        target = model_prefix + megatron_name(slot, spec, experts)
        info = TensorInfo(slot.megatron_shape, dtype or hf_tensors[slot.hf[0]].dtype)
        if slot.kind == "fc1" and fc1_form != FUSED_FC1:
            half = TensorInfo(slot.hf_shapes[0], info.dtype)
            plan.add(reads, [(target + "_w", half), (target + "_v", half)], same)
        elif slot.kind == "fc1":
            plan.add(reads, [(target, info)], _cat_halves)
        elif slot.kind == "qkv":
            plan.add(reads, [(target, info)], functools.partial(_fuse_qkv_of, dims))
        else:
            plan.add(reads, [(target, info)], same)
    if dims.tied:
        used.add("lm_head.weight")  # a tied head saved anyway is the embedding again
    refuse_unknown(
        [name for name in hf_tensors if name not in used],
        f"the Hugging Face -> Megatron-LM {dims.family} table",
        "Only Llama-, Mistral-, Qwen2- and Mixtral-style models map to Megatron-LM's GPT here",
    )
    return plan


@dataclass(frozen=True)
class MegatronTarget:
    """The Megatron-LM checkpoint to write: ``format`` (fsdp_dtensor or torch_dist), the model's
    layer count, its ``spec`` (te or local: fsdp_dtensor's norm names), fsdp_dtensor's prefixes,
    and torch_dist's model weights dtype (the run's params dtype; None: as the source's)."""

    format: str
    layers: int
    spec: str
    model_prefix: str
    optimizer_prefix: str
    weights_dtype: torch.dtype | None


def megatron_to_megatron(view: MegatronView, target: MegatronTarget, optimizer: bool) -> Plan:
    """fsdp_dtensor <-> torch_dist: every weight, renamed (torch_dist: layers and experts stacked,
    norms under Transformer Engine's names; fsdp_dtensor: the spec's module names, fc1 as ``_w`` /
    ``_v`` halves) and, with ``optimizer``, every ``exp_avg`` / ``exp_avg_sq`` (and torch_dist's
    ``fp32_param`` main weights). torch_dist keeps its model weights in the run's params dtype
    beside the fp32 main weights; fsdp_dtensor keeps the main weights as its weights."""
    plan = Plan()
    for canonical in _whole_parameters(view):
        kinds: list[str | None] = [None]
        if optimizer and view.optimizer:
            kinds += [key for key in STATE_KEYS if _reads_of(view, canonical, key) is not None]
            if target.format == TORCH_DIST:
                kinds.append(MAIN_PARAM)
        for kind in kinds:
            reads = _reads_of(view, canonical, kind)
            if reads is None:
                raise ConversionError(f"the checkpoint has optimizer state for some parameters but no {kind} for {canonical}: it is incomplete")
            _add_converted(plan, view, canonical, kind, reads, target)
    return plan


def _whole_parameters(view: MegatronView) -> list[str]:
    """The view's parameters, an fc1 saved as ``_w`` / ``_v`` halves under its whole name."""
    names = []
    for canonical in view.model:
        if canonical.endswith("_v") and canonical[:-2] + "_w" in view.model:
            continue
        names.append(canonical[:-2] if canonical.endswith("_w") and canonical[:-2] + "_v" in view.model else canonical)
    return names


def _reads_of(view: MegatronView, canonical: str, kind: str | None) -> list[Read] | None:
    """Where a parameter's weight (``kind`` None), main weight or optimizer state is read: two
    halves for an fc1 kept as ``_w`` / ``_v``. torch_dist's fp32 main weights, when it has them,
    stand for its weights (the bf16 copy is their rounding)."""
    names = [canonical + "_w", canonical + "_v"] if canonical not in view.model else [canonical]
    if kind is None and (MAIN_PARAM, names[0]) in view.optimizer:
        kind = MAIN_PARAM
    if kind is None or (kind == MAIN_PARAM and view.format == FSDP_DTENSOR):
        return [view.model[name] for name in names]
    found = [view.optimizer.get((kind, name)) for name in names]
    return None if None in found else found


def _add_converted(plan: Plan, view: MegatronView, canonical: str, kind: str | None, reads: list[Read], target: MegatronTarget) -> None:
    """The step writing ``canonical``'s weight (``kind`` None) or optimizer state ``kind``."""
    infos = [view.infos[name] for name in ([canonical] if canonical in view.model else [canonical + "_w", canonical + "_v"])]
    shape = (sum(info.shape[0] for info in infos), *infos[0].shape[1:]) if len(infos) == 2 else infos[0].shape
    is_fc1 = canonical.endswith("linear_fc1.weight") or re.search(r"linear_fc1\.weight\d+$", canonical) is not None
    if kind is None and view.format == TORCH_DIST and (MAIN_PARAM, canonical) in view.optimizer:
        reads = [*reads, view.model[canonical]]
        build = functools.partial(_checked_main_weights, view.model[canonical].name)
    elif len(reads) == 2:
        build = _cat_halves
    elif is_fc1 and view.fc1_blocks > 1:
        build = functools.partial(_rejoin_fc1, view.fc1_blocks)
    else:
        build = same
    if target.format == FSDP_DTENSOR:
        main_weights = (MAIN_PARAM, canonical) in view.optimizer
        dtype = torch.float32 if kind is not None or main_weights else infos[0].dtype
        name = module_norm_name(canonical, target.spec)
        names = [f"{name}_w", f"{name}_v"] if is_fc1 else [name]
        full = [target.model_prefix + n if kind is None else f"{target.optimizer_prefix}{n}.{kind}" for n in names]
        if is_fc1:
            half = TensorInfo((shape[0] // 2, *shape[1:]), dtype)
            plan.add(reads, [(full[0], half), (full[1], half)], functools.partial(_halves_of, build))
        else:
            plan.add(reads, [(full[0], TensorInfo(shape, dtype))], build)
        return
    dtype = torch.float32 if kind is not None else (target.weights_dtype or infos[0].dtype)
    stacked, index = stacked_name(torch_dist_norm_name(canonical, target.spec))
    name = stacked if kind is None else f"{OPTIMIZER_STATE}{kind}.{stacked}"
    if not index:
        plan.add(reads, [(name, TensorInfo(shape, dtype))], build)
        return
    experts = 1 + max((stacked_name(other)[1] + (0, 0))[1] for other in view.model)
    plan.targets[name] = TensorInfo((target.layers, *([experts] if len(index) == 2 else []), *shape), dtype)
    box = (*([1] * len(index)), *shape)
    plan.steps.append(Step(tuple(reads), (Write(name, box, (*index, *([0] * len(shape)))),), functools.partial(_boxed, build, box)))


def _checked_main_weights(name: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 main weights, once they are checked to round to the model's weights ``name``:
    what proves the optimizer state was found where the model's parameters are."""
    main, weights = tensors
    if not torch.equal(main.to(weights.dtype), weights):
        raise ConversionError(
            f"the optimizer's main weights for {name} are not {name} (max difference "
            f"{(main.to(weights.dtype).float() - weights.float()).abs().max():.3g}): the optimizer state is not laid out as "
            f"read here; re-save with --dist-ckpt-optim-fully-reshardable, or convert the weights alone with --no-optimizer"
        )
    return [main]


def _halves_of(build: Callable, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return split_fc1(build(tensors)[0], 1)


def _boxed(build: Callable, box: tuple[int, ...], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``build``'s one tensor as the box of a stacked tensor it fills (leading dimensions of 1)."""
    return [build(tensors)[0].reshape(box)]


def _rejoin_fc1(blocks: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A whole fc1 of ``blocks`` TP-local [gate_r; up_r] blocks as [gate; up]."""
    return [torch.cat(split_fc1(tensors[0], blocks))]
