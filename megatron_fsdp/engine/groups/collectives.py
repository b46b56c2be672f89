"""The collectives FSDP needs, one call per bucket, named after what they do.

PyTorch 2.13 renamed the single-tensor collectives (``all_gather_single``); 2.11 has only the
older names, so each is picked once here.

Over a group of one rank each is a local copy (or nothing) on the current stream, returning no
work to wait for: the result is the same, and a backend call costs the host about 100 us
(a one-GPU run, or a mesh dimension of size 1, launches a few per unit and step).

On host tensors (gloo) a collective runs on aliases that only its :class:`HostWork` knows, and a
wait returns once gloo's worker thread has let go of them. That thread drops its reference to a
finished work after the waiting thread has moved on; when that is the last reference to a
tensor Python also holds, it takes the GIL. A process group outlives ``destroy_process_group``
while a DeviceMesh or a model still holds it, so that drop can come during interpreter exit,
where taking the GIL aborts the process ("terminate called without an active exception"): a
script that ends right after a step (HFSDP's last all-gather) failed one run in three.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from megatron_fsdp.engine.groups.collective_watch import ProcessCollectiveWatch
from megatron_fsdp.engine.groups.process_exit import settle_gloo_at_exit

logger = logging.getLogger(__name__)

# The process's one collective watch (collective_watch.py), owned here: started by the first wait
# with a timeout (again after a new process group), stopped while the interpreter is whole.
PROCESS_COLLECTIVE_WATCH = ProcessCollectiveWatch()
atexit.register(PROCESS_COLLECTIVE_WATCH.stop)

# gloo's worker lets go of a finished work within microseconds; this only bounds a broken one.
_RELEASE_TIMEOUT_S = 10.0

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_shards(full: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``full`` = the concatenation of every rank's ``shard``. 8-bit floats go as their bytes."""
    full, shard = _as_bytes(full), _as_bytes(shard)
    if _runs_locally(group):
        return _copy_unless_same(full, shard)
    return _launch(_all_gather_single, (full, shard), async_op, group=group)


