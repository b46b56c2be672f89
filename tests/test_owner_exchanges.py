"""The owner exchanges of whole-tensor optimizers (megatron_fsdp/optim/owner_placement.py) run in
runs of bounded size: every whole tensor arrives on its owner exactly and every rank's piece comes
back exactly, while no single all-to-all makes an owner receive more than ``chunk_values`` values
(or one tensor, where a tensor alone is larger), and an owner's own pieces skip it. Flat pieces of uneven length and column blocks
(several rectangles a piece) are both covered, at world 2 over gloo."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_distributed
from megatron_fsdp.optim import owner_placement
from megatron_fsdp.engine.params.owner_assignment import assign_owners, exchange_chunks
from megatron_fsdp.optim.owner_placement import Route, flat_route, gather_to_owners, scatter_from_owners

SHAPES = [(6, 5), (4, 4), (9, 3), (2, 7), (8, 8), (3, 3)]
CHUNK_VALUES = 40  # below the sum of the shapes' sizes (256), above the largest but one


def _routes(mesh, world: int) -> list[Route]:
    """Even-numbered tensors as uneven flat ranges, odd ones as column blocks (one rectangle per
    row of the block, as a column-split weight's piece is laid out)."""
    owners = assign_owners(SHAPES, world)
    routes = []
    for index, ((rows, cols), owner) in enumerate(zip(SHAPES, owners)):
        shape = torch.Size((rows, cols))
        if index % 2 == 0:
            first = rows * cols // 3
            routes.append(flat_route(mesh, shape, ((0, first), (first, rows * cols - first)), owner))
        else:
            split = cols // 2
            blocks = [(0, split), (split, cols - split)]
            pieces = tuple(tuple(((row, start), (1, width)) for row in range(rows)) for start, width in blocks)
            routes.append(Route(mesh, shape, pieces, (rows, cols), owner))
    return routes


def _piece(whole: torch.Tensor, index: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of tensor ``index`` as _routes lays it out, taken by plain slicing."""
    rows, cols = whole.shape
    if index % 2 == 0:
        first = rows * cols // 3
        return whole.reshape(-1)[:first] if rank == 0 else whole.reshape(-1)[first:]
    split = cols // 2
    return (whole[:, :split] if rank == 0 else whole[:, split:]).reshape(-1)


def _exchange(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    routes = _routes(mesh, world)
    wholes = [torch.randn(shape, generator=torch.Generator().manual_seed(index)) for index, shape in enumerate(SHAPES)]
    received_sizes: list[int] = []
    exchange = owner_placement.all_to_all_uneven

    def recording(received, sent, received_splits, sent_splits, group):
        received_sizes.append(received.numel())
        return exchange(received, sent, received_splits, sent_splits, group)

    owner_placement.all_to_all_uneven = recording
    try:
        gathered = gather_to_owners(routes, [_piece(whole, index, rank) for index, whole in enumerate(wholes)], CHUNK_VALUES)
        gather_sizes = list(received_sizes)
        # The owners change their tensors; every rank must get its piece of the new values.
        stepped = [2 * whole.view(-1) + 1 if whole is not None else None for whole in gathered]
        into = [torch.full((route.piece_length(rank),), float("nan")) for route in routes]
        scatter_from_owners(routes, stepped, into, CHUNK_VALUES)
    finally:
        owner_placement.all_to_all_uneven = exchange
    gather_errors = {
        index: (gathered[index] is not None, (gathered[index].view(SHAPES[index]) - wholes[index]).abs().max().item() if gathered[index] is not None else None)
        for index in range(len(SHAPES))
    }
    scatter_errors = [(piece - _piece(2 * whole + 1, index, rank)).abs().max().item() for index, (piece, whole) in enumerate(zip(into, wholes))]
    return {
        "owners": [route.owner for route in routes],
        "gather": gather_errors,
        "scatter": scatter_errors,
        "gather_sizes": gather_sizes,
        "runs": len(exchange_chunks(routes, world, CHUNK_VALUES)),
        # An owner's own pieces skip the exchange: it receives only the other ranks' pieces.
        "others_pieces": sum(route.numel - route.sent_to_owner(rank) for route in routes if route.owner == rank),
    }


def test_exchanges_in_bounded_runs_bring_every_tensor_whole_and_every_piece_back() -> None:
    results = run_distributed(_exchange, 2)
    largest = max(rows * cols for rows, cols in SHAPES)
    for rank, result in enumerate(results):
        assert result["runs"] > 1, "the test's sizes should need several runs"
        assert len(result["gather_sizes"]) == result["runs"]
        assert max(result["gather_sizes"]) <= max(CHUNK_VALUES, largest), result["gather_sizes"]
        assert sum(result["gather_sizes"]) == result["others_pieces"], "an owner should receive only the other ranks' pieces"
        for index, (held, error) in result["gather"].items():
            assert held == (result["owners"][index] == rank), f"tensor {index} on rank {rank}"
            assert error is None or error == 0.0, f"tensor {index} arrived on its owner changed by {error}"
        assert max(result["scatter"]) == 0.0, f"rank {rank}'s pieces came back changed: {result['scatter']}"


def test_a_run_never_brings_an_owner_more_than_the_bound_unless_one_tensor_is_larger() -> None:
    mesh = None  # exchange_chunks reads only owners and sizes
    sizes = [30, 30, 50, 10, 10, 10, 200, 5]
    routes = [Route(mesh, torch.Size((size,)), None, (size,), owner) for size, owner in zip(sizes, [0, 1, 0, 0, 1, 1, 0, 1])]
    runs = exchange_chunks(routes, 2, 40)
    assert [index for run in runs for index in run] == list(range(len(sizes))), "runs keep the routes' order"
    for run in runs:
        per_owner = [sum(sizes[i] for i in run if routes[i].owner == owner) for owner in range(2)]
        assert max(per_owner) <= 40 or len(run) == 1, (run, per_owner)
