"""Reading DCP checkpoints without running code that came with them.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load``, and DCP's
default load planner unpickles each non-tensor item of a ``.distcp`` file (an optimizer's
learning rate, the ``manifest`` key) with ``torch.load(weights_only=False)``: a forged file runs
whatever code it names. :class:`SafeFileSystemReader` unpickles ``.metadata`` with an unpickler
that builds only the classes DCP's metadata is made of, and hands the planner only non-tensor
items that the weights-only unpickler accepts. Tensor items are torch's own weights-only loads.

:func:`screen_items` unpickles every item of a checkpoint the same way, tensors without their
data, before a load reads anything into a model: a refused item then raises before the model
or the optimizer holds a single value of the checkpoint.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from concurrent.futures import Future
from functools import cache
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from megatron_fsdp.checkpoint.weights_only import UnsafeCheckpointError, load_weights_only

METADATA_FILE = ".metadata"


@cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a ``.metadata`` written by DCP names, by the (module, name) pickle writes:
    the metadata dataclasses, torch's sizes, dtypes and layouts, and the path a checkpoint was
    saved to (a POSIX path: a Windows one cannot be built here anyway). Rebuilding each runs no code of the pickle's choosing."""
    allowed: list[Any] = [
        dcp_metadata.Metadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        torch.Size,
        torch.serialization._get_layout,  # how a torch.layout pickles: a lookup by name
    ]
    found = {(value.__module__, value.__qualname__): value for value in allowed}
    # Saved under another Python, a path's class may name another module of pathlib.
    for path_class in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath):
        found[(path_class.__module__, path_class.__qualname__)] = found[("pathlib", path_class.__qualname__)] = path_class
    found.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, (torch.dtype, torch.layout))})
    return found


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles DCP's metadata: builds only the globals of :func:`_metadata_globals`, and sets
    state only on instances, never on a class (which would change it for the whole process).
    Python's own unpickler, as C's BUILD cannot be restricted: up to 2.5 times as slow, seconds
    for the metadata of 100 000 tensor chunks."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self._path = path

    def _refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self._path} {what}: it was not written by torch.distributed.checkpoint, and unpickling it could run "
            f"code that came with it (nothing of it was run). Do not load this checkpoint"
        )

    def find_class(self, module: str, name: str) -> Any:
        allowed = _metadata_globals().get((module, name))
        if allowed is None:
            raise self._refuse(f"names {module}.{name}, which is not one of the classes DCP's metadata is made of")
        return allowed

    def load_build(self) -> None:
        target = self.stack[-2]
        if isinstance(target, type):
            raise self._refuse(f"sets attributes of the class {target.__qualname__}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def read_metadata_safely(path: str) -> dcp_metadata.Metadata:
    """The DCP metadata in the file ``path``, unpickled by :class:`_MetadataUnpickler`; raises
    :class:`UnsafeCheckpointError` when it names other classes or is not DCP metadata."""
    with open(path, "rb") as handle:
        metadata = _MetadataUnpickler(handle, path).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata: do not load this checkpoint")
    for index, info in (metadata.storage_data or {}).items():
        relative = getattr(info, "relative_path", None)
        if not isinstance(info, filesystem._StorageInfo) or not isinstance(relative, str) or _leaves_directory(relative):
            raise UnsafeCheckpointError(
                f"{path} says {index.fqn} is stored at {info!r}, not in a file of the checkpoint's directory: "
                f"do not load this checkpoint"
            )
    return metadata


def _leaves_directory(relative_path: str) -> bool:
    return os.path.isabs(relative_path) or ".." in pathlib.PurePath(relative_path).parts


class _WeightsOnlyBytes:
    """The load planner DCP hands ``read_data``, whose non-tensor items reach it only after the
    weights-only unpickler built them: re-pickled from what it built, so the planner's own
    ``torch.load(weights_only=False)`` meets only those objects' own classes."""

    def __init__(self, planner: LoadPlanner, path: str) -> None:
        self._planner = planner
        self._path = path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = load_weights_only(value, f"the item {read_item.storage_index.fqn} of checkpoint {self._path}")
        vetted = io.BytesIO()
        torch.save(loaded, vetted)
        vetted.seek(0)
        self._planner.load_bytes(read_item, vetted)


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` that runs no code a checkpoint brings: ``.metadata`` is
    unpickled allowing only the classes DCP's metadata is made of, and non-tensor items only
    as torch's weights-only unpickler allows (plus numpy arrays); anything else raises
    :class:`UnsafeCheckpointError`. For ``dcp.load`` on checkpoints from elsewhere::

        dcp.load(state, storage_reader=SafeFileSystemReader(path))

    Same arguments as ``FileSystemReader``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata_safely(str(self._get_metadata_path(kwargs.get("rank"))))
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, _WeightsOnlyBytes(planner, str(self.path)))  # type: ignore[arg-type]


class _ByteRange(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of an open file, as a seekable file of their own."""

    def __init__(self, file: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self._file, self._offset, self._length, self._position = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + position)
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._length - self._position))
        self._file.seek(self._offset + self._position)
        data = self._file.read(count)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


def _items_by_file(metadata: dcp_metadata.Metadata, rank: int, world: int) -> dict[str, list[tuple[Any, Any]]]:
    """This rank's share of the checkpoint's storage items, every ``world``-th in file order,
    grouped by file."""
    ordered = sorted(metadata.storage_data.items(), key=lambda item: (item[1].relative_path, item[1].offset))
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in ordered[rank::world]:
        by_file.setdefault(info.relative_path, []).append((index, info))
    return by_file


def screen_items(path: str, metadata: dcp_metadata.Metadata, rank: int, world: int) -> None:
    """Unpickles this rank's share of the checkpoint's items (a tensor without its data, which
    is not read) as a load would, and raises :class:`UnsafeCheckpointError` for the first that
    the weights-only unpickler refuses, or that holds no tensor where a tensor belongs. Items
    written through DCP's stream transforms are left to the load itself (still weights-only)."""
    with torch.serialization.skip_data():
        for relative_path, items in _items_by_file(metadata, rank, world).items():
            with open(os.path.join(path, relative_path), "rb") as handle:
                for index, info in items:
                    if info.transform_descriptors:
                        continue
                    what = f"the item {index.fqn} in {relative_path} of checkpoint {path}"
                    stored = metadata.state_dict_metadata.get(index.fqn)
                    if isinstance(stored, dcp_metadata.BytesStorageMetadata):
                        handle.seek(info.offset)
                        load_weights_only(io.BytesIO(handle.read(info.length)), what)
                        continue
                    loaded = load_weights_only(_ByteRange(handle, info.offset, info.length), what, map_location="cpu")
                    if not isinstance(loaded, torch.Tensor):
                        raise UnsafeCheckpointError(f"{what} holds a {type(loaded).__name__}, not a tensor: do not load this checkpoint")
