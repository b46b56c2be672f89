"""Where a whole-matrix optimizer's matrices meet it: the two placements docs/whole_matrix_optimizers.md
weighs, timed on gloo over CPU ranks for one Muon step of a small transformer's block matrices.

- ``replicated`` (what megatron_fsdp does): every rank all-gathers every matrix's weights and
  gradient from the flat pieces in one collective, runs torch.optim.Muon on every matrix and
  keeps its own piece.
- ``owner``: each matrix belongs to one rank (largest first, to the least loaded rank); the
  gradient pieces are gathered there, only the owner runs Muon on it, and the new weights go back
  to the ranks as their pieces (scatter).

Run: ``torchrun --nproc-per-node 2 benchmarks/whole_matrix_placement.py [--hidden 256 --layers 4]``
(rank 0 prints one line per placement: the median step time over the timed steps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


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


def owners(shapes: list[tuple[int, int]], world: int) -> list[int]:
    """Each matrix's rank, balanced by size: largest first, to the least loaded rank."""
    load = [0] * world
    owner = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: -shapes[i][0] * shapes[i][1]):
        owner[index] = min(range(world), key=load.__getitem__)
        load[owner[index]] += shapes[index][0] * shapes[index][1]
    return owner


def owner_step(weights: list[torch.Tensor], grads: list[torch.Tensor], shapes: list[tuple[int, int]], muon: dict) -> None:
    world = dist.get_world_size()
    rank = dist.get_rank()
    for index, (shape, owner) in enumerate(zip(shapes, owners(shapes, world))):
        mine = rank == owner
        weight_pieces = [torch.empty_like(weights[index]) for _ in range(world)] if mine else None
        grad_pieces = [torch.empty_like(grads[index]) for _ in range(world)] if mine else None
        dist.gather(weights[index], weight_pieces, dst=owner)
        dist.gather(grads[index], grad_pieces, dst=owner)
        new_pieces = None
        if mine:
            whole = torch.nn.Parameter(_whole(weight_pieces, shape))
            whole.grad = _whole(grad_pieces, shape)
            optimizer = muon.setdefault(index, torch.optim.Muon([whole], lr=0.02))
            optimizer.param_groups[0]["params"] = [whole]
            optimizer.state = {whole: optimizer.state.get(whole, next(iter(optimizer.state.values()), {}))}
            optimizer.step()
            new_pieces = [_piece(whole.detach(), r, world) for r in range(world)]
        dist.scatter(weights[index], new_pieces, src=owner)


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
