"""Every entry of a Megatron-LM checkpoint as plain data, to compare a converted checkpoint with
the one Megatron-LM itself saved: tensors as tensors, pickled items with megatron-core's classes
as (class name, arguments, state), torch_dist's common state item by item, and each parameter's
optimizer state per parameter whichever form (flat DDP buckets or model space) holds it; and a
converted Hugging Face model's logits against Megatron-LM's own forward."""

from __future__ import annotations

import io
from typing import Any

import torch

from megatron_fsdp.convert.api import _spec_of
from megatron_fsdp.convert.inert_pickle import Opaque
from megatron_fsdp.convert.megatron_dp_buckets import BUCKET, add_bucket_state
from megatron_fsdp.convert.megatron_layouts import torch_dist_view
from megatron_fsdp.convert.sources import TORCH_DIST_COMMON_ITEM, DcpSource


def logits_error(model_class: type, hf_dir: str, reference_file: str) -> float:
    """The largest |difference| between ``model_class.from_pretrained(hf_dir)``'s logits and
    Megatron-LM's own forward on the same tokens (``reference_file``: a fixture's megatron_logits.pt)."""
    reference = torch.load(reference_file)
    model = model_class.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=reference["tokens"], position_ids=reference["position_ids"]).logits
    return (logits - reference["logits"]).abs().max().item()


def plain(value: Any) -> Any:
    """``value`` with stand-ins, tuples and tensors as comparable data."""
    if isinstance(value, type) and issubclass(value, Opaque):
        return ("class", value.qualified_name)
    if isinstance(value, Opaque):
        return ("class", value.qualified_name, plain(value.args), plain(value.state))
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), list(value.shape), value.flatten().tolist())
    return value


def entries(path: str) -> dict[str, Any]:
    """Every entry of the checkpoint at ``path`` (torch_dist's flat buckets left to
    :func:`torch_dist_optimizer_state`; its common state as ``common.<key>`` items)."""
    source = DcpSource(path)
    found: dict[str, Any] = {}
    for name in source.tensors:
        if BUCKET.match(name) is None:
            found[name] = source.read(name)
    for name in source.objects:
        if name == TORCH_DIST_COMMON_ITEM:
            found.update({f"common.{key}": plain(value) for key, value in source.read_item(name)[0].items()})
        elif not name.startswith("optimizer.distributed.") or name.endswith("optimizer/shard_0_1"):
            found[name] = plain(source.read_item(name))
    return found


def torch_dist_optimizer_state(path: str) -> dict[tuple[str, str], torch.Tensor]:
    """A torch_dist checkpoint's main weights and Adam state per parameter (canonical names), from
    its flat DDP buckets (``dp_reshardable``) or its model-space tensors (``fully_reshardable``)."""
    source = DcpSource(path)
    args = source.read_object("args")
    view = torch_dist_view(source.tensors, args.num_layers)
    add_bucket_state(source, view, _spec_of(args))
    state = {}
    for key, read in view.optimizer.items():
        tensor = source.read(read.name, read.region)
        state[key] = tensor.reshape(read.shape) if read.shape is not None else tensor
    return state


def sharded_object(value: object) -> io.BytesIO:
    """A ShardedObject as megatron-core hands it to DCP: ``torch.save`` of a list, as bytes."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer
