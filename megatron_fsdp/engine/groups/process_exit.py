"""What a process whose collectives ran on gloo does before the interpreter tears down.

gloo's worker threads drop their last reference to a collective's tensors a moment after the
collective completes. When Python dropped its own references first (a temporary buffer), that
drop frees a Python object and must take the GIL; once the interpreter is finalizing, taking it
ends the thread and ``std::terminate`` aborts the process after the script succeeded ("terminate
called without an active exception", torch issue 190489), even after ``destroy_process_group``,
since meshes and models still hold the group. The engine's own collectives wait for that drop
(``collectives.HostWork``); for the ones torch runs on the same groups (a checkpoint's object
collectives), the handler registered here releases the GIL for a moment before finalizing, and
destroys the default group when megatron_fsdp created it (``init_default_group``), as torch asks
of whoever creates one.
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

# Long enough for a descheduled worker to run on a loaded machine; paid once, at exit.
_WORKERS_SETTLE_S = 0.1

_registered = False
_destroy_default_group = False


def settle_gloo_at_exit(*, destroy_default_group: bool = False) -> None:
    """Registers (once per process) the exit handler for a process using gloo; with
    ``destroy_default_group``, the handler also destroys the default group if it still exists."""
    global _registered, _destroy_default_group
    _destroy_default_group = _destroy_default_group or destroy_default_group
    if not _registered:
        atexit.register(_settle)
        _registered = True


def _settle() -> None:
    if _destroy_default_group and dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(_WORKERS_SETTLE_S)  # the GIL released: gloo's workers drop what torch's collectives left them
