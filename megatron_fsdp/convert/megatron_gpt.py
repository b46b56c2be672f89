"""The name and shape table between megatron-core's GPT and Llama-, Mistral-, Qwen2- and
Mixtral-style Hugging Face models, and the two tensor rearrangements it needs.

megatron-core's layout (megatron/core/transformer/attention.py, mlp.py, moe/experts.py):

- ``self_attention.linear_qkv.weight`` is ``[groups * (heads/groups + 2) * head_dim, hidden]``,
  laid out query group by query group: the ``heads/groups`` query heads of group g, then its
  key head, then its value head. Hugging Face keeps ``q_proj`` (heads in order), ``k_proj`` and
  ``v_proj`` apart; query head h reads key/value head ``h // (heads/groups)`` in both.
- ``mlp.linear_fc1.weight`` of a SwiGLU MLP is ``[gate; up]`` on dim 0 (the first half goes
  through the activation). Tensor parallelism splits each half, so a tensor whose global shape
  is the concatenation of the TP-local ``[gate_r; up_r]`` (an unsplit fsdp_dtensor face at TP > 1)
  is ``[gate_0; up_0; gate_1; up_1; ...]``; torch_dist and megatron-core's
  ``handle_swiglu_in_state_dict`` (``..._w`` / ``..._v``) keep the halves whole.
- Norms: with Transformer Engine's fused layers the pre-attention norm is
  ``self_attention.linear_qkv.layer_norm_weight`` and the pre-MLP norm
  ``mlp.linear_fc1.layer_norm_weight``; with the local spec (and before MoE layers)
  ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``.
- MoE: ``mlp.router.weight`` (``[experts, hidden]``), experts as ``mlp.experts.local_experts.N.
  linear_fc1/fc2.weight`` (SequentialMLP) or ``mlp.experts.linear_fc1.weightN`` (TEGroupedMLP),
  Mixtral's ``block_sparse_moe.gate`` and ``experts.N.w1`` (gate), ``w3`` (up), ``w2`` (down).

Rotary embeddings need no permutation: megatron-core's default (non-interleaved) rotary is
Hugging Face's ``rotate_half``; the interleaved one is refused in ``gpt_dims``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_fsdp.convert.gpt_dims import GptDims

TE_SPEC, LOCAL_SPEC = "te", "local"
SEQUENTIAL_EXPERTS, GROUPED_EXPERTS = "sequential", "grouped"
SPLIT_FC1, FUSED_FC1 = "split", "fused"


@dataclass(frozen=True)
class Slot:
    """One Megatron-LM tensor and the Hugging Face tensor(s) it holds.

    ``kind``: ``copy`` (one to one), ``qkv`` (fused QKV weight or bias <-> q, k, v), ``fc1``
    (SwiGLU fc1 <-> gate, up). ``megatron``: the names it may have, one per spec or expert form
    (reading takes the one present; writing the one asked for)."""

    kind: str
    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]

    @property
    def megatron_shape(self) -> tuple[int, ...]:
        rows = sum(shape[0] for shape in self.hf_shapes)
        return (rows, *self.hf_shapes[0][1:])


def _layer_slots(dims: GptDims, layer: int) -> list[Slot]:
    meg, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    hidden, q_rows, kv_rows = dims.hidden, dims.q_rows, dims.kv_rows
    slots = [
        Slot("copy", (meg + "self_attention.linear_qkv.layer_norm_weight", meg + "input_layernorm.weight"), (hf + "input_layernorm.weight",), ((hidden,),)),
        Slot(
            "qkv",
            (meg + "self_attention.linear_qkv.weight",),
            tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
            ((q_rows, hidden), (kv_rows, hidden), (kv_rows, hidden)),
        ),
        Slot("copy", (meg + "self_attention.linear_proj.weight",), (hf + "self_attn.o_proj.weight",), ((hidden, q_rows),)),
    ]
    if dims.qkv_bias:
        slots.append(
            Slot("qkv", (meg + "self_attention.linear_qkv.bias",), tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"), ((q_rows,), (kv_rows,), (kv_rows,)))
        )
    if not dims.experts:
        slots += [
            Slot("copy", (meg + "mlp.linear_fc1.layer_norm_weight", meg + "pre_mlp_layernorm.weight"), (hf + "post_attention_layernorm.weight",), ((hidden,),)),
            Slot("fc1", (meg + "mlp.linear_fc1.weight",), (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), ((dims.ffn, hidden), (dims.ffn, hidden))),
            Slot("copy", (meg + "mlp.linear_fc2.weight",), (hf + "mlp.down_proj.weight",), ((hidden, dims.ffn),)),
        ]
        return slots
    moe = hf + "block_sparse_moe."
    # An MoE layer's pre-MLP norm is a module of its own under either spec; torch_dist of the
    # local spec renames it the Transformer Engine way all the same (its sharded_state_dict_keys_map).
    norm = meg + "pre_mlp_layernorm.weight"
    slots += [
        Slot("copy", (norm, norm, meg + "mlp.linear_fc1.layer_norm_weight"), (hf + "post_attention_layernorm.weight",), ((hidden,),)),
        Slot("copy", (meg + "mlp.router.weight",), (moe + "gate.weight",), ((dims.experts, hidden),)),
    ]
    for expert in range(dims.experts):
        sequential, grouped = meg + f"mlp.experts.local_experts.{expert}.", meg + "mlp.experts."
        slots += [
            Slot(
                "fc1",
                (sequential + "linear_fc1.weight", grouped + f"linear_fc1.weight{expert}"),
                (moe + f"experts.{expert}.w1.weight", moe + f"experts.{expert}.w3.weight"),
                ((dims.ffn, hidden), (dims.ffn, hidden)),
            ),
            Slot(
                "copy",
                (sequential + "linear_fc2.weight", grouped + f"linear_fc2.weight{expert}"),
                (moe + f"experts.{expert}.w2.weight",),
                ((hidden, dims.ffn),),
            ),
        ]
    return slots


def gpt_slots(dims: GptDims) -> list[Slot]:
    """Every tensor of the GPT, in model order."""
    slots = [Slot("copy", ("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), ((dims.vocab, dims.hidden),))]
    for layer in range(dims.layers):
        slots += _layer_slots(dims, layer)
    slots.append(Slot("copy", ("decoder.final_layernorm.weight",), ("model.norm.weight",), ((dims.hidden,),)))
    if not dims.tied:
        slots.append(Slot("copy", ("output_layer.weight",), ("lm_head.weight",), ((dims.vocab, dims.hidden),)))
    return slots


def megatron_name(slot: Slot, spec: str, experts: str) -> str:
    """The name a run with ``spec`` (``te`` or ``local``) and expert form (``sequential`` or
    ``grouped``) gives this slot's tensor."""
    if len(slot.megatron) == 1:
        return slot.megatron[0]
    if "experts." in slot.megatron[0]:
        return slot.megatron[0 if experts == SEQUENTIAL_EXPERTS else 1]
    return slot.megatron[0 if spec == TE_SPEC else 1]


