"""Hugging Face's ``save_pretrained`` for a sharded model, written by every rank.

Each rank writes its own pieces through torch.distributed.checkpoint's Hugging Face writer
(``safetensors_storage.PieceSafetensorsWriter``: no tensor is gathered), the first rank joins
them into the files and index ``from_pretrained`` reads (torch's consolidation, one tensor in
memory at a time) and writes the config beside them. Everything is written into
``<dir>.saving`` first and only then takes ``<dir>``'s place, so a save that fails or is killed
leaves the previous one as it was. Also: :func:`gathered_state_dict`, the full tensors that
clients writing from one process need.
"""

from __future__ import annotations

import copy
import ctypes
import logging
import os
import re
import shutil
import time
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from megatron_fsdp.checkpoint.agreement import first_problem_of_any_rank
from megatron_fsdp.checkpoint.pretrained_names import hugging_face_module, tensor_aliases
from megatron_fsdp.checkpoint.safetensors_storage import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, PieceSafetensorsWriter

logger = logging.getLogger(__name__)

# Transformers' default (PreTrainedModel.save_pretrained).
DEFAULT_MAX_SHARD_SIZE = "50GB"
SAVING_SUFFIX = ".saving"
REPLACED_SUFFIX = ".replaced"
# Where DCP's writer puts each rank's files before consolidation (torch's SHARDED_DIR_NAME).
_RANK_FILES_DIR = "sharded"
# Weight files of an earlier save that a new one replaces (Transformers' names, any shard count).
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")
_SIZE = re.compile(r"(\d+)\s*([KMG]I?B)", re.IGNORECASE)
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
# Transformers' save_pretrained arguments that change nothing here at these values.
_IGNORED_AT = {
    "push_to_hub": False, "variant": None, "token": None, "save_peft_format": True,
    "save_original_format": True, "distributed_checkpoint": False, "safe_serialization": True,
}


def gathered_state_dict(state_dict: dict[str, Any], keep: bool) -> dict[str, Any]:
    """``state_dict`` with every DTensor value gathered into its full tensor on the host (a
    collective per DTensor: every rank, in the same order). ``keep=False``: gathers and drops
    them (ranks that do not write). A tensor shown under several names (a tied weight) gives
    one full tensor under all of them, which Transformers (and Accelerate, given an OrderedDict as
    ``nn.Module.state_dict`` returns) then saves once."""
    full: OrderedDict[str, Any] = OrderedDict()
    gathered: dict[int, torch.Tensor | None] = {}
    for name, value in state_dict.items():
        if isinstance(value, DTensor):
            if id(value) not in gathered:
                whole = value.full_tensor()
                gathered[id(value)] = whole.detach().cpu() if keep else None
            value = gathered[id(value)]
        if keep:
            full[name] = value.detach() if isinstance(value, torch.Tensor) else value
    return full


def parse_size(size: int | str) -> int:
    """Bytes of Transformers' ``max_shard_size``: an int, or digits and a unit ("5GB", "500MiB")."""
    if isinstance(size, int):
        return size
    match = _SIZE.fullmatch(size.strip())
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: give bytes as an int or digits and a unit (KB, MB, GB, KiB, MiB, GiB)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def file_indices(state: dict[str, torch.Tensor], max_bytes: int) -> dict[str, int]:
    """Name -> output file (1 to N) as Transformers splits a state dict: in order, a new file
    when the next tensor would pass ``max_bytes``; a tensor larger than that alone in one."""
    indices, index, used = {}, 1, 0
    for name, value in state.items():
        size = value.numel() * value.element_size()
        if used and used + size > max_bytes:
            index, used = index + 1, 0
        indices[name] = index
        used += size
    return indices


