"""Where a Megatron-LM checkpoint keeps each tensor, in its two DCP-based formats, under one
naming: the per-layer names of megatron-core's module tree (``decoder.layers.3.mlp.linear_fc2.
weight``), "canonical" here.

- ``fsdp_dtensor`` (``--use-megatron-fsdp``): ``model.`` + wrapper prefixes (``module.``) + the
  canonical name, one tensor per parameter at its global shape; SwiGLU fc1 as megatron-core's
  ``..._w`` / ``..._v`` halves (``handle_swiglu_in_state_dict``) or whole; optimizer state
  ``optimizer.state.`` + wrapper prefixes + canonical name + ``.exp_avg`` / ``.exp_avg_sq``.
- ``torch_dist`` (megatron-core's ``dist_checkpointing``): the canonical name with the layer
  index taken out and made a leading dimension (``decoder.layers.mlp.linear_fc2.weight`` of
  shape ``[layers, ...]``), experts likewise a second one (``decoder.layers.mlp.experts.experts.
  linear_fc1.weight`` of ``[layers, experts, ...]``, SequentialMLP and TEGroupedMLP alike);
  fc1 whole as ``[gate; up]``; optimizer state (the distributed optimizer's model-space forms)
  ``optimizer.state.exp_avg.`` / ``exp_avg_sq.`` / ``fp32_param.`` + that name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.plan import Read
from megatron_fsdp.convert.sources import TensorInfo

FSDP_DTENSOR, TORCH_DIST = "fsdp_dtensor", "torch_dist"
EMBEDDING = "embedding.word_embeddings.weight"
OPTIMIZER_STATE = "optimizer.state."
STATE_KEYS = ("exp_avg", "exp_avg_sq")
MAIN_PARAM = "fp32_param"
_WRAPPERS = ("module.", "model.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)(_w|_v)?$")


@dataclass
class MegatronView:
    """A Megatron-LM checkpoint's tensors under canonical names: ``model[name]`` is where the
    weight is read, ``optimizer[(state_key, name)]`` each optimizer state tensor (``fp32_param``
    for torch_dist's main weights). ``fc1_blocks``: how many TP-local ``[gate; up]`` blocks a whole
    fc1 holds (1 but for an unsplit fsdp_dtensor face saved at TP > 1)."""

    format: str
    model: dict[str, Read] = field(default_factory=dict)
    optimizer: dict[tuple[str, str], Read] = field(default_factory=dict)
    infos: dict[str, TensorInfo] = field(default_factory=dict)
    fc1_blocks: int = 1
    model_prefix: str = ""
    optimizer_prefix: str = ""


def _strip_wrappers(name: str) -> tuple[str, str]:
    prefix = ""
    while name.startswith(_WRAPPERS):
        head = name.split(".", 1)[0] + "."
        prefix, name = prefix + head, name[len(head) :]
    return prefix, name


def fsdp_dtensor_view(tensors: dict[str, TensorInfo], tensor_parallel: int, pipeline_parallel: int = 1) -> MegatronView:
    """The view of an fsdp_dtensor checkpoint (``tensor_parallel``, ``pipeline_parallel``: the TP
    and PP sizes it was saved at, from its args). Refuses one saved at PP > 1: megatron-core 0.19
    saves each stage's ``model[0].state_dict_for_save_checkpoint()`` (training/checkpointing.py,
    ``generate_state_dict``), the module tree's names, in which every stage counts its layers
    from 0; the stages' layers then share names and boxes, and DCP's save plan keeps one copy of
    each (``dedup_save_plans``), so the other stages' layers are not in the checkpoint."""
    if pipeline_parallel > 1:
        raise ConversionError(
            f"this fsdp_dtensor checkpoint was saved with pipeline_model_parallel_size={pipeline_parallel}: megatron-core "
            f"0.19 names its layers by the module tree, which counts each stage's layers from 0, so every stage saved "
            f"its layers as decoder.layers.0... and DCP kept one stage's copy of each: the other stages' layers are not "
            f"in it, and no conversion can bring them back. Save the run with --ckpt-format torch_dist (megatron-core's "
            f"DDP; its keys carry global layer offsets, and this converter reads them at any PP), or at "
            f"--pipeline-model-parallel-size 1"
        )
    embedding = [name for name in tensors if name.startswith("model.") and name.endswith(EMBEDDING)]
    if not embedding:
        raise ConversionError(
            f"no tensor named model.[module.]{EMBEDDING}: this is not a Megatron-LM GPT checkpoint in "
            f"fsdp_dtensor format (other Megatron-LM models have no mapping here)"
        )
    view = MegatronView(FSDP_DTENSOR, fc1_blocks=tensor_parallel, model_prefix=embedding[0][: -len(EMBEDDING)])
    for name, info in tensors.items():
        if name.startswith(view.model_prefix):
            canonical = name[len(view.model_prefix) :]
            view.model[canonical], view.infos[canonical] = Read(name), info
        elif name.startswith(OPTIMIZER_STATE):
            prefix, rest = _strip_wrappers(name[len(OPTIMIZER_STATE) :])
            canonical, state_key = rest.rsplit(".", 1)
            view.optimizer_prefix = OPTIMIZER_STATE + prefix
            view.optimizer[(state_key, canonical)] = Read(name)
    return view


