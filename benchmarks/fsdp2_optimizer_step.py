"""The time of a plain torch optimizer's ``step()`` over parameters sharded in place by
``megatron_fsdp.fsdp2.fully_shard`` against the same optimizer over torch's own FSDP2, in one run.

    python benchmarks/fsdp2_optimizer_step.py --layers 4 --steps 10 --world 2

Each rank (gloo on the CPU, or NCCL with ``--device cuda``) builds tests/models.py's TinyGPT twice,
sharded per block and then the root by each implementation, and an optimizer over each one's
``parameters()``. Every round trains one step on each, interleaved (so a busy host slows both
alike), and times only ``optimizer.step()``; rank 0 prints the median over ``--steps`` rounds after
``--warmup`` per optimizer and ``foreach`` setting, and the ratio ours / FSDP2's. Neither step runs
a collective, so rank 0's times are the step's own. ``--json PATH`` also writes the rows there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "AdamW": lambda params, foreach: torch.optim.AdamW(params, lr=1e-3, foreach=foreach),
    "Adam": lambda params, foreach: torch.optim.Adam(params, lr=1e-3, foreach=foreach),
    "SGD momentum": lambda params, foreach: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach),
}


def _sharded_model(fully_shard: Callable, layers: int, device: torch.device) -> torch.nn.Module:
    from models import make_model

    model = make_model(seed=0, layers=layers).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _time_steps(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from megatron_fsdp.fsdp2 import fully_shard
    from models import make_batch

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    rows = []
    for name in args.optimizers.split(","):
        for foreach in (False, True):
            runs = {}
            for impl, shard in (("megatron_fsdp.fsdp2", fully_shard), ("torch FSDP2", torch_fully_shard)):
                model = _sharded_model(shard, args.layers, device)
                runs[impl] = (model, OPTIMIZERS[name](model.parameters(), foreach), [])
            for step in range(args.warmup + args.steps):
                tokens, targets = (t.to(device) for t in make_batch(step * world + rank, 2))
                for impl, (model, optimizer, times) in runs.items():
                    model(tokens, targets).backward()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    optimizer.step()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    if step >= args.warmup:
                        times.append(time.perf_counter() - start)
                    optimizer.zero_grad()
            medians = {impl: statistics.median(times) * 1e3 for impl, (_, _, times) in runs.items()}
            rows.append({
                "optimizer": name,
                "foreach": foreach,
                "ours_ms": medians["megatron_fsdp.fsdp2"],
                "fsdp2_ms": medians["torch FSDP2"],
                "ratio": medians["megatron_fsdp.fsdp2"] / medians["torch FSDP2"],
            })
    return rows


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        rows = _time_steps(rank, world, args)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        _report(rows, args)


def _report(rows: list[dict], args: argparse.Namespace) -> None:
    header = f"{'optimizer':<14}{'foreach':<9}{'ours ms':>9}{'FSDP2 ms':>10}{'ratio':>7}"
    lines = [header] + [
        f"{r['optimizer']:<14}{str(r['foreach']):<9}{r['ours_ms']:>9.2f}{r['fsdp2_ms']:>10.2f}{r['ratio']:>7.2f}" for r in rows
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        record = {"date": datetime.date.today().isoformat(), "config": config, "rows": rows}
        with open(args.json, "w") as file:
            json.dump(record, file, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--optimizers", default="AdamW", help=f"comma-separated, of: {', '.join(OPTIMIZERS)}")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_worker, args=(args.world, port, args), nprocs=args.world)


if __name__ == "__main__":
    main()
