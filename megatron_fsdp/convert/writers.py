"""Writing a plan's tensors as they are built, one step's tensors in memory at a time.

- :func:`write_safetensors`: one ``.safetensors`` file. Every shape is known from the plan before
  a byte is read, so the header is written first and each tensor's bytes follow as its step
  produces them (``safetensors.torch.save_file`` takes every tensor of a file at once).
- :func:`save_dcp`: a torch.distributed.checkpoint directory through ``dcp.save`` itself, with a
  save planner whose ``resolve_data`` builds each tensor when DCP's writer asks for it. Each
  rank writes its own steps; DCP's coordinator writes ``.metadata`` for all of them.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorProperties, TensorWriteData, WriteItem, WriteItemType

from megatron_fsdp.convert.inert_pickle import save_inertly
from megatron_fsdp.convert.plan import Step, Write
from megatron_fsdp.convert.sources import SAFETENSORS_DTYPE_NAMES, TensorInfo

logger = logging.getLogger(__name__)

StepRunner = Callable[[Step], list[torch.Tensor]]
_ALIGNMENT = 8  # safetensors pads its header so the data starts 8-byte aligned


class Progress:
    """Logs how far a rank is, at most every ``every_s`` seconds, and its bytes per second."""

    def __init__(self, total_steps: int, total_bytes: int, every_s: float = 10.0) -> None:
        self.total_steps, self.total_bytes, self.every_s = total_steps, total_bytes, every_s
        self.done_steps = self.done_bytes = 0
        self.start = self._last = time.monotonic()

    def advance(self, step: Step, nbytes: int) -> None:
        self.done_steps += 1
        self.done_bytes += nbytes
        now = time.monotonic()
        if now - self._last >= self.every_s or self.done_steps == self.total_steps:
            self._last = now
            rate = self.done_bytes / max(now - self.start, 1e-9) / 2**20
            logger.info(
                "converted %d/%d steps, %.2f/%.2f GiB (%.0f MiB/s); last: %s",
                self.done_steps, self.total_steps, self.done_bytes / 2**30, self.total_bytes / 2**30, rate, step.label,
            )


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (it is contiguous)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: str, steps: list[Step], targets: dict[str, TensorInfo], run_step: StepRunner, progress: Progress) -> None:
    """Writes ``steps``' tensors to the safetensors file ``path``, in step order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for step in steps:
        for write in step.writes:
            info = targets[write.name]
            nbytes = TensorInfo(write.shape, info.dtype).nbytes
            header[write.name] = {"dtype": SAFETENSORS_DTYPE_NAMES[info.dtype], "shape": list(write.shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _ALIGNMENT)
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for step in steps:
            tensors = run_step(step)
            for tensor in tensors:
                handle.write(_as_bytes(tensor.contiguous()))
            progress.advance(step, sum(tensor.nbytes for tensor in tensors))


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans the writes of ``steps`` (and, on the coordinator, the non-tensor ``objects``) without
    holding their tensors: ``resolve_data`` runs a step when DCP's writer first asks for one of its
    tensors and drops the previous step's tensors' memory (torch's writer keeps a reference to
    every tensor of a file until the file is closed). That is only sound when the writer saves
    each tensor before it asks for the next, in plan order, which :func:`save_dcp` ensures."""

    def __init__(self, steps: list[Step], targets: dict[str, TensorInfo], objects: dict[str, Any], run_step: StepRunner, progress: Progress) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._steps, self._targets, self._objects = steps, targets, objects
        self._run_step, self._progress = run_step, progress
        self._step_of: dict[MetadataIndex, tuple[int, int]] = {}
        self._current: tuple[int, list[torch.Tensor]] | None = None

    def set_up_planner(self, state_dict: dict, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self._is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        if self._is_coordinator:
            items += [WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO) for name in self._objects]
        for step_index, step in enumerate(self._steps):
            for write_index, write in enumerate(step.writes):
                item = _write_item(write, self._targets[write.name])
                self._step_of[item.index] = (step_index, write_index)
                items.append(item)
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(save_inertly(self._objects[write_item.index.fqn]))
        step_index, write_index = self._step_of[_plain_index(write_item.index)]
        if self._current is not None and step_index < self._current[0]:
            raise RuntimeError(
                f"DCP's writer asked for {write_item.index.fqn} of step {step_index} after step {self._current[0]}, "
                "whose tensors' memory was already dropped: the storage writer must resolve items in plan order "
                "(a FileSystemWriter with thread_count=1 and per_thread_copy_ahead=0)"
            )
        if self._current is None or self._current[0] != step_index:
            if self._current is not None:
                for tensor in self._current[1]:
                    tensor.untyped_storage().resize_(0)
            step = self._steps[step_index]
            tensors = [_own_storage(tensor) for tensor in self._run_step(step)]
            self._current = (step_index, tensors)
            self._progress.advance(step, sum(tensor.nbytes for tensor in tensors))
        return self._current[1][write_index]


def _plain_index(index: MetadataIndex) -> MetadataIndex:
    """The index without DCP's position hint, as it was planned."""
    return MetadataIndex(index.fqn, index.offset)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor owning exactly its storage, which can be resized (so DCP's writer neither
    clones it nor keeps a larger buffer alive, and its memory can be dropped when its step is done;
    a tensor safetensors read is backed by memory that cannot be resized)."""
    tensor = tensor.contiguous()
    storage = tensor.untyped_storage()
    if storage.nbytes() != tensor.nbytes or tensor.storage_offset() or not storage.resizable():
        tensor = tensor.clone()
    return tensor


def _write_item(write: Write, info: TensorInfo) -> WriteItem:
    offsets = write.offsets or (0,) * len(info.shape)
    whole = write.offsets is None
    return WriteItem(
        index=MetadataIndex(write.name, torch.Size(offsets)),
        type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(write.shape)),
            properties=TensorProperties(dtype=info.dtype),
            size=torch.Size(info.shape),
        ),
    )


def save_dcp(
    writer: FileSystemWriter,
    steps: list[Step],
    targets: dict[str, TensorInfo],
    objects: dict[str, Any],
    run_step: StepRunner,
    progress: Progress,
    distributed: bool,
) -> None:
    """``dcp.save`` of this rank's ``steps`` (a collective when ``distributed``). ``writer`` must
    have ``thread_count=1`` and ``per_thread_copy_ahead=0``: with a GPU present and any copy-ahead,
    torch's writer resolves tensors ahead of saving them (and sorted by size), so a step's tensors
    would be dropped before they are saved and the file would hold empty storages that
    ``torch.load`` cannot rebuild ("Trying to resize storage that is not resizable")."""
    if writer.thread_count != 1 or writer.per_thread_copy_ahead != 0:
        raise ValueError(
            f"save_dcp streams its tensors and needs a writer that saves each before asking for the next: "
            f"got thread_count={writer.thread_count}, per_thread_copy_ahead={writer.per_thread_copy_ahead}; "
            "build it with thread_count=1, per_thread_copy_ahead=0"
        )
    planner = _StreamingSavePlanner(steps, targets, objects, run_step, progress)
    dcp.save({}, storage_writer=writer, planner=planner, no_dist=not distributed)


def iter_files(steps: list[Step], targets: dict[str, TensorInfo], max_bytes: int) -> Iterator[list[Step]]:
    """``steps`` cut, in order, into runs of at most ``max_bytes`` written (a step bigger than that
    alone)."""
    run: list[Step] = []
    size = 0
    for step in steps:
        step_bytes = sum(TensorInfo(write.shape, targets[write.name].dtype).nbytes for write in step.writes)
        if run and size + step_bytes > max_bytes:
            yield run
            run, size = [], 0
        run.append(step)
        size += step_bytes
    if run:
        yield run
