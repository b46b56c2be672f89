"""Plans between Megatron-LM GPT checkpoints and Hugging Face models, and between Megatron-LM's
two formats, from the table in ``megatron_gpt`` and the views of ``megatron_layouts``."""

from __future__ import annotations

import functools

import torch

from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.gpt_dims import GptDims
from megatron_fsdp.convert.megatron_gpt import (
    FUSED_FC1,
    Slot,
    fuse_fc1,
    fuse_qkv,
    gpt_slots,
    megatron_name,
    split_fc1,
    split_qkv,
)
from megatron_fsdp.convert.megatron_layouts import (
    FSDP_DTENSOR,
    MAIN_PARAM,
    STATE_KEYS,
    TORCH_DIST,
    MegatronView,
    stacked_name,
)
from megatron_fsdp.convert.plan import Plan, Read, Write, expect_shape, refuse_unknown, require, same
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


def _target_names(canonical: str, target_format: str, model_prefix: str, optimizer_prefix: str, state_key: str | None) -> tuple[str, tuple[int, ...]]:
    """Where ``canonical`` (a weight, or its optimizer state ``state_key``) goes in the target format."""
    if target_format == TORCH_DIST:
        name, index = stacked_name(canonical)
        return (name if state_key is None else f"optimizer.state.{state_key}.{name}"), index
    return (model_prefix + canonical if state_key is None else f"{optimizer_prefix}{canonical}.{state_key}"), ()


def _whole_fc1(view: MegatronView) -> dict[str, tuple[list[Read], list[str]]]:
    """Every fc1 of the view as the reads that give its ``[gate; up]`` (two halves or one whole)."""
    found = {}
    for canonical in view.model:
        if canonical.endswith("_w") and canonical[:-2] + "_v" in view.model:
            found[canonical[:-2]] = [canonical, canonical[:-2] + "_v"]
    return found


def megatron_to_megatron(
    view: MegatronView,
    target_format: str,
    layers: int,
    model_prefix: str,
    optimizer_prefix: str,
    weights_dtype: torch.dtype | None,
) -> Plan:
    """fsdp_dtensor <-> torch_dist: every weight and every optimizer state tensor (``exp_avg``,
    ``exp_avg_sq``; torch_dist's ``fp32_param`` main weights), renamed, stacked or unstacked, and
    fc1 halves joined or split. torch_dist keeps the model weights in ``weights_dtype`` (the run's
    params dtype) and the fp32 main weights as ``fp32_param``; fsdp_dtensor keeps the main weights
    as its model weights."""
    if view.format == target_format:
        raise ConversionError(f"the checkpoint is already {target_format}")
    plan = Plan()
    halves = _whole_fc1(view)
    half_names = {name for pair in halves.values() for name in pair}
    plain = [canonical for canonical in view.model if canonical not in half_names]
    kinds = [(None, canonical) for canonical in plain + list(halves)]
    kinds += [(key, canonical) for key in STATE_KEYS for canonical in plain + list(halves)]
    if target_format == TORCH_DIST:
        kinds += [(MAIN_PARAM, canonical) for canonical in plain + list(halves)]
    for state_key, canonical in kinds:
        _add_tensor(plan, view, halves, target_format, layers, model_prefix, optimizer_prefix, weights_dtype, state_key, canonical)
    return plan


def _source_reads(view: MegatronView, halves: dict[str, list[str]], state_key: str | None, canonical: str) -> list[Read] | None:
    """Where ``canonical``'s weight (``state_key`` None), main weight or optimizer state is read."""
    names = halves.get(canonical, [canonical])
    if state_key is None or (state_key == MAIN_PARAM and view.format == FSDP_DTENSOR):
        return [view.model[name] for name in names]
    if view.format == TORCH_DIST and state_key is None:
        return [view.model[name] for name in names]
    found = [view.optimizer.get((state_key, name)) for name in names]
    return None if None in found else found


def _add_tensor(plan, view, halves, target_format, layers, model_prefix, optimizer_prefix, weights_dtype, state_key, canonical) -> None:
    if view.format == TORCH_DIST and state_key is None and (MAIN_PARAM, canonical) in view.optimizer:
        reads = [view.optimizer[(MAIN_PARAM, canonical)]]  # the fp32 main weights, not their bf16 copy
    else:
        reads = _source_reads(view, halves, state_key, canonical)
    if reads is None:
        return  # no optimizer state for this weight (saved without it)
    infos = [view.infos[name] for name in halves.get(canonical, [canonical])]
    whole = TensorInfo((sum(info.shape[0] for info in infos), *infos[0].shape[1:]) if infos[0].shape else (), infos[0].dtype)
    is_fc1 = canonical in halves or canonical.endswith("linear_fc1.weight") or ".linear_fc1.weight" in canonical
    split = target_format == FSDP_DTENSOR and is_fc1
    if state_key in STATE_KEYS or state_key == MAIN_PARAM:
        dtype = torch.float32
    elif target_format == TORCH_DIST:
        dtype = weights_dtype or whole.dtype
    else:
        dtype = torch.float32 if (MAIN_PARAM, canonical) in view.optimizer else whole.dtype
    target, index = _target_names(canonical, target_format, model_prefix, optimizer_prefix, state_key)
    if split:
        half_shape = (whole.shape[0] // 2, *whole.shape[1:])
        suffixes = ("_w", "_v")
        names = [f"{target}{s}" if state_key is None else target.replace(f"{canonical}.", f"{canonical}{s}.") for s in suffixes]
        writes = [(name, TensorInfo(half_shape, dtype)) for name in names]
        plan.add(reads, writes, functools.partial(_split_fc1_halves, view.fc1_blocks))
        return
    build = _cat_halves if len(reads) == 2 else (functools.partial(_rejoin_fc1, view.fc1_blocks) if is_fc1 and view.fc1_blocks > 1 else same)
    if not index:
        plan.add(reads, [(target, TensorInfo(whole.shape, dtype))], build)
        return
    full_shape = _stacked_shape(view, canonical, layers, whole.shape)
    plan.targets[target] = TensorInfo(full_shape, dtype)
    offsets = (*index, *([0] * len(whole.shape)))
    box = (*([1] * len(index)), *whole.shape)
    plan.steps.append(_stacked_step(reads, target, box, offsets, build))


def _rejoin_fc1(blocks: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat(split_fc1(tensors[0], blocks))]


def _stacked_shape(view: MegatronView, canonical: str, layers: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    _, index = stacked_name(canonical)
    if len(index) == 1:
        return (layers, *shape)
    experts = 1 + max(
        stacked_name(other)[1][1] for other in view.model if len(stacked_name(other)[1]) == 2
    )
    return (layers, experts, *shape)


def _stacked_step(reads, target, box, offsets, build):
    from megatron_fsdp.convert.plan import Step

    def build_boxed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [build(tensors)[0].reshape(box)]

    return Step(tuple(reads), (Write(target, tuple(box), tuple(offsets)),), build_boxed)
