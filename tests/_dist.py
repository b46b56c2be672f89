"""Runs a function on N gloo ranks in fresh processes and collects what each returns.

Every rank's exception comes back with its traceback; a rank that hangs is killed after
``timeout`` seconds and the run fails instead of hanging the test suite.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if os.environ.get("TEST_RANK_TRACEBACK_AFTER"):
        # Where a hanging rank waits: its stack goes to stderr after that many seconds.
        faulthandler.dump_traceback_later(float(os.environ["TEST_RANK_TRACEBACK_AFTER"]), exit=True)
    try:
        if backend == "nccl":
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


def nccl_world(most: int = 2) -> int:
    """How many GPUs the NCCL tests run on: up to ``most``; on a one-GPU machine one, which
    still runs every CUDA code path (pool events, streams, NCCL calls) against the reference."""
    return min(most, torch.cuda.device_count())


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo", timeout: float = 300.0) -> list[Any]:
    """``[fn(rank, world_size, *args) for every rank]``, each in its own process."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world_size, port, backend, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size and not errors:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode is not None and r not in collected]
                if dead and results.empty():
                    errors.append(f"ranks {dead} exited without a result (exit codes {[processes[r].exitcode for r in dead]})")
                elif time.monotonic() > deadline:
                    errors.append(f"ranks {sorted(set(range(world_size)) - set(collected))} gave no result within {timeout}s")
                continue
            if status == "ok":
                collected[rank] = pickle.loads(payload)
            else:
                # The other ranks may now wait forever in a collective: stop them.
                errors.append(f"rank {rank}:\n{payload}")
    finally:
        for process in processes:
            process.join(timeout=5 if not errors else 0.5)
            if process.is_alive():
                process.kill()
                process.join()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
    return [collected[rank] for rank in range(world_size)]
