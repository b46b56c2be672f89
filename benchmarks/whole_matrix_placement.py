"""Where a whole-matrix optimizer's matrices meet it: the two placements docs/whole_matrix_optimizers.md
weighs, timed on gloo over CPU ranks for one Muon step of a small transformer's block matrices.

- ``replicated`` (``whole_tensor_optimizer(cls, placement="replicated")``, and faces without an
  owner route): every rank all-gathers every matrix's weights and gradient from the flat pieces in
  one collective, runs torch.optim.Muon on every matrix and keeps its own piece.
- ``owner`` (megatron_fsdp's default): each matrix belongs to one rank (megatron_fsdp's
  ``assign_owners``: largest Newton-Schulz cost first, to the least loaded rank); the weight and
  gradient pieces go to the owners in one all-to-all, only the owner runs Muon on a matrix, and
  the new weights go back to the ranks as their pieces in a second all-to-all
  (``gather_to_owners`` / ``scatter_from_owners``, as the engine's step does).

Run: ``torchrun --nproc-per-node 2 benchmarks/whole_matrix_placement.py [--hidden 256 --layers 4]``
(rank 0 prints one line per placement: the median step time over the timed steps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp.engine.params.owner_assignment import assign_owners
from megatron_fsdp.optim.owner_placement import flat_route, gather_to_owners, scatter_from_owners


def block_shapes(hidden: int, layers: int) -> list[tuple[int, int]]:
    """The 2-D weights of ``layers`` GPT blocks: qkv, attention out, MLP up and down."""
    return [shape for _ in range(layers) for shape in ((3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden))]


def _chunk(numel: int, world: int) -> int:
    return -(-numel // world)


def _piece(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's flat piece of ``full`` (zero-padded to an equal length on every rank)."""
    size = _chunk(full.numel(), world)
    flat = torch.zeros(size * world, dtype=full.dtype)
    flat[: full.numel()] = full.reshape(-1)
    return flat[rank * size : (rank + 1) * size].clone()


def _whole(pieces: list[torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    return torch.cat(pieces)[: shape[0] * shape[1]].view(shape)


def replicated_step(weights: list[torch.Tensor], grads: list[torch.Tensor], shapes: list[tuple[int, int]], muon: dict) -> None:
    world = dist.get_world_size()
    rank = dist.get_rank()
    # One all-gather for every weight and gradient piece, as megatron_fsdp's gather_whole does.
    local = torch.cat([*weights, *grads])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    sizes = [piece.numel() for piece in (*weights, *grads)]
    per_rank = [row.split(sizes) for row in gathered]
    for index, shape in enumerate(shapes):
        whole = torch.nn.Parameter(_whole([per_rank[r][index] for r in range(world)], shape))
        whole.grad = _whole([per_rank[r][len(shapes) + index] for r in range(world)], shape)
        optimizer = muon.setdefault(index, torch.optim.Muon([whole], lr=0.02))
        optimizer.param_groups[0]["params"] = [whole]
        optimizer.state = {whole: optimizer.state.get(whole, next(iter(optimizer.state.values()), {}))}
        optimizer.step()
        weights[index].copy_(_piece(whole.detach(), rank, world))


def owner_step(weights: list[torch.Tensor], grads: list[torch.Tensor], shapes: list[tuple[int, int]], muon: dict) -> None:
    if "mesh" not in muon:
        muon["mesh"] = init_device_mesh("cpu", (dist.get_world_size(),))
    mesh = muon["mesh"]
    world = mesh.size(0)
    owners = assign_owners(shapes, world)
    routes = [flat_route(mesh, torch.Size(shape), _pieces(shape[0] * shape[1], world), owner) for shape, owner in zip(shapes, owners)]
    wholes = gather_to_owners(routes + routes, weights + grads)
    new_wholes: list[torch.Tensor | None] = [None] * len(shapes)
    for index, shape in enumerate(shapes):
        if wholes[index] is None:
            continue
        whole = torch.nn.Parameter(wholes[index].view(shape))
        whole.grad = wholes[len(shapes) + index].view(shape)
        optimizer = muon.setdefault(index, torch.optim.Muon([whole], lr=0.02))
        optimizer.param_groups[0]["params"] = [whole]
        optimizer.state = {whole: optimizer.state.get(whole, next(iter(optimizer.state.values()), {}))}
        optimizer.step()
        new_wholes[index] = whole.detach()
    me = mesh.get_local_rank(0)
    scatter_from_owners(routes, new_wholes, into=[weight[: route.piece_length(me)] for weight, route in zip(weights, routes)])


def _pieces(numel: int, world: int) -> tuple[tuple[int, int], ...]:
    """Where each rank's piece (``_piece``, unpadded) lies in the flattened matrix."""
    size = _chunk(numel, world)
    return tuple((min(rank * size, numel), max(0, min(size, numel - rank * size))) for rank in range(world))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = block_shapes(args.hidden, args.layers)
    generator = torch.Generator().manual_seed(0)
    full_weights = [torch.randn(shape, generator=generator) * 0.02 for shape in shapes]
    full_grads = [torch.randn(shape, generator=generator) for shape in shapes]
    results = {}
    for name, step in (("replicated", replicated_step), ("owner", owner_step)):
        weights = [_piece(w, rank, world) for w in full_weights]
        grads = [_piece(g, rank, world) for g in full_grads]
        muon: dict = {}
        times = []
        for index in range(args.steps + 1):
            dist.barrier()
            start = time.perf_counter()
            step(weights, grads, shapes, muon)
            dist.barrier()
            if index > 0:  # the first step creates the momentum buffers
                times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times), [w.clone() for w in weights])
    same = all(torch.equal(a, b) for a, b in zip(results["replicated"][1], results["owner"][1]))
    if rank == 0:
        numel = sum(m * n for m, n in shapes)
        for name, (seconds, _) in results.items():
            print(f"world {world}, {len(shapes)} matrices, {numel / 1e6:.2f}M values: {name} {seconds * 1e3:.1f} ms/step")
        print(f"same weights from both placements: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
