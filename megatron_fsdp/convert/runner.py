"""Running a plan into an output directory that appears whole or not at all.

Every rank (one process, or each of ``torchrun``'s) runs its share of the plan's steps
(``plan.share_of``: whole steps, balanced by bytes) into ``<output>.partial``; once every rank
has finished, rank 0 writes what describes the whole (the safetensors index and config.json, or
DCP's ``.metadata`` through ``dcp.save``, and the ``latest`` pointer) and renames the directory.
A conversion that fails or is killed leaves no ``<output>``; the next run replaces the leftover
``.partial``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_fsdp.checkpoint.integrity import MANIFEST, MANIFEST_KEY, ChecksummingWriter, write_manifest
from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.plan import Plan, Step, share_of
from megatron_fsdp.convert.sources import SAFETENSORS_INDEX, Source, TensorInfo
from megatron_fsdp.convert.writers import Progress, iter_files, save_dcp, write_safetensors

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
DEFAULT_MAX_FILE_BYTES = 5 * 2**30  # Hugging Face's own default shard size


@dataclass(frozen=True)
class Layout:
    """How the output directory is laid out: ``kind`` is ``huggingface``, ``ours`` (``step_<N>``
    + ``latest`` + manifest, as ``save_checkpoint`` writes) or ``megatron`` (``iter_<N>`` or
    ``release`` + ``latest_checkpointed_iteration.txt``); ``extra_files`` are written beside the
    tensors (config.json; torch_dist's metadata.json and common.pt) by rank 0."""

    kind: str
    step: int = 0
    extra_files: tuple[tuple[str, Callable[[str], None]], ...] = ()

    @property
    def checkpoint_dir(self) -> str:
        """Where the tensors go, relative to the output directory."""
        if self.kind == "huggingface":
            return ""
        if self.kind == "ours":
            return f"step_{self.step:08d}"
        return "release" if self.step == 0 else f"iter_{self.step:07d}"

    @property
    def pointer(self) -> tuple[str, str] | None:
        """The file naming the newest checkpoint, and what it holds."""
        if self.kind == "ours":
            return "latest", str(self.step)
        if self.kind == "megatron":
            return "latest_checkpointed_iteration.txt", "release" if self.step == 0 else str(self.step)
        return None


def _world() -> tuple[int, int, bool]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def _agree(problem: str | None, distributed: bool) -> None:
    """Raises the same error on every rank when any rank found one."""
    problems = [problem]
    if distributed:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    found = [found for found in problems if found]
    if found:
        raise ConversionError(found[0])


def step_runner(source: Source, plan: Plan) -> Callable[[Step], list[torch.Tensor]]:
    """Reads a step's tensors, builds its outputs, and checks and casts them to the plan's targets."""

    def run(step: Step) -> list[torch.Tensor]:
        inputs = [source.read(read.name, read.region) for read in step.reads]
        outputs = step.build([tensor if read.shape is None else tensor.reshape(read.shape) for read, tensor in zip(step.reads, inputs)])
        cast = []
        for write, tensor in zip(step.writes, outputs, strict=True):
            if tuple(tensor.shape) != tuple(write.shape):
                raise ConversionError(f"building {write.name} from {step.label} gave shape {list(tensor.shape)}, not {list(write.shape)}")
            cast.append(tensor.to(plan.targets[write.name].dtype))
        return cast

    return run


def run_plan(source: Source, plan: Plan, output: str, layout: Layout, overwrite: bool = False, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> dict[str, Any]:
    """Writes ``plan`` from ``source`` into ``output``; a collective under torchrun. Returns this
    rank's numbers: seconds, bytes written, peak resident memory during the conversion and how
    far it is above the resident memory when the conversion started."""
    rank, world, distributed = _world()
    partial = output.rstrip("/") + PARTIAL_SUFFIX
    problem = None
    if rank == 0 and os.path.exists(output) and not overwrite:
        problem = f"{output} exists: choose another output directory, or pass --overwrite to replace it once the conversion has succeeded"
    _agree(problem, distributed)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a conversion that died
        os.makedirs(partial)
    _barrier(distributed)
    start, resident_at_start = time.monotonic(), _reset_peak_resident()
    mine = share_of(plan.steps, plan.targets, rank, world)
    total = sum(TensorInfo(write.shape, plan.targets[write.name].dtype).nbytes for step in mine for write in step.writes)
    progress = Progress(len(mine), total)
    run_step = step_runner(source, plan)
    problem = None
    try:
        if layout.kind == "huggingface":
            _write_hf(partial, plan, mine, run_step, progress, rank, world, max_file_bytes)
        else:
            _write_dcp(partial, plan, mine, run_step, progress, layout, distributed)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - every rank must hear of it before the next collective
        # DCP wraps a rank's exception with its traceback; its last line says what went wrong.
        cause = str(error).strip().splitlines()[-1] if isinstance(error, CheckpointException) else f"{type(error).__name__}: {error}"
        problem = f"rank {rank}: {cause}"
        logger.exception("conversion failed on rank %d", rank)
    try:
        _agree(problem, distributed)
    except ConversionError:
        _barrier(distributed)
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # nothing half written stays behind
        raise
    if rank == 0:
        for name, write_file in layout.extra_files:
            write_file(os.path.join(partial, layout.checkpoint_dir, name))
        _commit(partial, output, overwrite)
    _barrier(distributed)
    seconds = time.monotonic() - start
    peak = _status_bytes("VmHWM")
    logger.info(
        "rank %d wrote %.2f GiB in %.1f s; peak resident memory %.2f GiB, %.2f GiB above where the conversion started",
        rank, total / 2**30, seconds, peak / 2**30, (peak - resident_at_start) / 2**30,
    )
    return {"seconds": seconds, "bytes": total, "peak_rss_bytes": peak, "peak_rss_above_start_bytes": peak - resident_at_start}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_resident() -> int:
    """Resets the kernel's high-water mark of this process's resident memory (Linux: ``5`` into
    ``/proc/self/clear_refs``), so the peak read at the end is the conversion's, not the imports';
    returns the resident memory now."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return _status_bytes("VmRSS")


def _commit(partial: str, output: str, overwrite: bool) -> None:
    if overwrite and os.path.exists(output):
        shutil.rmtree(output)
    os.rename(partial, output)
    logger.info("wrote %s", output)


def _file_runs(plan: Plan, world: int, max_file_bytes: int) -> list[list[list[Step]]]:
    """Each rank's files (as runs of steps), computed alike on every rank."""
    return [list(iter_files(share_of(plan.steps, plan.targets, r, world), plan.targets, max_file_bytes)) for r in range(world)]


def _write_hf(partial: str, plan: Plan, mine: list[Step], run_step, progress: Progress, rank: int, world: int, max_file_bytes: int) -> None:
    runs = _file_runs(plan, world, max_file_bytes)
    count = sum(len(files) for files in runs)
    names = []
    for r, files in enumerate(runs):
        for run in files:
            names.append((r, run, f"model-{len(names) + 1:05d}-of-{count:05d}.safetensors" if count > 1 else "model.safetensors"))
    for owner, run, name in names:
        if owner == rank:
            write_safetensors(os.path.join(partial, name), run, plan.targets, run_step, progress)
    if rank == 0 and count > 1:
        weight_map = {write.name: name for _, run, name in names for step in run for write in step.writes}
        total = sum(info.nbytes for info in plan.targets.values())
        with open(os.path.join(partial, SAFETENSORS_INDEX), "w") as handle:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, handle, indent=2)


def _write_dcp(partial: str, plan: Plan, mine: list[Step], run_step, progress: Progress, layout: Layout, distributed: bool) -> None:
    directory = os.path.join(partial, layout.checkpoint_dir)
    objects = dict(plan.objects)
    if layout.kind == "ours":
        objects[MANIFEST_KEY] = MANIFEST  # as save_checkpoint writes it: tells a lost manifest from none
    writer = ChecksummingWriter(directory, per_thread_copy_ahead=0)  # save_dcp's streaming needs it
    save_dcp(writer, mine, plan.targets, objects, run_step, progress, distributed)
    checksums = writer.checksums()
    gathered = [checksums]
    if distributed:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(checksums, gathered, dst=0)
    if not distributed or dist.get_rank() == 0:
        if layout.kind == "ours":
            write_manifest(directory, layout.step, gathered)
        name, text = layout.pointer
        with open(os.path.join(partial, name), "w") as handle:
            handle.write(text)
