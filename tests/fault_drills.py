"""One rank of a sharded job fails mid-step while the others are in a collective: it is killed
(SIGKILL, as a crashed host), stops answering (sleeps past the timeout) or its step raises (out of
memory). The others must end with megatron_fsdp's error naming the late collective and the missing
rank within collective_timeout (plus the heartbeat probe), on gloo and on NCCL."""

from __future__ import annotations

import os
import signal
import time

import torch

import megatron_fsdp
from megatron_fsdp.engine.groups.collective_watch import PROBE_SECONDS
from models import Block, make_batch, make_model

TIMEOUT = 3.0
FAULTS = ("killed", "stops answering", "out of memory")


def _fail(fault: str, device: torch.device) -> None:
    if fault == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "stops answering":
        time.sleep(4 * TIMEOUT)
    elif fault == "out of memory":
        # More than any device holds: the allocator raises as a step too large would.
        torch.empty(1 << 50, dtype=torch.uint8, device=device)


def one_rank_fails(rank: int, world: int, fault: str, device_type: str) -> dict | None:
    """The last rank runs forward, then fails as ``fault`` says instead of running backward; the
    others train on and report how long after starting backward they raised, and what."""
    device = torch.device(device_type, torch.cuda.current_device() if device_type == "cuda" else 0)
    model, optimizer = _sharded(device)
    tokens, targets = (t.to(device) for t in make_batch(0, 2 * world))
    loss = model(tokens[rank::world], targets[rank::world])
    if rank == world - 1:
        try:
            _fail(fault, device)
        except torch.OutOfMemoryError as error:
            return {"raised": type(error).__name__}
        return None
    started = time.monotonic()
    try:
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # returns once the watch aborted the communicators
        model(tokens[rank::world], targets[rank::world]).backward()
    except RuntimeError as error:
        return {"after": time.monotonic() - started, "message": str(error)}
    return {"after": time.monotonic() - started, "message": "no error"}


def _sharded(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[Block], collective_timeout=TIMEOUT)


def check_survivors(results: list[dict | None], fault: str, slack: float) -> None:
    """Every rank but the last raised our error in time, naming the collective and the last rank."""
    world = len(results)
    missing = world - 1
    if fault == "killed":
        named = f"rank {missing} stopped answering"
    else:
        # A rank whose step raised may still be alive (outside any collective) or already gone.
        named = f"rank {missing} "
    for rank, result in enumerate(results[:-1]):
        message = result["message"]
        assert "did not complete" in message and ("unit '" in message or "gradient reduction" in message), (
            f"rank {rank} did not name the late collective: {message}"
        )
        assert named in message, f"rank {rank} did not name rank {missing} ({named!r}): {message}"
        assert result["after"] < TIMEOUT + PROBE_SECONDS + slack, f"rank {rank} raised after {result['after']:.1f} s: {message}"
