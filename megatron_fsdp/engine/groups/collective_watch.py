"""Bounds CUDA collectives by ``collective_timeout`` and names the ranks a late collective misses.

A CUDA (NCCL) wait only orders streams: when a peer died or skipped a collective, the GPU spins in
the collective's kernel and the training thread blocks at its next synchronisation, until the
process group's timeout makes torch's watchdog tear the process down with a dump. The watch thread
here polls the collectives the engine waited for; past the deadline it logs our error, aborts this
process's NCCL communicators (so the kernel returns), and the training thread raises the error at
its next collective or wait (:meth:`ProcessCollectiveWatch.raise_if_failed`).

The watch is process-wide (one heartbeat per process, over the default group's store), whatever
the number of models sharded in it: collectives.py holds the one instance and is its one owner,
which starts it when a collective first needs it and stops it at the interpreter's exit.

Heartbeats name the missing ranks, on either backend: while a timeout is set, every rank writes a
beat counter and the collective it waits for to the default store every ``HEARTBEAT_SECONDS``. A
rank that timed out reads its group's beats twice, ``PROBE_SECONDS`` apart: a rank whose counter
stood still stopped answering (its process died or froze); a live rank waiting for another
collective, or none, is not taking part in this one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 0.25
PROBE_SECONDS = 4 * HEARTBEAT_SECONDS
POLL_SECONDS = 0.05
_KEY_PREFIX = "megatron_fsdp/heartbeat/"


@dataclass
class _Watched:
    work: dist.Work
    what: str
    group: dist.ProcessGroup
    timeout: float
    deadline: float


class ProcessCollectiveWatch:
    """The process's heartbeat and CUDA collective deadlines, on one daemon thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[_Watched] = []
        self._blocking_wait: str | None = None  # what the training thread waits for on a CPU backend
        self._failure: RuntimeError | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: dist.Store | None = None
        self._beats = 0

    def start(self) -> None:
        """Starts the heartbeat (once a timeout is in use; again after a new process group)."""
        # torch has no public accessor for the default group's store, which every rank reaches.
        store = dist.distributed_c10d._get_default_store()
        running = self._thread is not None and self._thread.is_alive()
        if store is self._store and (running or self._failure is not None):
            return  # after a failure, until a new process group: the error stays to be raised
        self.stop()
        self._store, self._failure = store, None
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="megatron_fsdp-collective-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the thread while the interpreter is whole (a daemon thread inside a torch call at
        interpreter teardown aborts the process)."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def watch(self, work: dist.Work, timeout: float, what: str, group: dist.ProcessGroup) -> None:
        """Holds ``work`` (a CUDA collective the training thread ordered its stream after) to
        ``timeout`` seconds from now; the watch must be started."""
        with self._lock:
            self._watched.append(_Watched(work, what, group, timeout, time.monotonic() + timeout))

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def blocking_wait(self, what: str | None) -> None:
        """What the training thread waits for on a CPU backend (None: nothing), for the heartbeat."""
        self._blocking_wait = what

    def missing_ranks(self, group: dist.ProcessGroup, what: str) -> str:
        """Which ranks of ``group`` are not taking part in the collective ``what``, from their
        heartbeats (blocks ``PROBE_SECONDS``)."""
        store = self._store
        if store is None:
            return "no heartbeats to tell which rank is missing"
        own = dist.get_rank()
        peers = [rank for rank in dist.get_process_group_ranks(group) if rank != own]
        before = {rank: _read_beat(store, rank) for rank in peers}
        self._sleep_beating(PROBE_SECONDS)
        after = {rank: _read_beat(store, rank) for rank in peers}
        found = []
        for rank in peers:
            if after[rank] is None:
                found.append(f"rank {rank} never sent a heartbeat (it died or hung before its first collective)")
            elif before[rank] is not None and after[rank][0] == before[rank][0]:
                found.append(f"rank {rank} stopped answering (no heartbeat for {PROBE_SECONDS:g} s: its process died or froze)")
            elif after[rank][1] != what:
                waits = f"waits for {after[rank][1]}" if after[rank][1] else "waits for no collective"
                found.append(f"rank {rank} is alive but not in this collective (it {waits})")
        if not found:
            return "every other rank of the group is alive and waits for it too (a slow rank? a larger collective_timeout)"
        return "; ".join(found)

    def _sleep_beating(self, seconds: float) -> None:
        """Sleeps; on the watch thread it keeps beating, or peers probing at the same time would
        find this rank silent."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, HEARTBEAT_SECONDS))
            if threading.current_thread() is self._thread:
                self._beat()

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stopped.is_set():
            now = time.monotonic()
            if now >= next_beat:
                if not self._beat():
                    return  # the store is gone: the process group was destroyed
                next_beat = now + HEARTBEAT_SECONDS
            late = self._first_late(now)
            if late is not None:
                self._fail(late)
                return
            self._stopped.wait(POLL_SECONDS)

    def _beat(self) -> bool:
        with self._lock:
            waiting = self._watched[0].what if self._watched else (self._blocking_wait or "")
        self._beats += 1
        try:
            self._store.set(f"{_KEY_PREFIX}{dist.get_rank()}", f"{self._beats}\n{waiting}")
        except (RuntimeError, ValueError):
            return False
        return True

    def _first_late(self, now: float) -> _Watched | None:
        with self._lock:
            self._watched = [watched for watched in self._watched if not watched.work.is_completed()]
            late = [watched for watched in self._watched if now > watched.deadline]
        return late[0] if late else None

    def _fail(self, late: _Watched) -> None:
        missing = self.missing_ranks(late.group, late.what)
        self._failure = RuntimeError(
            f"{late.what} did not complete: no result within collective_timeout={late.timeout:g} s; {missing}. "
            "A rank is not taking part in this collective: every rank must run the same forwards and backwards "
            "with the same model and configuration; a rank may also have died. This process's NCCL communicators "
            "were aborted: restart the job from its last checkpoint"
        )
        logger.error("%s", self._failure)
        # The training thread may be blocked on the GPU behind the collective's kernel: aborting
        # the communicators makes that kernel return. torch has no public call for every group.
        dist.distributed_c10d._abort_process_group()


def _read_beat(store: dist.Store, rank: int) -> tuple[int, str] | None:
    key = f"{_KEY_PREFIX}{rank}"
    if not store.check([key]):
        return None
    count, _, waiting = store.get(key).decode().partition("\n")
    return int(count), waiting

