"""megatron-core's default distributed-optimizer state in torch_dist (``dp_reshardable``): the
flat buffers of its DDP buckets, found per parameter.

A DDP run of megatron-core keeps each parameter's fp32 main weight and Adam state in flat
buffers, one per bucket (``optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(...).
bucket_idx_B.{param,exp_avg,exp_avg_sq}``). Its layout (megatron/core/optimizer/
distrib_optimizer.py, ``_compute_per_buffer_param_layout``): parameters in the reverse of the
model's registration order, each starting on a multiple of 64 elements, a bucket closed once it
holds the numel the checkpoint records (``per_bucket_numel_unpadded``). That is computed here;
the conversion then checks, for every parameter, that its slice of the ``param`` buffer is its
weight (rounded to the weight's dtype), so a layout that differs fails by name instead of
moving the wrong numbers.

Covered: one model-parallel group (TP = PP = 1) and one buffer (one dtype, no experts); other
layouts are refused with the fix.
"""

from __future__ import annotations

import re

from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.megatron_layouts import MAIN_PARAM, MegatronView, spec_name
from megatron_fsdp.convert.plan import Read
from megatron_fsdp.convert.sources import DcpSource

BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.(dtype_\(.*\))\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
PER_BUCKET_NUMEL = "optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded/shard_0_1"
_ALIGNMENT = 64  # megatron-core's pad_param_start
_LAYER_ORDER = {
    # Module registration order within a layer: Attention builds linear_proj before SelfAttention
    # adds linear_qkv; the local spec's norms are modules of their own, TE's live in the linears.
    "local": ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"),
    "te": ("self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"),
}


def registration_order(view: MegatronView, spec: str) -> list[str]:
    """The GPT's parameters (canonical names, torch_dist's norm names) in registration order."""
    layers = 1 + max(int(name.split(".")[2]) for name in view.model if name.startswith("decoder.layers."))
    order = ["embedding.word_embeddings.weight"]
    for layer in range(layers):
        order += [spec_name(f"decoder.layers.{layer}.{name}", "te") for name in _LAYER_ORDER[spec]]
    order += ["decoder.final_layernorm.weight", "output_layer.weight"]
    return [name for name in order if name in view.model]


def add_bucket_state(source: DcpSource, view: MegatronView, spec: str) -> None:
    """Adds every parameter's main weight and Adam state, read from the flat bucket buffers, to
    ``view.optimizer`` (nothing when there are none); raises for layouts other than one group and
    one buffer."""
    buckets: dict[int, dict[str, str]] = {}
    groups = set()
    for name in source.tensors:
        match = BUCKET.match(name)
        if match is not None:
            groups.add(match.group(1, 2, 3))
            buckets.setdefault(int(match.group(4)), {})[match.group(5)] = name
    if not groups:
        return  # saved without optimizer state (--no-save-optim)
    if len(groups) != 1:
        raise ConversionError(
            f"{source.path} keeps its optimizer state in {len(groups)} flat buffers (several tensor- or pipeline-parallel "
            f"ranks, dtypes or expert groups): only one is placed per parameter here. Re-save it with "
            f"--dist-ckpt-optim-fully-reshardable, or convert the weights alone with --no-optimizer"
        )
    if any(".mlp.router." in name for name in view.model):
        raise ConversionError(
            f"{source.path} is an MoE model whose optimizer state is in megatron-core's flat DDP buffers: where its "
            f"experts sit in them is not worked out here. Re-save it with --dist-ckpt-optim-fully-reshardable, or "
            f"convert the weights alone with --no-optimizer"
        )
    numels = source.read_item(PER_BUCKET_NUMEL)
    per_bucket = list(numels[0][0].values())[0]
    bucket, start, bucket_start = 0, 0, 0
    for canonical in reversed(registration_order(view, spec)):
        start = -(-start // _ALIGNMENT) * _ALIGNMENT
        shape = view.infos[canonical].shape
        count = 1
        for size in shape:
            count *= size
        for key, name in buckets[bucket].items():
            state_key = MAIN_PARAM if key == "param" else key
            region = (slice(start - bucket_start, start - bucket_start + count),)
            view.optimizer[(state_key, canonical)] = Read(name, region, shape)
        start += count
        if start - bucket_start >= per_bucket[bucket] and bucket + 1 < len(per_bucket):
            bucket, start, bucket_start = bucket + 1, 0, 0