def save_pretrained(
    model: nn.Module,
    save_directory: str,
    is_main_process: bool = True,
    state_dict: dict[str, Any] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> str:
    """Writes the sharded ``model`` (either door) as the directory ``from_pretrained`` loads:
    safetensors files of at most ``max_shard_size`` each (default "50GB", as Transformers) with
    ``model.safetensors.index.json`` (one file: ``model.safetensors``), the config and the
    generation config. A collective: call it on every rank; every rank writes its own pieces, and
    the first rank joins them (a filesystem every rank writes to, e.g. shared across nodes). Returns
    the directory.

    ``state_dict``: this model's ``state_dict()`` (default), or a dict of the same names whose
    values are its DTensors or full tensors (a tied weight's second name is not written);
    ``dtype``: floating-point tensors written in it (default: as they are, fp32 main weights where
    the model keeps them). The save goes to ``<dir>.saving`` and then takes ``<dir>``'s place
    (files of ``<dir>`` that are not weights, a tokenizer say, are kept), so a failed or killed
    save leaves the previous one whole. ``is_main_process`` is accepted for Transformers' callers:
    every rank writes regardless. Other Transformers arguments are refused unless at their
    defaults (``push_to_hub=False``...)."""
    refused = {key: value for key, value in kwargs.items() if key != "save_function" and _IGNORED_AT.get(key, ...) != value}
    if refused:
        raise TypeError(f"megatron_fsdp.save_pretrained does not take {refused}: it writes safetensors to a local directory")
    hf_model = hugging_face_module(model)
    config = getattr(hf_model, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        raise TypeError(
            f"the sharded {type(hf_model).__name__} has no Hugging Face config: save_pretrained writes a Transformers "
            "model; write other models' full weights with megatron_fsdp.export_safetensors(model, path)"
        )
    state = _tensors_to_write(model.state_dict() if state_dict is None else state_dict, hf_model, dtype)
    final = os.path.abspath(save_directory)
    partial = final + SAVING_SUFFIX
    rank, started = dist.get_rank(), time.perf_counter()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a save that died
        os.makedirs(partial)
        logger.info("save_pretrained: every rank writing its pieces of %d tensors, then rank 0 joining them into %s", len(state), final)
    dist.barrier()
    try:
        dcp.save(state, storage_writer=PieceSafetensorsWriter(partial, file_indices(state, parse_size(max_shard_size))))
    except BaseException as error:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(error, CheckpointException):  # a BaseException: on every rank, naming each rank's failure
            raise RuntimeError(f"save_pretrained({final}) failed, the previous save is as it was: {error}") from error
        raise
    problem = None
    if rank == 0:
        try:
            _finish_directory(partial, hf_model, state)
            _take_place(partial, final)
        except Exception as error:  # noqa: BLE001 - the other ranks must raise it too
            shutil.rmtree(partial, ignore_errors=True)
            problem = f"{type(error).__name__}: {error}"
    found = first_problem_of_any_rank(problem)
    if found is not None:
        raise RuntimeError(f"save_pretrained({final}) failed on rank {found[0]}, the previous save is as it was: {found[1]}")
    if rank == 0:
        logger.info("saved %d tensors to %s in %.1f s", len(state), final, time.perf_counter() - started)
    return final


def _tensors_to_write(state_dict: dict[str, Any], hf_model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Each tensor once, under the name Transformers keeps, cast to ``dtype``, without the names
    the model's ``_keys_to_ignore_on_save`` lists (as Transformers); anything that is not a
    tensor is refused (safetensors holds tensors only)."""
    others = [name for name, value in state_dict.items() if not isinstance(value, torch.Tensor)]
    if others:
        raise TypeError(f"save_pretrained writes tensors only; the state dict also holds {others}")
    ignored = set(getattr(hf_model, "_keys_to_ignore_on_save", None) or ())
    state = {}
    with torch.no_grad():
        for names in tensor_aliases({k: v for k, v in state_dict.items() if k not in ignored}, hf_model):
            value = state_dict[names[0]].detach()
            state[names[0]] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
    return state


def _finish_directory(partial: str, hf_model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The first rank's part once every rank's pieces are joined: drop the ranks' files, name a
    single file as Transformers does, write the configs."""
    shutil.rmtree(os.path.join(partial, _RANK_FILES_DIR))
    written = sorted(name for name in os.listdir(partial) if name.endswith(".safetensors"))
    if len(written) == 1:
        os.rename(os.path.join(partial, written[0]), os.path.join(partial, SAFE_WEIGHTS_NAME))
        os.remove(os.path.join(partial, SAFE_WEIGHTS_INDEX_NAME))
    config = copy.deepcopy(hf_model.config)
    # As Transformers' save_pretrained records them (an FSDP2 module's class is FSDP<cls>).
    config.architectures = [type(hf_model).__name__.removeprefix("FSDP")]
    floating = [value.dtype for value in state.values() if value.is_floating_point()]
    if floating:
        config.dtype = str(floating[0]).removeprefix("torch.")
    config.save_pretrained(partial)
    can_generate = getattr(hf_model, "can_generate", None)
    generation_config = getattr(hf_model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation_config is not None:
        generation_config.save_pretrained(partial)


def _take_place(partial: str, final: str) -> None:
    """``partial`` becomes ``final``, keeping the files of an earlier ``final`` that are not
    weights (hard links, or copies across filesystems). The two directories are exchanged in
    one step where the filesystem can (Linux ``renameat2``); else the earlier one is renamed
    to ``<final>.replaced`` for the instant between two renames, and then deleted."""
    if not os.path.isdir(final):
        os.rename(partial, final)
        return
    new = set(os.listdir(partial))
    for name in os.listdir(final):
        if name in new or _WEIGHT_FILE.fullmatch(name):
            continue
        source, target = os.path.join(final, name), os.path.join(partial, name)
        if os.path.isdir(source):
            shutil.copytree(source, target, copy_function=_link_or_copy, symlinks=True)
        else:
            _link_or_copy(source, target)
    if _exchange(partial, final):
        shutil.rmtree(partial)
        return
    replaced = final + REPLACED_SUFFIX
    shutil.rmtree(replaced, ignore_errors=True)
    os.rename(final, replaced)
    os.rename(partial, final)
    shutil.rmtree(replaced)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(first: str, second: str) -> bool:
    """Swaps two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system
    or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    done = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    return done == 0