def _unstacked(stored: str, name: str, info: TensorInfo, layers: int) -> list[tuple[str, Read, TensorInfo]]:
    """The canonical per-layer (and per-expert) pieces of the torch_dist tensor ``stored``, whose
    model name is ``name`` (``stored`` less an optimizer-state prefix)."""
    if not name.startswith("decoder.layers.") or name[len("decoder.layers.") :].split(".", 1)[0].isdigit():
        return [(name, Read(stored), info)]
    if info.shape[0] != layers:
        raise ConversionError(f"{stored} stacks {info.shape[0]} layers, but the checkpoint's args say num_layers={layers}")
    rest = name[len("decoder.layers.") :]
    expert_match = re.match(r"^mlp\.experts\.experts\.(.*)$", rest)
    pieces = []
    for layer in range(layers):
        if expert_match is None:
            pieces.append((f"decoder.layers.{layer}.{rest}", Read(stored, (layer,)), TensorInfo(info.shape[1:], info.dtype)))
            continue
        for expert in range(info.shape[1]):
            canonical = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{expert_match.group(1)}"
            pieces.append((canonical, Read(stored, (layer, expert)), TensorInfo(info.shape[2:], info.dtype)))
    return pieces


def torch_dist_view(tensors: dict[str, TensorInfo], layers: int) -> MegatronView:
    """The view of a torch_dist checkpoint of a model with ``layers`` layers."""
    if EMBEDDING not in tensors:
        raise ConversionError(f"no tensor named {EMBEDDING}: this is not a Megatron-LM GPT checkpoint in torch_dist format")
    view = MegatronView(TORCH_DIST)
    for name, info in tensors.items():
        if name.startswith(OPTIMIZER_STATE):
            state_key, rest = name[len(OPTIMIZER_STATE) :].split(".", 1)
            for canonical, read, _ in _unstacked(name, rest, info, layers):
                view.optimizer[(state_key, canonical)] = read
        elif not name.startswith(("optimizer.", "rng_state", "rerun_state_machine")):
            for canonical, read, piece_info in _unstacked(name, name, info, layers):
                view.model[canonical], view.infos[canonical] = read, piece_info
    return view


# Transformer Engine's fused layers own the norms (but an MoE layer's pre-MLP norm, a module of
# its own); the local spec keeps them as modules of their own, and its torch_dist names them the
# Transformer Engine way (the local spec's sharded_state_dict_keys_map), MoE layers' too. A TE
# run's torch_dist keeps its module names.
_TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def spec_name(canonical: str, spec: str) -> str:
    """``canonical`` with its norm named as the ``spec`` (``te`` or ``local``) names it."""
    match = _LAYER.match(canonical)
    if match is None:
        return canonical
    rest = match.group(2)
    if spec == "local":
        rest = _TE_NORMS.get(rest, rest)
    else:
        rest = {local: te for te, local in _TE_NORMS.items()}.get(rest, rest)
    return f"decoder.layers.{match.group(1)}.{rest}"


def torch_dist_norm_name(canonical: str, spec: str) -> str:
    """The name torch_dist gives ``canonical`` (a module name of a ``spec`` run): the local spec's
    norms under Transformer Engine's names, a TE run's names as they are."""
    return spec_name(canonical, "te") if spec == "local" else canonical


def module_norm_name(torch_dist_name: str, spec: str) -> str:
    """The inverse of :func:`torch_dist_norm_name`: the module name of a ``spec`` run."""
    return spec_name(torch_dist_name, "local") if spec == "local" else torch_dist_name


def stacked_name(canonical: str) -> tuple[str, tuple[int, ...]]:
    """torch_dist's name for a canonical one, and the leading indices (layer, expert) it sits at."""
    match = _LAYER.match(canonical)
    if match is None:
        return canonical, ()
    layer, rest = int(match.group(1)), match.group(2)
    sequential = _SEQUENTIAL_EXPERT.match(rest)
    if sequential is not None:
        return f"decoder.layers.mlp.experts.experts.{sequential.group(2)}", (layer, int(sequential.group(1)))
    grouped = _GROUPED_EXPERT.match(rest)
    if grouped is not None:
        suffix = grouped.group(3) or ""
        return f"decoder.layers.mlp.experts.experts.{grouped.group(1)}.weight{suffix}", (layer, int(grouped.group(2)))
    return f"decoder.layers.{rest}", (layer,)
