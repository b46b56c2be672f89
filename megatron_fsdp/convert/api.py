"""``convert``: which plan turns the checkpoint at hand into the format asked for."""

from __future__ import annotations

import argparse
import itertools
import json
import os
from typing import Any

import torch

from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.gpt_dims import GptDims, dims_from_hf_config, dims_from_megatron_args, hf_config
from megatron_fsdp.convert.hf_names import hf_to_ours, ours_to_hf
from megatron_fsdp.convert.megatron_dp_buckets import add_bucket_state
from megatron_fsdp.convert.megatron_gpt import LOCAL_SPEC, SEQUENTIAL_EXPERTS, SPLIT_FC1, TE_SPEC
from megatron_fsdp.convert.megatron_layouts import EMBEDDING, FSDP_DTENSOR, TORCH_DIST, fsdp_dtensor_view, torch_dist_view
from megatron_fsdp.convert.megatron_run_state import (
    add_fsdp_dtensor_optimizer_state,
    add_fsdp_dtensor_rng,
    add_torch_dist_rng,
    read_fsdp_dtensor_state,
    read_torch_dist_state,
    torch_dist_optimizer_common,
)
from megatron_fsdp.convert.megatron_plans import MegatronTarget, hf_to_megatron, megatron_to_hf, megatron_to_megatron
from megatron_fsdp.convert.plan import Plan
from megatron_fsdp.convert.runner import DEFAULT_MAX_FILE_BYTES, Layout, run_plan
from megatron_fsdp.convert.sources import TORCH_DIST_COMMON_ITEM, TORCH_DIST_MARKER, DcpSource, HuggingFaceSource, Source, open_source

HUGGINGFACE, OURS = "huggingface", "ours"
TARGETS = (HUGGINGFACE, OURS, FSDP_DTENSOR, TORCH_DIST)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The module path our fsdp_dtensor face and megatron-core's Megatron-FSDP give the GPT (the
# DistributedDataParallel wrapper's ``module``).
DEFAULT_MEGATRON_PREFIX = "model.module."
DEFAULT_OPTIMIZER_PREFIX = "optimizer.state.module.module."
# The non-tensor state both Megatron-LM formats carry over.
COMMON_STATE = ("args", "checkpoint_version", "iteration", "opt_param_scheduler", "num_floating_point_operations_so_far")


def source_format(source: Source) -> str:
    """``huggingface``, ``torch_dist``, ``fsdp_dtensor`` (a Megatron-LM GPT saved by Megatron-FSDP)
    or ``ours`` (model FQNs under ``model.``)."""
    if isinstance(source, HuggingFaceSource):
        return HUGGINGFACE
    if source.format == TORCH_DIST:
        return TORCH_DIST
    if any(name.startswith("model.") and name.endswith(EMBEDDING) for name in source.tensors):
        return FSDP_DTENSOR
    return OURS


