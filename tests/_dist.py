"""Runs a function on N ranks and collects what each returns.

gloo runs go to a pool of rank processes kept alive between tests (one pool per world size):
starting a process and importing torch and megatron_fsdp costs about 2.5 s for two ranks on a
2-core machine, more than most tests take. Each run still gets a fresh process group on a fresh
port, and the worker puts back what a test may have changed in the process (working directory,
environment, torch's seed, default dtype, determinism, compiled graphs, DTensor's caches). NCCL runs, and
gloo runs with ``fresh_processes=True``, get processes of their own.

Every rank's exception comes back with its traceback; a rank that hangs is killed after
``timeout`` seconds and the run fails instead of hanging the test suite. After any failure the
pool's processes are killed (a rank that raised may have left the others inside a collective),
and the next run starts new ones.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torch's seed in a new process, put back before every pooled run.
_INITIAL_SEED = torch.initial_seed()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_once(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if os.environ.get("TEST_RANK_TRACEBACK_AFTER"):
        # Where a hanging rank waits: its stack goes to stderr after that many seconds.
        faulthandler.dump_traceback_later(float(os.environ["TEST_RANK_TRACEBACK_AFTER"]), exit=True)
    try:
        if "nccl" in backend:  # "nccl", or per device type as "cpu:gloo,cuda:nccl"
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        # Plain pickle copies tensors into the message; torch's queue pickling would share memory
        # that vanishes when this process exits.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def _restore_process_state(cwd: str, environ: dict[str, str]) -> None:
    """Puts back what a test may have changed in a pooled rank process."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    torch.manual_seed(_INITIAL_SEED)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(False)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    _clear_dtensor_caches()
    gc.collect()


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions keyed by specs whose meshes compare by value: a mesh of
    a destroyed process group would come back for an equal new one (its groups unresolvable)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (
        getattr(propagator, "propagate_op_sharding", None),
        getattr(propagator, "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    ):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    native_cache_clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # its C++ fast path
    if native_cache_clear is not None:
        native_cache_clear()


def _pooled_worker(rank: int, world_size: int, jobs: mp.Queue, results: mp.Queue) -> None:
    """A rank process that runs one job after another until it gets None."""
    cwd, environ = os.getcwd(), dict(os.environ)
    while (job := jobs.get()) is not None:
        port, fn, args = pickle.loads(job)
        _run_once(rank, world_size, port, "gloo", fn, args, results)
        _restore_process_state(cwd, environ)


class _RankPool:
    """``world_size`` rank processes that stay alive between runs."""

    def __init__(self, world_size: int) -> None:
        context = mp.get_context("spawn")
        self.results = context.Queue()
        self.jobs = [context.Queue() for _ in range(world_size)]
        self.processes = [
            context.Process(target=_pooled_worker, args=(rank, world_size, self.jobs[rank], self.results), daemon=True)
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    def submit(self, fn: Callable, args: tuple) -> None:
        job = pickle.dumps((free_port(), fn, args))
        for jobs in self.jobs:
            jobs.put(job)

    def close(self, kill: bool) -> None:
        for process, jobs in zip(self.processes, self.jobs):
            if not kill and process.is_alive():
                jobs.put(None)
        for process in self.processes:
            process.join(timeout=0.5 if kill else 5)
            if process.is_alive():
                process.kill()
                process.join()


_POOLS: dict[int, _RankPool] = {}


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close(kill=False)


def use_deterministic_kernels() -> None:
    """Deterministic kernels, so that resumed runs compare bit for bit. On CUDA also cuBLAS's
    workspace setting they need, and a warning instead of an error for a kernel that has no
    deterministic version (attention's backward in some torch builds)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())


def nccl_world(most: int = 2) -> int:
    """How many GPUs the NCCL tests run on: up to ``most``; on a one-GPU machine one, which
    still runs every CUDA code path (pool events, streams, NCCL calls) against the reference."""
    return min(most, torch.cuda.device_count())


def _collect(
    results: mp.Queue, processes: list, world_size: int, timeout: float, dying_ranks: frozenset[int] = frozenset()
) -> tuple[dict[int, Any], list[str]]:
    """Each rank's result, until all have one, one raised, one died or the time is up. A rank of
    ``dying_ranks`` that exits without a result has the result None."""
    collected: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(collected) < world_size and not errors:
        for rank in dying_ranks:
            if processes[rank].exitcode is not None and rank not in collected:
                collected[rank] = None
        try:
            rank, status, payload = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(processes) if p.exitcode is not None and r not in collected and r not in dying_ranks]
            if dead and results.empty():
                errors.append(f"ranks {dead} exited without a result (exit codes {[processes[r].exitcode for r in dead]})")
            elif time.monotonic() > deadline:
                errors.append(f"ranks {sorted(set(range(world_size)) - set(collected))} gave no result within {timeout}s")
            continue
        if status == "ok":
            collected[rank] = pickle.loads(payload)
        else:
            # The other ranks may now wait forever in a collective: they are stopped by the caller.
            errors.append(f"rank {rank}:\n{payload}")
    return collected, errors


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    fresh_processes: bool = False,
    dying_ranks: frozenset[int] = frozenset(),
) -> list[Any]:
    """``[fn(rank, world_size, *args) for every rank]``, each rank in its own process. Ranks in
    ``dying_ranks`` may end their process (a fault drill; result None); they get fresh processes."""
    if backend == "gloo" and not fresh_processes and not dying_ranks:
        return _run_pooled(fn, world_size, args, timeout)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_run_once, args=(rank, world_size, port, backend, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    errors: list[str] = []
    try:
        collected, errors = _collect(results, processes, world_size, timeout, dying_ranks)
    finally:
        for process in processes:
            process.join(timeout=5 if not errors else 0.5)
            if process.is_alive():
                process.kill()
                process.join()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [collected[rank] for rank in range(world_size)]


def _run_pooled(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
    pool = _POOLS.get(world_size)
    if pool is None or any(not process.is_alive() for process in pool.processes):
        if pool is not None:
            pool.close(kill=True)
        pool = _POOLS[world_size] = _RankPool(world_size)
    pool.submit(fn, args)
    collected: dict[int, Any] = {}
    errors = ["interrupted"]
    try:
        collected, errors = _collect(pool.results, pool.processes, world_size, timeout)
    finally:
        if errors:
            del _POOLS[world_size]
            pool.close(kill=True)
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [collected[rank] for rank in range(world_size)]
