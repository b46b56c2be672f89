"""NCCL user-buffer registration (``nccl_ub=True``).

The pool's persistent buckets (``fsdp_double_buffer``) are moved into NCCL memory and registered
with every communicator that carries them, so NCCL can run its zero-copy algorithms (NVLS,
SHARP, peer access without staging copies) on them. Buckets appear during the first step, so
they are moved and registered after the first optimizer step, and after any later step that
grew the pool.

The memory comes from ``ncclMemAlloc`` of the NCCL torch loaded, through this package's CUDA
build (``csrc/cuda/nccl_memory.cu``; torch's own ``mem_allocator`` is missing from some builds).
Without it the buckets come from torch's allocator and are still registered, which NCCL can use
for fewer algorithms. Reaching a group's NCCL backend needs ``ProcessGroup._get_backend``, the
accessor torch's own FSDP uses; where it or NCCL registration is missing,
``nccl_ub`` falls back to unregistered buckets with one log line.
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import torch
import torch.distributed as dist
from torch.cuda.memory import CUDAPluggableAllocator

from megatron_fsdp import _C, _ops
from megatron_fsdp.engine.groups.mesh import DataParallelGroup

logger = logging.getLogger(__name__)

# ncclMemAlloc and ncclCommRegister first shipped in NCCL 2.19.
_MIN_NCCL_VERSION = (2, 19)


def _groups_of(dp: DataParallelGroup) -> list[dist.ProcessGroup]:
    """Every process group that buckets travel over: dp_shard, dp_outer, expert groups."""
    groups, pending = [], [dp]
    while pending:
        current = pending.pop()
        if all(current.group is not known for known in groups):
            groups.append(current.group)
        pending.extend(g for g in (current.outer, current.expert) if g is not None)
    return groups


def _nccl_backends(groups: list[dist.ProcessGroup], device: torch.device) -> tuple[list, str | None]:
    """The NCCL backend object of each group that communicates, or the reason registration
    cannot work here. A group of one rank never reaches NCCL (collectives.py runs its
    collectives locally), so its communicator may never be created: it is left out."""
    if device.type != "cuda":
        return [], f"the model is on {device}, and user buffers are CUDA memory"
    groups = [group for group in groups if dist.get_world_size(group) > 1]
    if not groups:
        return [], "every data-parallel group has one rank, so no collective reaches NCCL"
    if not dist.is_nccl_available():
        return [], f"torch {torch.__version__} was built without NCCL"
    if torch.cuda.nccl.version() < _MIN_NCCL_VERSION:
        return [], f"NCCL {torch.cuda.nccl.version()} is older than {_MIN_NCCL_VERSION}, which added ncclMemAlloc"
    backends = []
    for group in groups:
        try:
            backend = group._get_backend(device)
        except (AttributeError, RuntimeError):  # no such accessor, or no backend for CUDA
            backend = None
        if not isinstance(backend, dist.ProcessGroupNCCL):
            return [], f"a data-parallel group runs {dist.get_backend(group)!r} on {device}, not NCCL"
        if not hasattr(backend, "register_mem_pool"):
            return [], f"torch {torch.__version__}'s NCCL process group cannot register memory pools"
        backends.append(backend)
    return backends, None


def _nccl_allocator() -> object | None:
    """NCCL's allocator (ncclMemAlloc) for a MemPool, or None (after a log line) where this
    build has no CUDA kernels or the loaded NCCL lacks it."""
    library = _C.__file__
    if not _ops.has_cuda_kernels():
        reason = "megatron_fsdp was built without CUDA"
    elif not ctypes.CDLL(library).megatron_fsdp_nccl_memory_available():
        reason = "the loaded NCCL has no ncclMemAlloc"
    else:
        return CUDAPluggableAllocator(library, "megatron_fsdp_nccl_alloc", "megatron_fsdp_nccl_free").allocator()
    logger.warning(
        "megatron_fsdp: nccl_ub buckets use torch's allocator, registered with NCCL (%s): "
        "NVLS and zero-copy peer algorithms need NCCL memory", reason,
    )
    return None


def _release(backends: list, mem_pool: torch.cuda.MemPool) -> None:
    """When the registration is collected: deregister while the communicators live. After
    destroy_process_group they are shut down, and freeing a registered segment then aborts the
    process (torch's allocator hook deregisters it from a dead communicator): the pool is kept
    for the rest of the process instead."""
    if dist.is_initialized():
        _deregister(backends, mem_pool)
    else:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(mem_pool))


def _deregister(backends: list, mem_pool: torch.cuda.MemPool) -> None:
    for backend in backends:
        backend.deregister_mem_pool(mem_pool)


class NCCLUserBuffers:
    """The NCCL memory pool behind a bucket pool and its registration with the data-parallel
    communicators. Built by :meth:`create`, which returns None (after one log line) where this
    torch, device or process group cannot register user buffers."""

    def __init__(self, bucket_pool: torch.ScriptObject, backends: list, device: torch.device) -> None:
        self.bucket_pool = bucket_pool
        self.backends = backends
        self.device = device
        allocator = _nccl_allocator()
        self.uses_nccl_memory = allocator is not None
        self.mem_pool = torch.cuda.MemPool(allocator)
        # Set at the first registration; it deregisters (or keeps) the pool when collected.
        self._finalizer: weakref.finalize | None = None

    @property
    def registered(self) -> bool:
        return self._finalizer is not None

    @classmethod
    def create(cls, bucket_pool: torch.ScriptObject, dp: DataParallelGroup, device: torch.device) -> NCCLUserBuffers | None:
        backends, reason = _nccl_backends(_groups_of(dp), device)
        if reason is not None:
            logger.warning("megatron_fsdp: nccl_ub=True falls back to unregistered buffers: %s", reason)
            return None
        return cls(bucket_pool, backends, device)

    def register_new_buckets(self) -> None:
        """Between steps, on every rank: moves buckets created since the last call into NCCL
        memory and registers the pool again (deregistering first: registration is per segment
        and taken at once)."""
        with torch.cuda.use_mem_pool(self.mem_pool, self.device):
            moved = self.bucket_pool.move_new_blocks()
        if moved == 0:
            return
        # The buckets' old memory went back to torch's cache; return it to CUDA rather than
        # keep it reserved beside the NCCL memory (only after a step that added buckets).
        torch.cuda.empty_cache()
        if self.registered:
            _deregister(self.backends, self.mem_pool)
        for backend in self.backends:
            backend.register_mem_pool(self.mem_pool)
        if self._finalizer is None:
            self._finalizer = weakref.finalize(self, _release, self.backends, self.mem_pool)
        logger.info(
            "megatron_fsdp: nccl_ub registered %.1f MiB of buckets (%d new) with %d NCCL communicator(s)",
            self.bucket_pool.bytes_reserved() / 2**20, moved, len(self.backends),
        )
