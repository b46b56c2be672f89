"""Hugging Face safetensors through torch.distributed.checkpoint, for sharded models.

torch's ``HuggingFaceStorageReader`` / ``HuggingFaceStorageWriter`` plan and commit Hugging Face
files with DCP; two things they do not do for megatron_fsdp's pieces are done here:

- **Reading byte ranges.** A rank's piece of a parameter is a flat range, which DCP's planner
  turns into a few rectangles (``PieceDTensor.__create_chunk_list__``), each a ``ReadItem`` with
  offsets and lengths. :class:`SafetensorsRangeReader` reads exactly those bytes of each file with
  ``pread`` (one read per contiguous run of the rectangle), straight into the piece where the file
  holds its dtype, else into one rectangle's buffer that is then cast. torch 2.13's reader reads
  the same slices through memory maps, whose touched pages stay mapped (as much again as the
  rank's share of the file) until the file is closed; its first releases read whole files.
  Which files: those ``from_pretrained`` reads (``model.safetensors``, else the index's), not
  every ``*.safetensors`` of the directory.
- **Several pieces of one tensor on one rank.** torch's writer keys each rank's file by tensor
  name, so a second rectangle of the same parameter would replace the first.
  :class:`PieceSafetensorsWriter` writes a rank's k-th rectangles of its tensors to a k-th file,
  and torch's consolidation (``enable_consolidation``) then joins every rank's rectangles into the
  files and index ``from_pretrained`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

# Transformers' file names (transformers.utils.SAFE_WEIGHTS_NAME / SAFE_WEIGHTS_INDEX_NAME).
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"

# The safetensors format's dtype names (github.com/huggingface/safetensors, "Format").
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# The header's entry of metadata strings, and the key under which DCP's writer records where a
# file's rectangle lies in its tensor (torch.distributed.checkpoint._hf_utils).
_HEADER_METADATA = "__metadata__"
_DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
_SAVED_OFFSETS = "saved_offsets"


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor (or one saved rectangle of it) lies: ``data_start`` is the absolute
    byte offset of its first element in ``path``."""

    path: str
    data_start: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    offsets: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(path: str) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header and the byte offset where its data begins."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is not a safetensors file: shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        text = handle.read(length)
    if len(text) != length:
        raise ValueError(f"{path} is truncated: its header says {length} bytes, the file holds {len(text)}")
    return json.loads(text), 8 + length


