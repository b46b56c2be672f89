"""Checksums of checkpoint files, and their verification before a load.

A checkpoint written by ``save_checkpoint`` holds ``manifest.json``: every file of the checkpoint
with its size and the CRC-32C (the C++ ``crc32c`` op) of each of its segments. A DCP data file's
segments are its storage items, one tensor chunk or pickled object each, named by their key, so
a bad byte is traced to the tensor it belongs to; every other file is one segment. The manifest
is written last, just before the commit, from the bytes the files hold at that moment.

``verify_checkpoint`` checks every file against it, each file on one rank, and agrees on the
outcome with one small collective, so every rank raises the same :class:`CheckpointCorruptError`
or none does. A checkpoint whose DCP state carries the ``manifest`` key must have a manifest; one
without the key was saved before manifests existed and cannot be checked.
"""

from __future__ import annotations

import json
import mmap
import os
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from megatron_fsdp import _ops
from megatron_fsdp.checkpoint.agreement import first_problem_of_any_rank
from megatron_fsdp.checkpoint.safe_reader import SafeFileSystemReader

MANIFEST = "manifest.json"
# A key of the DCP state saved with a manifest; its value names the manifest file. Plain
# dcp.load ignores it, and it tells a deleted manifest from a checkpoint that never had one.
MANIFEST_KEY = "manifest"
_FORMAT = 1
_METADATA = ".metadata"
# Bytes of a file mapped at a time while checksumming it: its pages count as this process's
# memory while mapped, and a rank's file can be tens of GB.
_WINDOW_BYTES = 256 << 20


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's files do not match its manifest (a flipped byte, a truncated or missing
    file), or its manifest or ``.metadata`` cannot be read. Raised on every rank alike, before
    anything was read into the model or optimizer.

    Attributes: ``step``, ``path`` (the checkpoint's directory), ``file`` (relative to it),
    ``rank`` (the rank that found it), ``reason``."""

    def __init__(self, step: int, path: str, file: str, rank: int, reason: str, advice: str | None = None) -> None:
        self.step, self.path, self.file, self.rank, self.reason = step, path, file, rank, reason
        advice = advice or "load_checkpoint(..., fallback=True) resumes from the newest intact checkpoint"
        super().__init__(f"checkpoint step {step} ({path}) is corrupt: rank {rank} found {file}: {reason}. {advice}")


def checksum_segments(path: str, items: list[tuple[int, int, str | None]]) -> dict[str, Any]:
    """The manifest entry of the file at ``path``: its size and the CRC of each segment, the
    ``(offset, length, name)`` items plus any bytes between or after them, so every byte is
    covered (DCP's safetensors format, for one, writes a header outside its items)."""
    size = os.path.getsize(path)
    segments: list[tuple[int, int, str | None]] = []
    cursor = 0
    for offset, length, name in sorted(items, key=lambda item: item[0]):
        if offset > cursor:
            segments.append((cursor, offset - cursor, None))
        segments.append((offset, length, name))
        cursor = offset + length
    if size > cursor:
        segments.append((cursor, size - cursor, None))
    crcs = _segment_crcs(path, size, [(offset, length) for offset, length, _ in segments])
    return {"size": size, "segments": [[o, n, crc, name] for (o, n, name), crc in zip(segments, crcs)]}


def _segment_crcs(path: str, size: int, segments: list[tuple[int, int]]) -> list[int]:
    """The CRC of each ``(offset, length)`` segment of the file, read through memory maps of
    ``_WINDOW_BYTES`` (the page cache's pages, not copies), a segment across windows continued."""
    crcs = [0] * len(segments)
    with open(path, "rb") as handle:
        os.posix_fadvise(handle.fileno(), 0, size, os.POSIX_FADV_WILLNEED)  # one read-ahead, not page by page
        for start in range(0, size, _WINDOW_BYTES):
            end = min(size, start + _WINDOW_BYTES)
            with mmap.mmap(handle.fileno(), end - start, access=mmap.ACCESS_COPY, offset=start) as window:
                data = torch.frombuffer(window, dtype=torch.uint8)
                for index, (offset, length) in enumerate(segments):
                    low, high = max(offset, start), min(offset + length, end)
                    if low < high:
                        crcs[index] = _ops.crc32c(data[low - start : high - start], crcs[index])
                del data  # the map cannot close while a tensor views it
    return crcs


def _item_name(index: MetadataIndex) -> str:
    return index.fqn if index.offset is None else f"{index.fqn}, chunk at {list(index.offset)}"


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer, which also checksums the files this rank wrote, item by item."""

    _written: Future[list[WriteResult]]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._written = super().write_data(plan, planner)
        return self._written

    def checksums(self) -> dict[str, dict[str, Any]]:
        """Manifest entries of this rank's files; call after ``dcp.save`` returned."""
        items: dict[str, list[tuple[int, int, str | None]]] = {}
        for result in self._written.value():
            info = result.storage_data
            items.setdefault(info.relative_path, []).append((info.offset, info.length, _item_name(result.index)))
        return {name: checksum_segments(os.path.join(self.path, name), found) for name, found in items.items()}


def write_manifest(path: str, step: int, rank_entries: list[dict[str, dict[str, Any]]]) -> None:
    """Writes the manifest of the checkpoint in ``path`` atomically: the ranks' entries of their
    data files, plus one whole-file entry for each other file (``.metadata``, extra state)."""
    files: dict[str, dict[str, Any]] = {}
    for entries in rank_entries:
        files.update(entries)
    for name in sorted(os.listdir(path)):
        if name not in files and name != MANIFEST:
            files[name] = checksum_segments(os.path.join(path, name), [])
    manifest = {"format": _FORMAT, "step": step, "checksum": "crc32c", "files": files, "files_crc32c": _files_crc(files)}
    temporary = os.path.join(path, MANIFEST + ".tmp")
    with open(temporary, "w") as handle:
        json.dump(manifest, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(path, MANIFEST))


def verify_checkpoint(path: str, step: int) -> bool:
    """Checks every file of the checkpoint in ``path`` against its manifest, before anything is
    loaded; a collective. Raises :class:`CheckpointCorruptError` on every rank when any rank
    finds a problem. Returns False for a checkpoint saved without a manifest (nothing to check)."""
    manifest, problem = _read_manifest(path)
    if manifest is not None:
        files = manifest["files"]
        for name in _my_share(files, dist.get_rank(), dist.get_world_size()):
            problem = _check_file(os.path.join(path, name), name, files[name])
            if problem is not None:
                break
    _raise_if_any_rank_found(problem, path, step)
    return manifest is not None


def _read_manifest(path: str) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
    """The manifest, or None and a problem ``(file, reason)``; (None, None) for a checkpoint
    saved without one."""
    try:
        with open(os.path.join(path, MANIFEST)) as handle:
            manifest = json.load(handle)
    except FileNotFoundError:
        return None, _problem_without_manifest(path)
    except (OSError, ValueError) as error:  # ValueError: bytes that are not JSON
        return None, (MANIFEST, f"it cannot be read ({error})")
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or not isinstance(manifest.get("files"), dict):
        return None, (MANIFEST, f"it is not a format-{_FORMAT} manifest")
    if manifest.get("files_crc32c") != _files_crc(manifest["files"]):
        return None, (MANIFEST, "it does not match its own checksum")
    return manifest, None


def _problem_without_manifest(path: str) -> tuple[str, str] | None:
    try:
        saved_keys = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as error:  # noqa: BLE001 - unpickling damaged or forged bytes raises anything
        return _METADATA, f"it cannot be read ({type(error).__name__}: {error})"
    if MANIFEST_KEY in saved_keys:
        return MANIFEST, "it is missing, but the checkpoint was saved with one"
    return None


def _files_crc(files: dict[str, Any]) -> int:
    """The manifest's own checksum, so that a damaged manifest is not trusted."""
    return _ops.crc32c(torch.frombuffer(bytearray(json.dumps(files, sort_keys=True).encode()), dtype=torch.uint8))


def _my_share(files: dict[str, dict[str, Any]], rank: int, world: int) -> list[str]:
    """The files this rank checks: each file goes to the rank with the fewest bytes so far,
    largest files first, the same split on every rank."""
    load = [0] * world
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        owner = min(range(world), key=load.__getitem__)
        load[owner] += files[name]["size"]
        if owner == rank:
            mine.append(name)
    return mine


def _check_file(path: str, name: str, entry: dict[str, Any]) -> tuple[str, str] | None:
    """A problem ``(file, reason)`` of one file, or None. Never raises: a rank that did would
    leave the others waiting in the collective."""
    try:
        size = os.path.getsize(path)
        if size != entry["size"]:
            state = "truncated" if size < entry["size"] else "longer than written"
            return name, f"it is {state}: {size} bytes, the manifest says {entry['size']}"
        segments = entry["segments"]
        crcs = _segment_crcs(path, size, [(offset, length) for offset, length, _, _ in segments])
    except FileNotFoundError:
        return name, "it is missing"
    except (OSError, ValueError) as error:  # ValueError: the file shrank before it was mapped
        return name, f"it cannot be read ({error})"
    for (offset, length, expected, item), found in zip(segments, crcs):
        if found != expected:
            what = f"bytes {offset}..{offset + length}" + (f" ({item})" if item is not None else "")
            return name, f"{what} have CRC-32C {found:08x}, the manifest says {expected:08x}"
    return None


def _raise_if_any_rank_found(problem: tuple[str, str] | None, path: str, step: int) -> None:
    """Every rank raises the first rank's problem, or none does."""
    found = first_problem_of_any_rank(problem)
    if found is not None:
        rank, (file, reason) = found
        raise CheckpointCorruptError(step, path, file, rank, reason)
