"""Saving and loading training checkpoints safely, and exporting full weights.

``save_checkpoint`` writes ``<dir>/step_<N>`` with torch.distributed.checkpoint into
``step_<N>.partial`` first, adds the manifest of its files' checksums
(``checkpoint_integrity``), renames it when every rank has finished, and only then points
``<dir>/latest`` at it (an atomic file replace). A save that fails or is killed at any moment
leaves ``latest`` naming the previous complete checkpoint. ``load_checkpoint`` verifies the
files against the manifest before reading anything into the model, and with ``fallback=True``
walks back to the newest checkpoint that verifies. Loading runs no code that came with a checkpoint
(``safe_reader``, ``weights_only``): what it would have to run is refused, on every rank, before the
model or the optimizer is touched; saving refuses ``extra_state`` that loading would refuse.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megatron_fsdp.checkpoint.agreement import first_problem_of_any_rank
from megatron_fsdp.checkpoint.integrity import (
    MANIFEST,
    MANIFEST_KEY,
    CheckpointCorruptError,
    ChecksummingWriter,
    verify_checkpoint,
    write_manifest,
)
from megatron_fsdp.checkpoint.safe_reader import METADATA_FILE, SafeFileSystemReader, read_metadata_safely, screen_items
from megatron_fsdp.checkpoint.state_dicts import check_keys, fqn_keyed_optimizer_state_dict
from megatron_fsdp.checkpoint.weights_only import UnsafeCheckpointError, load_weights_only, serialize_weights_only
from megatron_fsdp.engine.step.sharded_model import ShardedModel

logger = logging.getLogger(__name__)

LATEST = "latest"
EXTRA_STATE = "extra_state.pt"
CORRUPT_SUFFIX = ".corrupt"


def _step_dir(checkpoint_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir, f"step_{step:08d}")


def latest_checkpoint_step(checkpoint_dir: str) -> int | None:
    """The step of the newest complete checkpoint in ``checkpoint_dir``, or None."""
    path = os.path.join(checkpoint_dir, LATEST)
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise ValueError(
            f"{path} holds {text!r}, not a step number: write the step of a complete checkpoint "
            f"into it (save_checkpoint replaces it atomically), or delete it to start afresh"
        )
    return int(text)


def _training_state(
    model: ShardedModel, optimizer: torch.optim.Optimizer | None, saved_keys: set[str] | None = None
) -> dict[str, Any]:
    """What a checkpoint holds: the optimizer state keyed by FQN (as torch's state-dict helpers
    and torchtitan write it), or by position where ``saved_keys`` (a checkpoint's) show a
    ``dcp.save`` of ``optimizer.state_dict()``."""
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        by_position = optimizer.state_dict()
        by_fqn = fqn_keyed_optimizer_state_dict(by_position, optimizer, model)
        first_fqn = next(iter(by_fqn["state"]), None)
        saved_by_position = (
            saved_keys is not None
            and first_fqn is not None
            and not any(key.startswith(f"optimizer.state.{first_fqn}.") for key in saved_keys)
        )
        state["optimizer"] = by_position if saved_by_position else by_fqn
    return state


def save_checkpoint(
    checkpoint_dir: str,
    step: int,
    model: ShardedModel,
    optimizer: torch.optim.Optimizer | None = None,
    extra_state: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> str:
    """Saves model and optimizer (and ``extra_state``, e.g. an LR scheduler's or a data
    loader's, written by rank 0 with ``torch.save``) as step ``step``, with a manifest of the
    files' checksums; a collective. ``extra_state`` must load with ``torch.load(weights_only=True)``
    (numbers, strings, containers, tensors, numpy arrays, state dicts of these, torch's, numpy's
    and Python's RNG states): anything else raises ``ValueError`` on every rank before anything is
    written. With ``keep_last`` (default None: keep all), deletes all but the newest ``keep_last``
    checkpoints once this one is committed. Returns the checkpoint's directory."""
    final = _step_dir(checkpoint_dir, step)
    partial = final + ".partial"
    rank = dist.get_rank()
    extra_bytes = _serialized_extra_state(extra_state)
    if rank == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier save that died
    dist.barrier()
    writer = ChecksummingWriter(partial)
    dcp.save({**_training_state(model, optimizer), MANIFEST_KEY: MANIFEST}, storage_writer=writer)
    checksums = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(writer.checksums(), checksums, dst=0)
    if rank == 0:
        if extra_bytes is not None:
            with open(os.path.join(partial, EXTRA_STATE), "wb") as handle:
                handle.write(extra_bytes)
        write_manifest(partial, step, checksums)  # last: a checkpoint is complete once it has one
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(partial, final)
        _point_latest_at(checkpoint_dir, step)
        if keep_last is not None:
            _prune(checkpoint_dir, keep_last)
        logger.info("saved checkpoint %s", final)
    dist.barrier()
    return final


def _serialized_extra_state(extra_state: dict[str, Any] | None) -> bytes | None:
    """Rank 0's ``extra_state`` as it will be written (None on the other ranks); a collective:
    raises ``ValueError`` on every rank when loading would refuse it (only rank 0's is written,
    so only rank 0 knows)."""
    serialized, refusal = None, [None]
    if dist.get_rank() == 0 and extra_state is not None:
        try:
            serialized = serialize_weights_only(extra_state, "save_checkpoint's extra_state")
        except ValueError as error:
            refusal[0] = str(error)
        except Exception as error:  # noqa: BLE001 - unpicklable: the other ranks must hear of it too
            refusal[0] = f"save_checkpoint's extra_state cannot be pickled ({type(error).__name__}: {error})"
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise ValueError(refusal[0])
    return serialized


def _point_latest_at(checkpoint_dir: str, step: int) -> None:
    temporary = os.path.join(checkpoint_dir, LATEST + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(f"{step}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(checkpoint_dir, LATEST))


def _committed_steps(checkpoint_dir: str) -> list[int]:
    """Steps of the committed checkpoints (not ``.partial`` or ``.corrupt`` ones), oldest first."""
    return sorted(int(name[5:]) for name in os.listdir(checkpoint_dir) if name.startswith("step_") and name[5:].isdigit())


def _prune(checkpoint_dir: str, keep_last: int) -> None:
    steps = _committed_steps(checkpoint_dir)
    for old in steps[: max(len(steps) - keep_last, 0)]:
        shutil.rmtree(_step_dir(checkpoint_dir, old), ignore_errors=True)


def check_checkpoint_fits(path: str, model: ShardedModel, metadata: Metadata | None = None) -> set[str]:
    """Raises naming every missing, unexpected and mis-shaped model tensor of the checkpoint at
    ``path`` (whose DCP ``metadata`` it reads, restricted, unless given) before anything is read
    into the model; returns every key the checkpoint holds."""
    if metadata is None:
        metadata = read_metadata_safely(os.path.join(path, METADATA_FILE))
    saved = {
        key[len("model.") :]: md.size
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    expected = {key: getattr(value, "shape", None) for key, value in model.state_dict().items()}
    check_keys(expected, saved, True, f"checkpoint {path}")
    return set(metadata.state_dict_metadata)


def load_checkpoint(
    checkpoint_dir: str,
    model: ShardedModel,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    verify: bool = True,
    fallback: bool = False,
) -> tuple[int, dict[str, Any] | None] | None:
    """Loads step ``step`` (default None: the latest) into model and optimizer; a collective.
    Returns ``(step, extra_state)``, or None when there is no checkpoint yet.

    Nothing that came with the checkpoint is run: an object that loading would have to run code
    to rebuild raises :class:`UnsafeCheckpointError` on every rank before model and optimizer are
    touched (docs/checkpointing.md says what loads).

    ``verify`` (default True) checks every file against the checkpoint's manifest first and
    raises :class:`CheckpointCorruptError` on every rank, leaving model and optimizer as they
    were, when one does not match; False skips that. ``fallback`` (default False; needs
    ``verify``) instead walks back to the newest older checkpoint that verifies, logs each one it
    skipped, renames those to ``step_<N>.corrupt`` and points ``latest`` at the one it loaded."""
    if fallback and not verify:
        raise ValueError("load_checkpoint: fallback=True needs verify=True (without checksums nothing is found corrupt)")
    candidates = _candidate_steps(checkpoint_dir, step, fallback)
    if not candidates:
        return None
    rank = dist.get_rank()
    skipped: list[CheckpointCorruptError] = []
    for candidate in candidates:
        path = _step_dir(checkpoint_dir, candidate)
        try:
            saved_without_manifest = verify and not verify_checkpoint(path, candidate)
        except CheckpointCorruptError as error:
            if not fallback:
                raise
            skipped.append(error)
            if rank == 0:
                logger.warning("skipping checkpoint step %d: rank %d found %s: %s", candidate, error.rank, error.file, error.reason)
            continue
        if rank == 0 and saved_without_manifest:
            logger.warning("checkpoint %s has no manifest (saved by an older megatron_fsdp): loading it unverified", path)
        if rank == 0 and skipped:
            _set_aside(checkpoint_dir, [error.step for error in skipped], candidate)
        return candidate, _load(path, model, optimizer)
    newest_error = skipped[0]
    raise CheckpointCorruptError(
        newest_error.step, newest_error.path, newest_error.file, newest_error.rank, newest_error.reason,
        advice=f"No older checkpoint in {checkpoint_dir} verifies either (tried steps {candidates}): restore one or start afresh",
    )


def _candidate_steps(checkpoint_dir: str, step: int | None, fallback: bool) -> list[int]:
    """The steps to try, newest first, as rank 0 reads them: every rank must load the same step,
    and ``latest`` may be replaced between two ranks' reads. A malformed ``latest`` raises on
    every rank."""
    decided: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            newest = latest_checkpoint_step(checkpoint_dir) if step is None else step
            if newest is None:
                decided[0] = []
            else:
                older = [s for s in reversed(_committed_steps(checkpoint_dir)) if s < newest] if fallback else []
                decided[0] = [newest] + older
        except (OSError, ValueError) as error:
            decided[0] = error
    dist.broadcast_object_list(decided, src=0)
    if isinstance(decided[0], Exception):
        raise decided[0]
    return decided[0]


def _set_aside(checkpoint_dir: str, corrupt_steps: list[int], loaded_step: int) -> None:
    """Renames corrupt checkpoints out of the way (kept for inspection, never pruned or loaded)
    and points ``latest`` at the checkpoint loaded instead, if it named a corrupt one. Rank 0
    alone: a failure is logged, not raised, so the other ranks are not left waiting."""
    try:
        latest = latest_checkpoint_step(checkpoint_dir)
        for corrupt in corrupt_steps:
            path = _step_dir(checkpoint_dir, corrupt)
            if not os.path.isdir(path):  # a deleted checkpoint (latest named it)
                continue
            shutil.rmtree(path + CORRUPT_SUFFIX, ignore_errors=True)
            os.rename(path, path + CORRUPT_SUFFIX)
            logger.warning("renamed the corrupt checkpoint %s to %s", path, path + CORRUPT_SUFFIX)
        if latest in corrupt_steps:
            _point_latest_at(checkpoint_dir, loaded_step)
    except OSError as error:
        logger.warning("could not set the corrupt checkpoints of %s aside: %s", checkpoint_dir, error)


def _load(path: str, model: ShardedModel, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    reader = SafeFileSystemReader(path)
    metadata, extra = _read_without_running_code(path, reader)
    saved_keys = check_checkpoint_fits(path, model, metadata)
    state = _training_state(model, optimizer, saved_keys)
    dcp.load(state, storage_reader=reader)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    logger.info("loaded checkpoint %s", path)
    return extra


def _read_without_running_code(path: str, reader: SafeFileSystemReader) -> tuple[Metadata, dict[str, Any] | None]:
    """The checkpoint's DCP metadata and extra state, after every rank unpickled its share of the
    data files' items as the load will (tensors without their data), so that an item the load
    would refuse raises on every rank before anything reaches the model or the optimizer. A
    collective: one rank's problem (refused, or unreadable) raises the same error on all."""
    problem: tuple[str, list[str] | None] | None = None  # (message, refused globals; None: unreadable)
    metadata, extra = None, None
    try:
        metadata = reader.read_metadata()
        screen_items(path, metadata, dist.get_rank(), dist.get_world_size())
        extra_path = os.path.join(path, EXTRA_STATE)
        extra = load_weights_only(extra_path, extra_path) if os.path.exists(extra_path) else None
    except UnsafeCheckpointError as error:
        problem = (str(error), error.refused)
    except Exception as error:  # noqa: BLE001 - a rank that raised alone would leave the others waiting
        reason = f"checkpoint {path} cannot be read ({type(error).__name__}: {error}); with verify=True, load_checkpoint names a damaged file"
        problem = (reason, None)
    found = first_problem_of_any_rank(problem)
    if found is not None:
        rank, (message, refused) = found
        if refused is None:
            raise RuntimeError(f"rank {rank} found: {message}")
        raise UnsafeCheckpointError(f"rank {rank} found: {message}", refused)
    return metadata, extra


@torch.no_grad()
def full_state_dict(
    model: ShardedModel, rank0_only: bool = True, cpu_offload: bool = True, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter and buffer at full size under its FQN (tied parameters under each name);
    a collective. Gathered bucket by bucket and, with ``cpu_offload``, moved to the CPU at once,
    so the extra device memory is one bucket. Trainable parameters come from the main weights.
    With ``rank0_only`` the other ranks return an empty dict."""
    keep = not rank0_only or dist.get_rank() == 0
    names = {}
    for name, param in model.module.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    gathered: dict[str, torch.Tensor] = {}
    for unit in model.units:
        for bucket in unit.buckets:
            full = bucket.gather_full(bucket.checkpoint_source()[0])
            for param, extent, value in zip(bucket.params, bucket.extents, bucket.split_full(full)):
                value = extent.to_global(value)  # tensor-/expert-parallel: a collective
                if keep:
                    value = value.to(dtype) if dtype is not None else value
                    value = value.cpu() if cpu_offload else value.clone()
                    for alias_index, name in enumerate(names[param]):
                        gathered[name] = value if alias_index == 0 else value.clone()
            del full
    if not keep:
        return {}
    result = {}
    for key, value in model.module.state_dict(keep_vars=True).items():
        if key in gathered:
            result[key] = gathered[key]
        else:
            result[key] = value.detach().cpu() if cpu_offload else value.detach().clone()
    return result


def export_safetensors(model: ShardedModel, path: str, dtype: torch.dtype | None = None) -> None:
    """Writes the full weights (see :func:`full_state_dict`) as one safetensors file that
    ``safetensors.torch.load_file`` and Hugging Face ``from_pretrained`` read; rank 0 writes,
    through a temporary file, so a failed export leaves no half-written file. A collective."""
    from safetensors.torch import save_file

    state = full_state_dict(model, rank0_only=True, cpu_offload=True, dtype=dtype)
    if dist.get_rank() == 0:
        temporary = path + ".tmp"
        save_file({k: v.contiguous() for k, v in state.items()}, temporary, metadata={"format": "pt"})
        os.replace(temporary, path)
        logger.info("exported %d tensors to %s", len(state), path)
    dist.barrier()
