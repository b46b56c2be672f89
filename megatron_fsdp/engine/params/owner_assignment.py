"""Which rank of a mesh steps each whole tensor of a whole-tensor optimizer (Muon), and how the
exchanges that bring the tensors there run: pure arithmetic on shapes, the same on every rank.

optim/owner_placement.py moves the pieces by these rules; engine/planning/owner_plan.py plans the
memory they take from the same rules, before anything exists.
"""

from __future__ import annotations

from typing import Protocol

# Values an owner receives in one exchange: 256 MiB of fp32 a run, so the send and receive buffers
# beside the whole tensors stay small (one exchange for every tensor held them, the size of the
# whole tensors twice over, at once) while each all-to-all still moves enough for full bandwidth.
EXCHANGE_CHUNK_VALUES = 1 << 26


class Owned(Protocol):
    """What the exchanges read of a tensor: its owner rank and its number of values."""

    @property
    def owner(self) -> int: ...

    @property
    def numel(self) -> int: ...


def step_cost(shape: tuple[int, ...]) -> int:
    """The relative cost of a whole-tensor step on a tensor of ``shape``: Newton-Schulz on the
    matrix its first dim and the rest make, ``m n min(m, n)`` (a vector: its length)."""
    numel = 1
    for size in shape:
        numel *= size
    if len(shape) < 2 or numel == 0:
        return numel
    rows = shape[0]
    return numel * min(rows, numel // rows)


def assign_owners(shapes: list[tuple[int, ...]], world: int) -> list[int]:
    """The owner rank (``0 <= owner < world``) of each tensor of ``shapes``: largest
    :func:`step_cost` first, each to the rank with the least cost so far (ties: lower index, lower
    rank). Deterministic, so every rank computes the same owners."""
    load = [0] * world
    owners = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-step_cost(shapes[i]), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += step_cost(shapes[index])
    return owners


def exchange_chunks(routes: list[Owned], world: int, chunk_values: int) -> list[list[int]]:
    """The routes' indices in runs, in order, each run bringing every owner at most
    ``chunk_values`` values (a larger tensor makes a run of its own): each run is one exchange,
    so its buffers stay about ``chunk_values`` long beside the whole tensors. The same on every
    rank, from the routes alone."""
    runs: list[list[int]] = []
    owned = [0] * world
    for index, route in enumerate(routes):
        if not runs or owned[route.owner] + route.numel > chunk_values or max(owned) > chunk_values:
            runs.append([])
            owned = [0] * world
        runs[-1].append(index)
        owned[route.owner] += route.numel
    return runs