def reduce_scatter_sum(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """``shard`` = this rank's slice of the sum of every rank's ``full``."""
    if _runs_locally(group):
        return _copy_unless_same(shard, full)
    return _launch(_reduce_scatter_single, (shard, full), async_op, op=dist.ReduceOp.SUM, group=group)


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """``tensor`` = the sum of every rank's ``tensor``, in place (``group`` None: the default group)."""
    if _runs_locally(group):
        return None
    return _launch(dist.all_reduce, (tensor,), async_op, op=dist.ReduceOp.SUM, group=group)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """``tensor`` = the elementwise maximum of every rank's ``tensor``, in place (``group`` None: the default group)."""
    if _runs_locally(group):
        return None
    return _launch(dist.all_reduce, (tensor,), async_op, op=dist.ReduceOp.MAX, group=group)


def all_to_all(received: torch.Tensor, sent: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Chunk r of ``sent`` goes to rank r; ``received`` holds every rank's chunk for this rank."""
    if _runs_locally(group):
        return _copy_unless_same(received, sent)
    return _launch(dist.all_to_all_single, (received, sent), async_op, group=group)


def all_to_all_uneven(
    received: torch.Tensor, sent: torch.Tensor, received_splits: list[int], sent_splits: list[int], group: dist.ProcessGroup
):
    """``sent_splits[r]`` values of ``sent`` (in rank order) go to rank r; ``received`` holds
    ``received_splits[r]`` values from each rank r, in rank order."""
    if _runs_locally(group):
        return _copy_unless_same(received, sent)
    return _launch(dist.all_to_all_single, (received, sent, received_splits, sent_splits), False, group=group)


class HostWork:
    """A collective on host tensors, run on aliases only this object knows (the module's note):
    ``wait()`` also waits until gloo's worker thread has let go of them. The aliases are
    ``detach()``es, which share the memory but, unlike views, hold no reference to the caller's
    tensor, so gloo's last drop frees nothing Python knows but the alias."""

    def __init__(self, work: dist.Work, aliases: list[torch.Tensor]) -> None:
        self._work: dist.Work | None = work
        self._aliases = [weakref.ref(alias) for alias in aliases]

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> bool:
        """Raises the collective's error (again at a later wait: the work is kept until it succeeds)."""
        if self._work is None:
            return True
        self._work.wait()
        self._work = None  # its last reference, unless gloo's worker still holds it
        deadline = time.monotonic() + _RELEASE_TIMEOUT_S
        while any(alias() is not None for alias in self._aliases):
            if time.monotonic() > deadline:
                logger.warning("gloo's worker thread still holds a finished collective after %g s", _RELEASE_TIMEOUT_S)
                break
            time.sleep(1e-5)  # lets the worker take the GIL it needs to drop them
        return True


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """What a host collective runs on in place of ``tensor`` (see HostWork)."""
    return tensor.detach()


def _launch(collective, arguments: tuple, async_op: bool, **options) -> dist.Work | HostWork | None:
    """``collective(*arguments, async_op=async_op, **options)``; on host tensors through
    :class:`HostWork`, waited here unless ``async_op``."""
    tensors = [argument for argument in arguments if isinstance(argument, torch.Tensor)]
    if tensors[0].device.type != "cpu":
        return collective(*arguments, async_op=async_op, **options)
    settle_gloo_at_exit()  # for the collectives torch runs itself on these groups
    aliases = {id(tensor): _alias(tensor) for tensor in tensors}
    arguments = tuple(aliases.get(id(argument), argument) for argument in arguments)
    work = HostWork(collective(*arguments, async_op=True, **options), list(aliases.values()))
    del aliases, arguments  # the work's aliases must have no other reference here
    if async_op:
        return work
    work.wait()
    return None


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds values the host may read. A fake tensor (one rank of a simulated
    world, megatron_fsdp.simulate) holds none: a collective's result there is only its shape."""
    return not is_fake(tensor)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an 8-bit float tensor (float8 weights, a frozen float8 parameter): gloo
    has no float8 type, and a gather only moves bytes. Other tensors as they are."""
    if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:
        return tensor.view(torch.uint8)
    return tensor


def _runs_locally(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is one rank (the collective is a local copy). First raises the watch's
    error once a collective timed out: a new one on the aborted communicators would raise torch's
    error in place of the one that names the late collective."""
    PROCESS_COLLECTIVE_WATCH.raise_if_failed()
    return dist.get_world_size(group) == 1


def _copy_unless_same(destination: torch.Tensor, source: torch.Tensor) -> None:
    if destination.numel() != source.numel() or destination.dtype != source.dtype:
        raise ValueError(
            f"a collective over one rank got {source.numel()} {source.dtype} elements for a result of "
            f"{destination.numel()} {destination.dtype}"
        )
    if not holds_values(destination) or destination.data_ptr() != source.data_ptr():
        destination.copy_(source.view(destination.shape))
    return None


def wait_for(
    work: dist.Work | HostWork | None, timeout: float | None, what: str, group: dist.ProcessGroup, device: torch.device
) -> None:
    """Waits for an asynchronous collective over ``group`` on ``device`` (``work`` None: one that
    ran locally, nothing to wait for). A failure (``timeout`` seconds passed, the process group's
    own timeout, or a peer that died) is raised naming ``what`` and the ranks of ``group`` that are
    not taking part (collective_watch.py). The process group is unusable afterwards: the job must
    restart (e.g. torchrun --max-restarts, from the last checkpoint).

    On CPU (gloo) this thread waits, for at most ``timeout``. On CUDA (NCCL) a wait only orders
    the current stream after the collective; with a timeout the watch thread holds the collective
    to it and, past it, aborts the communicators, and the error is raised here at a later wait."""
    PROCESS_COLLECTIVE_WATCH.raise_if_failed()
    if work is None:
        return
    if device.type == "cuda":
        work.wait()
        if timeout is not None:
            PROCESS_COLLECTIVE_WATCH.start()
            PROCESS_COLLECTIVE_WATCH.watch(work, timeout, what, group)
        return
    if timeout is not None:
        PROCESS_COLLECTIVE_WATCH.start()
        PROCESS_COLLECTIVE_WATCH.blocking_wait(what)
    try:
        if timeout is not None and not _finishes_within(work, timeout):
            raise RuntimeError(f"no result within collective_timeout={timeout:g} s")
        work.wait()
    except RuntimeError as error:
        missing = f"; {PROCESS_COLLECTIVE_WATCH.missing_ranks(group, what)}" if timeout is not None else ""
        raise RuntimeError(
            f"{what} did not complete: {error}{missing}. A rank is not taking part in this collective: "
            "every rank must run the same forwards and backwards with the same model and configuration; "
            "a rank may also have died. Restart the job from its last checkpoint"
        ) from error
    finally:
        PROCESS_COLLECTIVE_WATCH.blocking_wait(None)


def _finishes_within(work: dist.Work | HostWork, timeout: float) -> bool:
    """Whether ``work`` completes within ``timeout`` seconds. Not every backend's Work honours
    ``wait(timeout)`` (gloo's reduce-scatter blocks regardless), so a helper thread waits and
    this one stops waiting for it; the caller's own ``wait()`` then returns at once or raises."""
    waiter = threading.Thread(target=_wait_ignoring_errors, args=(work,), name="megatron_fsdp-wait", daemon=True)
    waiter.start()
    waiter.join(timeout)
    return not waiter.is_alive()


def _wait_ignoring_errors(work: dist.Work | HostWork) -> None:
    try:
        work.wait()
    except RuntimeError:
        pass  # the caller's wait() raises it again, on its own thread
