"""Loading a Hugging Face directory into a sharded model, each rank reading only its pieces.

``load_pretrained`` hands the model's own state dict (DTensors over each rank's pieces, as
``dcp.load`` fills them in place) to torch.distributed.checkpoint with
``safetensors_storage.SafetensorsRangeReader``: DCP's planner turns each piece into the
rectangles it covers, and the reader reads just their bytes. No rank builds a full copy of the
model or of any tensor; the host memory a load adds is one rectangle, where the file's dtype
differs from the piece's (bf16 weights into fp32 main weights) or the piece lives on a GPU.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from megatron_fsdp.checkpoint.agreement import first_problem_of_any_rank
from megatron_fsdp.checkpoint.pretrained_names import hugging_face_module, tensor_aliases
from megatron_fsdp.checkpoint.safetensors_storage import SafetensorsRangeReader
from megatron_fsdp.engine.planning.meta_init import transformers_init_owners

logger = logging.getLogger(__name__)


def load_pretrained(model: nn.Module, pretrained_model_name_or_path: str, strict: bool = True) -> None:
    """Loads the Hugging Face directory ``pretrained_model_name_or_path`` (safetensors:
    ``model.safetensors``, or the files ``model.safetensors.index.json`` names) into ``model``,
    sharded by ``megatron_fsdp.fully_shard`` (the wrapper it returned) or in place by
    ``megatron_fsdp.fsdp2.fully_shard``; a collective, call it on every rank. Each rank reads
    the bytes of its own pieces only, so no rank holds a full copy; weights are cast to the
    model's dtypes as ``from_pretrained`` then ``fully_shard`` would (bit for bit).

    Built on the meta device, the model needs its memory first: ``init_model_with_meta_device=True``
    (whole-model door) or ``model.to_empty(device=...)`` (FSDP2's door). A Transformers model's
    non-persistent buffers (rotary frequencies), which no file holds, are then computed by its
    own ``_init_weights``, as ``from_pretrained`` does.

    ``strict`` (default True): a tensor of the model the files lack, or one of the files the model
    lacks, raises on every rank before anything is read, naming them (a tied weight stored under
    either of its names counts as present; keys Transformers itself ignores on loading are
    ignored). False: loads what both hold and logs the rest. A shape that differs raises either
    way. A local directory only: download a Hub model first (``huggingface_hub.snapshot_download``)."""
    directory = str(pretrained_model_name_or_path)
    hf_model = hugging_face_module(model)
    state = model.state_dict()
    started = time.perf_counter()
    reader = SafetensorsRangeReader(directory)
    problem, to_load = None, {}
    try:
        to_load = _entries_to_load(state, hf_model, reader.read_metadata(), strict, directory)
    except Exception as error:  # noqa: BLE001 - a rank that raised alone would leave the others waiting
        problem = str(error) if isinstance(error, RuntimeError) else f"{type(error).__name__}: {error}"
    found = first_problem_of_any_rank(problem)
    if found is not None:
        raise RuntimeError(f"load_pretrained: rank {found[0]} found: {found[1]}")
    if dist.get_rank() == 0:
        logger.info("load_pretrained: each rank reading its pieces of %d tensors from %s", len(to_load), directory)
    try:
        dcp.load(to_load, storage_reader=reader)
    except CheckpointException as error:  # a BaseException: on every rank, naming each rank's failure
        raise RuntimeError(f"load_pretrained({directory}) failed reading the files; the model is partly loaded: {error}") from error
    model.load_state_dict(to_load, strict=False)
    _compute_non_persistent_buffers(hf_model)
    logger.info(
        "load_pretrained: rank %d read %.1f MB of %s for %d tensors in %.1f s",
        dist.get_rank(), reader.bytes_read / 1e6, directory, len(to_load), time.perf_counter() - started,
    )


def _entries_to_load(state: dict[str, Any], hf_model: nn.Module, metadata: Metadata, strict: bool, directory: str) -> dict[str, Any]:
    """The entries of ``state`` to fill, each tensor once under a name the files hold; raises
    naming mis-shaped tensors, and (``strict``) missing and unexpected ones."""
    saved = {name: entry.size for name, entry in metadata.state_dict_metadata.items()}
    to_load, missing, mis_shaped, known = {}, [], [], set()
    for names in tensor_aliases(state, hf_model):
        known.update(names)
        present = [name for name in names if name in saved]
        if not present:
            missing.append(names[0])
            continue
        value = state[present[0]]
        if tuple(saved[present[0]]) != tuple(value.shape):
            mis_shaped.append(f"{present[0]} (files {tuple(saved[present[0]])}, model {tuple(value.shape)})")
        to_load[present[0]] = value
    ignored = _ignored_on_load(hf_model)
    unexpected = [name for name in saved if name not in known and not any(p.search(name) for p in ignored)]
    problems = [f"mis-shaped: {', '.join(mis_shaped)}"] if mis_shaped else []
    if strict and missing:
        problems.append(f"missing from the files: {', '.join(missing)}")
    if strict and unexpected:
        problems.append(f"in the files but not in the model: {', '.join(unexpected)}")
    if problems:
        advice = " (strict=False loads the tensors both hold)" if not mis_shaped else ""
        raise RuntimeError(f"{directory} does not fit this {type(hf_model).__name__}; {'; '.join(problems)}{advice}")
    if missing or unexpected:
        logger.warning("load_pretrained(%s): not in the files, left as they are: %s; not in the model: %s", directory, missing, unexpected)
    return to_load


def _ignored_on_load(hf_model: nn.Module) -> list[re.Pattern]:
    """Names in the files that Transformers' own loading ignores for this model: its
    ``_keys_to_ignore_on_load_unexpected`` and, as Transformers does, rotary frequencies stored by
    older checkpoints where the model computes them."""
    patterns = [re.compile(p) for p in getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or []]
    if any(name.endswith("rotary_emb.inv_freq") for name, _ in hf_model.named_buffers()):
        patterns.append(re.compile(r"rotary_emb\.inv_freq"))
    return patterns


def _compute_non_persistent_buffers(hf_model: nn.Module) -> None:
    """A Transformers model's buffers that are not in its state dict, computed by its
    ``_init_weights`` (as ``from_pretrained`` does for what no file holds), the module's loaded
    parameters and buffers marked so that the call leaves them as loaded. Other models' are left
    as their initialisation made them."""
    owners = transformers_init_owners(hf_model)
    for module in hf_model.modules():
        owner = owners[module]
        kept = [name for name in module._non_persistent_buffers_set if module._buffers.get(name) is not None]
        if owner is None or not kept:
            continue
        loaded = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        for tensor in loaded:
            if not any(tensor is module._buffers[name] for name in kept):
                tensor._is_hf_initialized = True
        with torch.no_grad():
            owner._init_weights(module)
