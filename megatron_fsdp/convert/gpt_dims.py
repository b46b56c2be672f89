"""A GPT's dimensions, from Megatron-LM's ``args`` or a Hugging Face ``config.json``, and the
Hugging Face config they make.

One dataclass serves both directions: Megatron-LM GPT -> Llama / Mistral / Qwen2 / Mixtral reads
the dimensions from the ``args`` megatron stores in every checkpoint (or from a ``config.json``
given on the command line), Hugging Face -> Megatron-LM reads them from the model's config. What
the Hugging Face families cannot express (interleaved rotary, partial rotary, QK norm, biases on
the output projection or the MLP, LayerNorm instead of RMSNorm, no SwiGLU) is refused here,
naming the argument, before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_fsdp.convert.errors import ConversionError

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


@dataclass(frozen=True)
class GptDims:
    """What the name and shape tables need. ``vocab`` is the embedding's row count (Megatron-LM's
    padded vocabulary); ``experts`` is 0 for a dense model."""

    family: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    experts: int = 0
    experts_per_token: int = 2
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_positions: int = 4096
    sliding_window: int | None = None

    @property
    def q_rows(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.groups * self.head_dim


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


def _family_for(explicit: str | None, experts: int, qkv_bias: bool, sliding_window: int | None) -> str:
    if explicit is not None:
        if explicit not in FAMILIES:
            raise ConversionError(f"--family {explicit} is not one of {sorted(FAMILIES)}")
        return explicit
    if experts:
        return "mixtral"
    if qkv_bias:
        return "qwen2"
    return "mistral" if sliding_window else "llama"


def _moe_refusals(args: Any) -> dict[str, tuple[bool, str]]:
    """What of megatron-core's MoE a Mixtral block cannot express. Mixtral routes by softmax over
    every expert, top-k, renormalized over the k; megatron-core's default (``--moe-router-score-
    function softmax``, no ``--moe-router-pre-softmax``) takes the top-k logits and softmaxes over
    them: the same weights, since exp(l_i) / sum_k exp(l_j) is both. Pre-softmax keeps the
    probabilities unrenormalized, so it differs; so do the rest below."""
    freq = _arg(args, "moe_layer_freq", 1)
    return {
        "moe_router_pre_softmax": (bool(_arg(args, "moe_router_pre_softmax", False)), "top-k before the softmax (no --moe-router-pre-softmax)"),
        "moe_router_score_function": (_arg(args, "moe_router_score_function", "softmax") != "softmax", "softmax routing"),
        "moe_router_topk_scaling_factor": (_arg(args, "moe_router_topk_scaling_factor", None) not in (None, 1.0), "unscaled routing weights"),
        "moe_router_enable_expert_bias": (bool(_arg(args, "moe_router_enable_expert_bias", False)), "no expert bias"),
        "moe_router_num_groups": (bool(_arg(args, "moe_router_num_groups", None)), "ungrouped top-k"),
        "moe_expert_capacity_factor": (_arg(args, "moe_expert_capacity_factor", None) is not None, "no token dropping"),
        "moe_shared_expert_intermediate_size": (bool(_arg(args, "moe_shared_expert_intermediate_size", None)), "no shared expert"),
        "moe_layer_freq": (freq != 1 and not (isinstance(freq, list) and all(flag == 1 for flag in freq)), "every layer MoE"),
        "moe_mlp_glu_interleave_size": (_arg(args, "moe_mlp_glu_interleave_size", None) is not None, "fc1 as [gate; up], not interleaved"),
        "moe_latent_size": (_arg(args, "moe_latent_size", None) is not None, "no latent projection"),
        "moe_apply_probs_on_input": (bool(_arg(args, "moe_apply_probs_on_input", False)), "routing weights applied to the experts' output"),
    }


def dims_from_megatron_args(args: Any, vocab: int, family: str | None = None) -> GptDims:
    """The dimensions of the GPT that Megatron-LM's ``args`` (an ``argparse.Namespace`` read from the
    checkpoint) describe; ``vocab`` is the embedding's row count. Raises for what a Llama-style
    Hugging Face model cannot express."""
    if args is None:
        raise ConversionError(
            "the checkpoint holds no Megatron-LM args (saved without them, or not by Megatron-LM): give the "
            "model's Hugging Face config with --config config.json"
        )
    refusals = {
        "swiglu": (not _arg(args, "swiglu", False), "SwiGLU MLPs (--swiglu)"),
        "normalization": (_arg(args, "normalization", "RMSNorm") != "RMSNorm", "RMSNorm (--normalization RMSNorm)"),
        "position_embedding_type": (_arg(args, "position_embedding_type", "rope") != "rope", "rotary positions (--position-embedding-type rope)"),
        "rotary_interleaved": (bool(_arg(args, "rotary_interleaved", False)), "non-interleaved rotary (no --rotary-interleaved)"),
        "rotary_percent": (_arg(args, "rotary_percent", 1.0) != 1.0, "full rotary (--rotary-percent 1.0)"),
        "qk_layernorm": (bool(_arg(args, "qk_layernorm", False)), "no QK norm (no --qk-layernorm)"),
        "add_bias_linear": (bool(_arg(args, "add_bias_linear", False)), "no linear biases (--disable-bias-linear)"),
    }
    if _arg(args, "num_experts", None):
        refusals.update(_moe_refusals(args))
    wrong = [f"{name}={getattr(args, name, None)!r} (needs {what})" for name, (bad, what) in refusals.items() if bad]
    if wrong:
        raise ConversionError(
            f"this Megatron-LM GPT has {', '.join(wrong)}: Llama-, Mistral-, Qwen2- and Mixtral-style Hugging Face "
            f"models cannot express that, so there is no faithful conversion"
        )
    heads = args.num_attention_heads
    groups = args.num_query_groups if _arg(args, "group_query_attention", False) and _arg(args, "num_query_groups") else heads
    experts = _arg(args, "num_experts", None) or 0
    window = _arg(args, "window_size", None)
    qkv_bias = bool(_arg(args, "add_qkv_bias", False))
    return GptDims(
        family=_family_for(family, experts, qkv_bias, window[0] if window else None),
        layers=args.num_layers,
        hidden=args.hidden_size,
        ffn=(_arg(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size) if experts else args.ffn_hidden_size,
        heads=heads,
        groups=groups,
        head_dim=_arg(args, "kv_channels", None) or args.hidden_size // heads,
        vocab=vocab,
        tied=not _arg(args, "untie_embeddings_and_output_weights", False),
        qkv_bias=qkv_bias,
        experts=experts,
        experts_per_token=_arg(args, "moe_router_topk", 2),
        norm_eps=_arg(args, "norm_epsilon", 1e-5),
        rope_theta=float(_arg(args, "rotary_base", 10000)),
        max_positions=_arg(args, "max_position_embeddings", None) or _arg(args, "seq_length", 4096),
        sliding_window=window[0] if window else None,
    )


def _rope_theta(config: dict[str, Any]) -> float:
    """Transformers 5 keeps it in ``rope_parameters``, 4 in ``rope_theta``."""
    parameters = config.get("rope_parameters") or {}
    rope_type = parameters.get("rope_type", (config.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default":
        raise ConversionError(f"config.json's rope type {rope_type!r}: only the default rotary embedding has a Megatron-LM twin here")
    return float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))


def dims_from_hf_config(config: dict[str, Any], family: str | None = None) -> GptDims:
    """The dimensions of a Llama-, Mistral-, Qwen2- or Mixtral-style ``config.json``."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ConversionError(
            f"config.json's model_type is {model_type!r}: the Megatron-LM mapping covers {sorted(FAMILIES)}"
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ConversionError("config.json sets attention_bias or mlp_bias: Megatron-LM's GPT has no bias on those projections here")
    heads = config["num_attention_heads"]
    experts = config.get("num_local_experts", 0) or 0
    return GptDims(
        family=family or model_type,
        layers=config["num_hidden_layers"],
        hidden=config["hidden_size"],
        ffn=config["intermediate_size"],
        heads=heads,
        groups=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        experts=experts,
        experts_per_token=config.get("num_experts_per_tok", 2),
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=_rope_theta(config),
        max_positions=config.get("max_position_embeddings", 4096),
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window", True) else None,
    )


def hf_config(dims: GptDims, dtype_name: str) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model with these dimensions, written by Transformers'
    own config class (so the keys are those of the installed version)."""
    import transformers

    config_class = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "mixtral": transformers.MixtralConfig,
    }[dims.family]
    values: dict[str, Any] = dict(
        vocab_size=dims.vocab,
        hidden_size=dims.hidden,
        intermediate_size=dims.ffn,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.groups,
        head_dim=dims.head_dim,
        max_position_embeddings=dims.max_positions,
        rms_norm_eps=dims.norm_eps,
        rope_theta=dims.rope_theta,
        tie_word_embeddings=dims.tied,
        architectures=[FAMILIES[dims.family]],
        torch_dtype=dtype_name,
    )
    if dims.family in ("mistral", "mixtral"):
        values["sliding_window"] = dims.sliding_window
    if dims.family == "qwen2":
        values["use_sliding_window"] = False
    if dims.family == "mixtral":
        values.update(num_local_experts=dims.experts, num_experts_per_tok=dims.experts_per_token)
    if dims.family == "llama":
        values.update(attention_bias=False, mlp_bias=False)
    return config_class(**values).to_dict()