def _read_config(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConversionError(f"--config {path}: no such config.json")
    with open(file) as handle:
        return json.load(handle)


def _megatron_dims(source: DcpSource, config: dict[str, Any] | None, family: str | None) -> tuple[GptDims, Any]:
    """The GPT's dimensions from ``--config`` when given, else from the checkpoint's args."""
    args = source.read_object("args")
    if config is not None:
        return dims_from_hf_config(config, family), args
    embedding = next((name for name in source.tensors if name.endswith(EMBEDDING)), None)
    if embedding is None:
        raise ConversionError(f"{source.path} has no tensor named ...{EMBEDDING}: it is not a Megatron-LM GPT checkpoint")
    return dims_from_megatron_args(args, source.tensors[embedding].shape[0], family), args


def _tensor_parallel(args: Any) -> int:
    return getattr(args, "tensor_model_parallel_size", 1) if args is not None else 1


def _pipeline_parallel(args: Any) -> int:
    return getattr(args, "pipeline_model_parallel_size", 1) if args is not None else 1


def _json_writer(values: dict[str, Any]):
    def write(path: str) -> None:
        with open(path, "w") as handle:
            json.dump(values, handle, indent=2, sort_keys=True)

    return write


def megatron_args(dims: GptDims, spec: str = TE_SPEC, tensor_parallel: int = 1) -> argparse.Namespace:
    """The args a Megatron-LM checkpoint of this GPT carries (``--use-checkpoint-args`` reads them);
    ``transformer_impl`` says which ``spec``'s module names it holds (``_spec_of`` reads it back)."""
    return argparse.Namespace(
        transformer_impl="local" if spec == LOCAL_SPEC else "transformer_engine",
        num_layers=dims.layers,
        hidden_size=dims.hidden,
        ffn_hidden_size=dims.ffn,
        moe_ffn_hidden_size=dims.ffn if dims.experts else None,
        num_attention_heads=dims.heads,
        group_query_attention=dims.groups != dims.heads,
        num_query_groups=dims.groups,
        kv_channels=dims.head_dim,
        padded_vocab_size=dims.vocab,
        max_position_embeddings=dims.max_positions,
        untie_embeddings_and_output_weights=not dims.tied,
        add_qkv_bias=dims.qkv_bias,
        add_bias_linear=False,
        swiglu=True,
        normalization="RMSNorm",
        norm_epsilon=dims.norm_eps,
        position_embedding_type="rope",
        rotary_base=int(dims.rope_theta),
        rotary_percent=1.0,
        num_experts=dims.experts or None,
        moe_router_topk=dims.experts_per_token,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=1,
    )


def build_plan(source: Source, to: str, options: dict[str, Any]) -> tuple[Plan, Layout]:
    """The plan and output layout for converting ``source`` to ``to``; raises before anything is
    read when the conversion cannot be done."""
    origin = source_format(source)
    dtype = DTYPES[options["dtype"]] if options.get("dtype") else None
    config = _read_config(options.get("config"))
    family = options.get("family")
    if origin == to:
        raise ConversionError(f"{source.path} is already a {to} checkpoint")
    if to == HUGGINGFACE and origin == OURS:
        if config is None:
            raise ConversionError("our DCP checkpoints do not hold the model's config: give it with --config config.json")
        plan = ours_to_hf(source.tensors, bool(config.get("tie_word_embeddings", False)), dtype)
        return plan, Layout(HUGGINGFACE, extra_files=(("config.json", _json_writer(config)),))
    if to == HUGGINGFACE and origin in (FSDP_DTENSOR, TORCH_DIST):
        dims, args = _megatron_dims(source, config, family)
        view = torch_dist_view(source.tensors, dims.layers) if origin == TORCH_DIST else fsdp_dtensor_view(source.tensors, _tensor_parallel(args), _pipeline_parallel(args))
        plan = megatron_to_hf(view, dims, dtype)
        dtype_name = str(next(iter(plan.targets.values())).dtype).removeprefix("torch.")
        return plan, Layout(HUGGINGFACE, extra_files=(("config.json", _json_writer(hf_config(dims, dtype_name))),))
    if origin == HUGGINGFACE and to == OURS:
        hf = source.config()
        return hf_to_ours(source.tensors, bool(hf.get("tie_word_embeddings", False)), dtype), Layout(OURS, step=options.get("step") or 0)
    if origin == HUGGINGFACE and to == FSDP_DTENSOR:
        dims = dims_from_hf_config(config or source.config(), family)
        plan = hf_to_megatron(
            source.tensors, dims, options.get("megatron_prefix", DEFAULT_MEGATRON_PREFIX), options.get("spec", TE_SPEC),
            options.get("experts", SEQUENTIAL_EXPERTS), options.get("fc1", SPLIT_FC1), dtype,
        )
        plan.objects.update(args=megatron_args(dims, options.get("spec", TE_SPEC)), iteration=0, checkpoint_version=3.0)
        return plan, Layout("megatron", step=options.get("step") or 0)
    if {origin, to} == {FSDP_DTENSOR, TORCH_DIST}:
        return _between_megatron_formats(source, origin, to, options, dtype)
    raise ConversionError(
        f"no direct conversion from {origin} to {to}: go through Hugging Face's format (convert to huggingface, then "
        f"from it)"
    )


def _between_megatron_formats(source: DcpSource, origin: str, to: str, options: dict[str, Any], dtype: torch.dtype | None) -> tuple[Plan, Layout]:
    args = source.read_object("args")
    if args is None:
        raise ConversionError(f"{source.path} holds no Megatron-LM args: it was not saved by Megatron-LM")
    with_optimizer = options.get("optimizer", True)
    if origin == TORCH_DIST:
        view = torch_dist_view(source.tensors, args.num_layers)
        sharding = (source.read_object("content_metadata") or {}).get("distrib_optim_sharding_type")
        if with_optimizer and sharding == "dp_reshardable":
            add_bucket_state(source, view, _spec_of(args))
        run_state = read_torch_dist_state(source, sharding)
    else:
        view = fsdp_dtensor_view(source.tensors, _tensor_parallel(args), _pipeline_parallel(args))
        run_state = read_fsdp_dtensor_state(source, view.optimizer_prefix or DEFAULT_OPTIMIZER_PREFIX)
    spec = _spec_of(args)
    weights_dtype = dtype or (torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None)
    target = MegatronTarget(
        to, args.num_layers, spec, options.get("megatron_prefix", DEFAULT_MEGATRON_PREFIX), view.optimizer_prefix or DEFAULT_OPTIMIZER_PREFIX, weights_dtype
    )
    plan = megatron_to_megatron(view, target, with_optimizer)
    with_optimizer = with_optimizer and bool(view.optimizer)
    common = {key: source.read_object(key) for key in COMMON_STATE}
    common = {key: value for key, value in common.items() if value is not None}
    step = common.get("iteration", 0)
    if to == TORCH_DIST:
        if with_optimizer:
            common["optimizer"] = torch_dist_optimizer_common(run_state)
        common["content_metadata"] = {
            "distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False, "chained_optim_avoid_prefix": True,
        }
        plan.objects[TORCH_DIST_COMMON_ITEM] = [common]
        plan.objects.update(_linear_extra_states(args.num_layers, getattr(args, "num_experts", None) or 0))
        add_torch_dist_rng(plan, run_state)
        backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
        return plan, Layout("megatron", step=step, extra_files=((TORCH_DIST_MARKER, _json_writer(backend)),))
    if with_optimizer:
        add_fsdp_dtensor_optimizer_state(plan, run_state, target.optimizer_prefix)
    add_fsdp_dtensor_rng(plan, run_state)
    plan.objects.update(_flattened(common))
    return plan, Layout("megatron", step=step)


def _spec_of(args: Any) -> str:
    """Which module names a Megatron-LM run's layers have: Transformer Engine's or the local spec's."""
    return LOCAL_SPEC if getattr(args, "transformer_impl", "transformer_engine") == "local" else TE_SPEC


def _linear_extra_states(layers: int, experts: int) -> dict[str, Any]:
    """The empty ``_extra_state`` ShardedObjects megatron-core's torch_dist keeps for each linear
    layer of each layer (its loader asks for them): an expert's at (layer, expert) of
    (layers, experts), as its weights are stacked."""
    modules = ("self_attention.linear_qkv", "self_attention.linear_proj") + (() if experts else ("mlp.linear_fc1", "mlp.linear_fc2"))
    states: dict[str, Any] = {f"decoder.layers.{module}._extra_state/shard_{layer}_{layers}": [None] for module in modules for layer in range(layers)}
    for module, layer, expert in itertools.product(("linear_fc1", "linear_fc2"), range(layers), range(experts)):
        states[f"decoder.layers.mlp.experts.experts.{module}._extra_state/shard_{layer}.{expert}_{layers}.{experts}"] = [None]
    return states


def _flattened(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as DCP saves them: one item per leaf, keys joined by dots."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flattened(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def convert(source_path: str, output: str, to: str, overwrite: bool = False, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, **options: Any) -> dict[str, Any]:
    """Converts the checkpoint at ``source_path`` into ``to`` (one of ``huggingface``, ``ours``,
    ``fsdp_dtensor``, ``torch_dist``) at ``output``, which appears whole or not at all. Options:
    ``config`` (a config.json or Hugging Face directory), ``family`` (llama, mistral, qwen2,
    mixtral), ``dtype`` (bf16, fp16, fp32; default: the source's), ``spec`` (te, local),
    ``experts`` (sequential, grouped), ``fc1`` (split, fused), ``step`` (which checkpoint of a
    save directory holding several, default the latest; the output keeps its number; from Hugging
    Face, the step the output is saved as), ``optimizer``. A collective under
    torchrun (each rank converts its share). Returns this rank's seconds, bytes and peak memory."""
    if to not in TARGETS:
        raise ConversionError(f"--to {to} is not one of {TARGETS}")
    source = open_source(source_path, options.get("step"))
    plan, layout = build_plan(source, to, options)
    return run_plan(source, plan, output, layout, overwrite=overwrite, max_file_bytes=max_file_bytes)