def split_qkv(fused: torch.Tensor, dims: GptDims) -> list[torch.Tensor]:
    """q, k, v (Hugging Face's order of heads) out of megatron-core's per-query-group layout."""
    per_group = dims.heads // dims.groups
    rest = fused.shape[1:]
    grouped = fused.reshape(dims.groups, per_group + 2, dims.head_dim, *rest)
    q = grouped[:, :per_group].reshape(dims.q_rows, *rest)
    k = grouped[:, per_group].reshape(dims.kv_rows, *rest)
    v = grouped[:, per_group + 1].reshape(dims.kv_rows, *rest)
    return [q, k, v]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: GptDims) -> torch.Tensor:
    """The inverse of :func:`split_qkv`."""
    per_group = dims.heads // dims.groups
    rest = q.shape[1:]
    parts = (
        q.reshape(dims.groups, per_group, dims.head_dim, *rest),
        k.reshape(dims.groups, 1, dims.head_dim, *rest),
        v.reshape(dims.groups, 1, dims.head_dim, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_fc1(fused: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """gate, up out of an fc1 made of ``tp`` TP-local ``[gate_r; up_r]`` blocks (tp=1: ``[gate; up]``)."""
    rows = fused.shape[0]
    if rows % (2 * tp):
        raise ValueError(f"an fc1 of {rows} rows does not split into gate and up over {tp} tensor-parallel ranks")
    blocks = fused.reshape(tp, 2, rows // (2 * tp), *fused.shape[1:])
    return [blocks[:, half].reshape(rows // 2, *fused.shape[1:]) for half in (0, 1)]
