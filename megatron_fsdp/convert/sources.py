"""Reading a checkpoint one tensor (or one region of a tensor) at a time, without a model.

A DCP directory (ours, Megatron-LM's ``fsdp_dtensor`` and ``torch_dist``) describes every tensor
by its global shape and dtype in ``.metadata``, whatever world size and TP/PP/EP layout wrote
it; :class:`DcpSource` reads a tensor, or a box of it, through torch's ``dcp.load`` with a
planner that asks only for that box, so what is in memory is the box plus one stored chunk.
A Hugging Face directory (``*.safetensors``, with or without an index) is read through
safetensors' own ``safe_open``. Nothing read here runs code that came with the checkpoint:
``.metadata`` and non-tensor items are unpickled by restricted unpicklers (``inert_pickle``).
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_fsdp.checkpoint.safe_reader import METADATA_FILE, SafeFileSystemReader, read_metadata_safely
from megatron_fsdp.checkpoint.safetensors_storage import SAFETENSORS_DTYPES
from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.inert_pickle import unpickle_inertly

SAFETENSORS_INDEX = "model.safetensors.index.json"
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"
OURS_LATEST = "latest"
# Megatron-LM's torch_dist directories: the sharded-backend marker, and the common (non-sharded)
# state: a ShardedObject item of the DCP files (megatron-core 0.19: ``torch.save([state])``), or
# the older ``common.pt`` beside them.
TORCH_DIST_MARKER = "metadata.json"
TORCH_DIST_COMMON_ITEM = "common_state/shard_0_1"
TORCH_DIST_COMMON_FILE = "common.pt"

# Slices (a box) or indices (a box one long there, that dimension dropped) of leading dimensions.
Region = tuple[slice | int, ...]


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's global shape and dtype, as the checkpoint stores it."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


class Source(Protocol):
    """A checkpoint read tensor by tensor."""

    path: str
    format: str  # "dcp", "torch_dist" or "huggingface"
    tensors: dict[str, TensorInfo]

    def read(self, name: str, region: Region | None = None) -> torch.Tensor: ...

    def read_object(self, name: str) -> Any: ...


class _RegionPlanner(DefaultLoadPlanner):
    """Loads one box of one tensor into ``state_dict[fqn]`` (a tensor of the box's shape): read
    items only for the stored chunks that overlap the box."""

    def __init__(self, fqn: str, offsets: tuple[int, ...]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._fqn, self._offsets = fqn, offsets

    def create_local_plan(self) -> LoadPlan:
        target = self.state_dict[self._fqn]
        box = ChunkStorageMetadata(offsets=torch.Size(self._offsets), sizes=target.shape)
        stored = self.metadata.state_dict_metadata[self._fqn]
        return LoadPlan(create_read_items_for_chunk_list(self._fqn, stored, [box]))

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


class _CachedMetadataReader(SafeFileSystemReader):
    """``SafeFileSystemReader`` that unpickles ``.metadata`` once for all the loads of a conversion."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


def _box(region: Region | None, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Offsets and sizes of ``region`` in a tensor of ``shape``, and the shape of what it reads
    (without the dimensions an index picked)."""
    region = region or ()
    offsets, sizes, kept = [], [], []
    for dim, size in enumerate(shape):
        part = region[dim] if dim < len(region) else slice(None)
        if isinstance(part, int):
            offsets.append(part)
            sizes.append(1)
            continue
        start, stop, step = part.indices(size)
        if step != 1:
            raise ValueError(f"a region is a box: slice {part} has step {step}")
        offsets.append(start)
        sizes.append(max(stop - start, 0))
        kept.append(sizes[-1])
    return tuple(offsets), tuple(sizes), tuple(kept)


_STEP_DIRS = ("step_{:08d}", "iter_{:07d}")  # ours, Megatron-LM's


def _saved_steps(path: str) -> list[str]:
    return sorted(name for name in os.listdir(path) if re.fullmatch(r"(step|iter)_\d+|release", name))


def resolve_checkpoint_dir(path: str, step: int | None = None) -> str:
    """``path`` itself, its checkpoint of ``step`` (ours: ``step_<N>``, Megatron-LM's:
    ``iter_<N>``, or ``release`` for 0), or else the checkpoint a ``latest`` pointer in it names:
    ours (``latest`` -> ``step_<N>``) or Megatron-LM's (``latest_checkpointed_iteration.txt`` ->
    ``iter_<N>``)."""
    if os.path.isfile(os.path.join(path, METADATA_FILE)) or not os.path.isdir(path):
        named = re.fullmatch(r"(?:step|iter)_(\d+)", os.path.basename(os.path.normpath(path)))
        if step is not None and named is not None and int(named.group(1)) != step:
            raise ConversionError(f"{path} is the checkpoint of step {int(named.group(1))}, not --step {step}: give its parent directory, or leave --step out")
        return path
    if step is not None:
        for directory in (*_STEP_DIRS, *(("release",) if step == 0 else ())):
            candidate = os.path.join(path, directory.format(step))
            if os.path.isdir(candidate):
                return candidate
        raise ConversionError(f"{path} holds no checkpoint of step {step} (it holds {_saved_steps(path) or 'none'}): choose one of those with --step")
    for pointer, directory in zip((OURS_LATEST, MEGATRON_LATEST), _STEP_DIRS):
        pointer_path = os.path.join(path, pointer)
        if os.path.isfile(pointer_path):
            with open(pointer_path) as handle:
                text = handle.read().strip()
            if text.isdigit():
                return os.path.join(path, directory.format(int(text)))
            if text == "release":  # Megatron-LM's name for a converted, iteration-less checkpoint
                return os.path.join(path, "release")
    return path


class DcpSource:
    """A torch.distributed.checkpoint directory: ours, Megatron-LM's ``fsdp_dtensor``, or its
    ``torch_dist`` (whose non-tensor state sits in ``common.pt`` beside the DCP files)."""

    def __init__(self, path: str) -> None:
        self.path = path
        metadata_path = os.path.join(path, METADATA_FILE)
        if not os.path.isfile(metadata_path):
            raise ConversionError(
                f"{path} is not a torch.distributed.checkpoint directory: it has no {METADATA_FILE}. "
                f"Give the directory of one checkpoint (ours: <dir>/step_<N>, or <dir> with its '{OURS_LATEST}'; "
                f"Megatron-LM: <save>/iter_<N>, or <save> with its {MEGATRON_LATEST}), or a Hugging Face directory "
                f"with *.safetensors"
            )
        self.metadata = read_metadata_safely(metadata_path)
        self.format = "torch_dist" if os.path.isfile(os.path.join(path, TORCH_DIST_MARKER)) else "dcp"
        self.tensors = {
            fqn: TensorInfo(tuple(entry.size), entry.properties.dtype)
            for fqn, entry in self.metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
        }
        self.objects = [
            fqn for fqn, entry in self.metadata.state_dict_metadata.items() if isinstance(entry, BytesStorageMetadata)
        ]
        self._reader = _CachedMetadataReader(path, self.metadata)
        self._common: dict[str, Any] | None = None

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """The tensor ``name`` (or the box ``region`` of it: slices of its leading dimensions)."""
        info = self.tensors[name]
        offsets, sizes, kept = _box(region, info.shape)
        target = torch.empty(sizes, dtype=info.dtype)
        try:
            dcp.load({name: target}, storage_reader=self._reader, planner=_RegionPlanner(name, offsets), no_dist=True)
        except CheckpointException as error:
            files = sorted({self.metadata.storage_data[index].relative_path for index in self._chunks_of(name)})
            cause = str(error).strip().splitlines()[-1]
            raise ConversionError(
                f"reading {name} from {files} in {self.path} failed ({cause}): the checkpoint's data files are damaged "
                f"or incomplete; convert an intact copy"
            ) from None
        return target.reshape(kept)

    def _chunks_of(self, name: str) -> list[MetadataIndex]:
        return [index for index in self.metadata.storage_data if index.fqn == name]

    def read_object(self, name: str) -> Any:
        """A non-tensor item (Megatron-LM's ``args``, ``iteration``...), from the DCP files or, for
        ``torch_dist``, from ``common.pt``; None when the checkpoint has none of that name."""
        if self.format == "torch_dist":
            return self._common_state().get(name)
        return self.read_item(name)

    def read_item(self, name: str) -> Any:
        """A non-tensor item of the DCP files themselves (None when there is none of that name)."""
        if name not in self.objects:
            # DCP flattens a saved dict into one item per key (Megatron-LM's opt_param_scheduler)
            nested = {item[len(name) + 1 :]: self.read_item(item) for item in self.objects if item.startswith(name + ".")}
            return nested or None
        info = self.metadata.storage_data[MetadataIndex(name)]
        if info.transform_descriptors:
            raise ConversionError(f"{self.path}: the item {name} was written through DCP's stream transforms, which are not read here")
        with open(os.path.join(self.path, info.relative_path), "rb") as handle:
            handle.seek(info.offset)
            data = handle.read(info.length)
        value = unpickle_inertly(data, f"the item {name} of {self.path}")
        if isinstance(value, io.BytesIO):  # bytes DCP's default planner pickled once more (megatron-core's does not)
            value = unpickle_inertly(value.getvalue(), f"the item {name} of {self.path}")
        return value

    def _common_state(self) -> dict[str, Any]:
        if self._common is None:
            path = os.path.join(self.path, TORCH_DIST_COMMON_FILE)
            if os.path.isfile(path):
                self._common = unpickle_inertly(path, path)
            else:
                packed = self.read_item(TORCH_DIST_COMMON_ITEM)
                self._common = packed[0] if isinstance(packed, list) else (packed or {})
        return self._common


class HuggingFaceSource:
    """A Hugging Face model directory: ``*.safetensors`` files (with ``model.safetensors.index.json``
    when sharded) and ``config.json``."""

    format = "huggingface"

    def __init__(self, path: str) -> None:
        self.path = path
        index_path = os.path.join(path, SAFETENSORS_INDEX)
        if os.path.isfile(index_path):
            with open(index_path) as handle:
                weight_map = json.load(handle)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
        if not files:
            raise ConversionError(f"{path} holds no *.safetensors file: not a Hugging Face model directory")
        self.file_of: dict[str, str] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            file_path = os.path.join(path, file)
            if not os.path.isfile(file_path):
                raise ConversionError(f"{index_path} names {file}, which is missing: the download or copy is incomplete")
            with safe_open(file_path, framework="pt") as handle:
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    self.tensors[name] = TensorInfo(tuple(piece.get_shape()), SAFETENSORS_DTYPES[piece.get_dtype()])
                    self.file_of[name] = file_path

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        with safe_open(self.file_of[name], framework="pt") as handle:
            if region is None:
                return handle.get_tensor(name)
            _, _, kept = _box(region, self.tensors[name].shape)
            boxes = tuple(slice(part, part + 1) if isinstance(part, int) else part for part in region)
            return handle.get_slice(name)[boxes].reshape(kept).contiguous()

    def read_object(self, name: str) -> Any:
        return None

    def config(self) -> dict[str, Any]:
        path = os.path.join(self.path, "config.json")
        if not os.path.isfile(path):
            raise ConversionError(f"{self.path} has no config.json: copy the model's config.json beside its safetensors")
        with open(path) as handle:
            return json.load(handle)


SAFETENSORS_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def open_source(path: str, step: int | None = None) -> DcpSource | HuggingFaceSource:
    """The checkpoint at ``path``, by what its directory holds (``step``: which of a save
    directory's checkpoints; default the latest)."""
    if not os.path.isdir(path):
        raise ConversionError(f"{path} is not a directory: give a checkpoint's directory")
    if any(name.endswith(".safetensors") for name in os.listdir(path)) or os.path.isfile(os.path.join(path, SAFETENSORS_INDEX)):
        return HuggingFaceSource(path)
    resolved = resolve_checkpoint_dir(path, step)
    if os.path.isfile(os.path.join(resolved, METADATA_FILE)):
        return DcpSource(resolved)
    return DcpSource(resolved)  # raises, naming what a checkpoint directory holds