def weight_files(directory: str) -> list[str]:
    """The files ``from_pretrained`` reads in ``directory``: ``model.safetensors``, else those the
    index names; raises naming what is missing."""
    single = os.path.join(directory, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
    if not os.path.isfile(index):
        raise FileNotFoundError(
            f"{directory} holds neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}: load_pretrained reads a "
            "Hugging Face directory of safetensors (save_pretrained's); convert pytorch_model.bin weights with "
            "Transformers first (from_pretrained, then save_pretrained)"
        )
    with open(index) as handle:
        names = sorted(set(json.load(handle)["weight_map"].values()))
    missing = [name for name in names if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise FileNotFoundError(f"{index} names files that are not in {directory}: {missing}")
    return [os.path.join(directory, name) for name in names]


def stored_tensors(directory: str) -> dict[tuple[str, tuple[int, ...]], StoredTensor]:
    """(name, saved offsets) -> where it lies, for every tensor of the files ``from_pretrained``
    reads (offsets are zeros except in files DCP wrote per rank)."""
    found: dict[tuple[str, tuple[int, ...]], StoredTensor] = {}
    for path in weight_files(directory):
        header, data_start = read_header(path)
        extra = header.pop(_HEADER_METADATA, None) or {}
        sharding = json.loads(extra[_DCP_SHARDING_INFO]) if _DCP_SHARDING_INFO in extra else {}
        for name, entry in header.items():
            if entry["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, which megatron_fsdp does not read")
            shape = tuple(entry["shape"])
            offsets = tuple(sharding[name][_SAVED_OFFSETS]) if name in sharding else (0,) * len(shape)
            found[(name, offsets)] = StoredTensor(
                path, data_start + entry["data_offsets"][0], shape, SAFETENSORS_DTYPES[entry["dtype"]], offsets
            )
    return found


def contiguous_runs(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """``(first element, element count)`` in the row-major flat order of a tensor of ``shape``
    of each contiguous run of the rectangle at ``offsets`` of ``lengths``, in order."""
    if not shape:
        return [(0, 1)]
    if any(length == 0 for length in lengths):
        return []
    # The innermost dims the rectangle covers whole join the run of the dim before them.
    inner = len(shape) - 1
    while inner > 0 and offsets[inner] == 0 and lengths[inner] == shape[inner]:
        inner -= 1
    row = math.prod(shape[inner + 1 :])
    run = lengths[inner] * row
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    base = sum(o * s for o, s in zip(offsets, strides))
    runs = []
    for index in _indices(lengths[:inner]):
        runs.append((base + sum(i * s for i, s in zip(index, strides)), run))
    return runs


def _indices(lengths: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every index of a box of ``lengths``, row-major (one empty index for no dims)."""
    found: list[tuple[int, ...]] = [()]
    for length in lengths:
        found = [index + (i,) for index in found for i in range(length)]
    return found


def _pread_exactly(fd: int, view: memoryview, offset: int, path: str) -> None:
    while len(view):
        count = os.preadv(fd, [view], offset)
        if count == 0:
            raise EOFError(f"{path} ended before byte {offset}: the file is truncated")
        view, offset = view[count:], offset + count


class SafetensorsRangeReader(HuggingFaceStorageReader):
    """torch's Hugging Face reader that reads only each ``ReadItem``'s bytes (see the module
    docstring). ``bytes_read``: what the last ``read_data`` read, counted per call."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.directory = str(path)
        self.bytes_read = 0
        self._stored: dict[tuple[str, tuple[int, ...]], StoredTensor] = {}

    def read_metadata(self) -> Metadata:
        """torch's metadata of the directory, kept to the files ``from_pretrained`` reads."""
        metadata = super().read_metadata()
        self._stored = stored_tensors(self.directory)
        chunks: dict[str, list[ChunkStorageMetadata]] = defaultdict(list)
        for (name, offsets), stored in self._stored.items():
            chunks[name].append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(stored.shape)))
        metadata.state_dict_metadata = {
            name: dataclasses.replace(entry, chunks=chunks[name])
            for name, entry in metadata.state_dict_metadata.items()
            if name in chunks
        }
        metadata.storage_data = {
            index: data for index, data in metadata.storage_data.items() if (index.fqn, tuple(index.offset)) in self._stored
        }
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self._stored:
            self._stored = stored_tensors(self.directory)
        by_file: dict[str, list[tuple[ReadItem, StoredTensor]]] = defaultdict(list)
        for item in plan.items:
            stored = self._stored[(item.storage_index.fqn, tuple(item.storage_index.offset))]
            by_file[stored.path].append((item, stored))
        for path, items in by_file.items():
            fd = os.open(path, os.O_RDONLY)
            try:
                for item, stored in items:
                    self._read_item(fd, item, stored, planner)
            finally:
                os.close(fd)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_item(self, fd: int, item: ReadItem, stored: StoredTensor, planner: LoadPlanner) -> None:
        target = planner.resolve_tensor(item).detach()
        lengths = tuple(item.lengths)
        if tuple(target.shape) != lengths:
            raise RuntimeError(f"{item.dest_index.fqn}: DCP planned {lengths} elements into a tensor of shape {tuple(target.shape)}")
        direct = target.dtype == stored.dtype and target.device.type == "cpu" and target.is_contiguous()
        buffer = target if direct else torch.empty(lengths, dtype=stored.dtype)
        flat = buffer.reshape(-1).view(torch.uint8).numpy()
        view, size, position = memoryview(flat), stored.dtype.itemsize, 0
        for first, count in contiguous_runs(stored.shape, tuple(item.storage_offsets), lengths):
            _pread_exactly(fd, view[position : position + count * size], stored.data_start + first * size, stored.path)
            position += count * size
        self.bytes_read += position
        if not direct:
            target.copy_(buffer)
        planner.commit_tensor(item, target)


class PieceSafetensorsWriter(HuggingFaceStorageWriter):
    """torch's Hugging Face writer, every rank writing its pieces (``save_distributed``) and the
    coordinator joining them into Hugging Face's files (``enable_consolidation``), where a rank
    may hold several rectangles of one tensor (see the module docstring).
    ``fqn_to_index_mapping``: tensor name -> output file, 1 to N."""

    def __init__(self, path: str, fqn_to_index_mapping: dict[str, int]) -> None:
        super().__init__(path, fqn_to_index_mapping=fqn_to_index_mapping, save_distributed=True, enable_consolidation=True)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        planned = super().prepare_global_plan(plans)
        return [dataclasses.replace(plan, storage_data={**plan.storage_data, "ranks": len(plans)}) for plan in planned]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # Round k holds each tensor's k-th rectangle of this rank, written as files of their own:
        # shard index (as torch's writer numbers the ranks' files) + k * ranks.
        rounds: list[list[Any]] = []
        seen: dict[str, int] = defaultdict(int)
        for item in plan.items:
            k = seen[item.index.fqn]
            seen[item.index.fqn] += 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(item)
        if len(rounds) <= 1:
            return super().write_data(plan, planner)
        results: list[WriteResult] = []
        storage = plan.storage_data
        for k, items in enumerate(rounds):
            shard = storage["shard_index"] + k * storage["ranks"]
            written = super().write_data(dataclasses.replace(plan, items=items, storage_data={**storage, "shard_index": shard}), planner)
            results.extend(written.wait())
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done
