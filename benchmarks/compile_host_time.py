"""Host time of a training step on the CPU, eager against each transformer block compiled after
sharding, for megatron_fsdp's two front doors and torch FSDP2, in one run: step_time.py's
"compiled" rows (and megatron_fsdp.fsdp2.fully_shard set up as its torch FSDP2 row) with a model
so small that a step's time is almost all host time (Python, dispatch, hooks, guards).

    python benchmarks/compile_host_time.py --nproc 1 --layers 16 --rounds 200

Every rank builds all four rows (step_time.py's builders, gloo), then runs them interleaved, one
step of each row per round, so load from other jobs on the machine spreads over all rows alike.
Reported per row: the median over rounds (after --warmup, which includes compilation) of the
process CPU time (all threads) of forward, backward, optimizer step and the whole step, and each
implementation's compiled-minus-eager step time per block. One intra-op thread: with more, idle
OpenMP workers spin and a shared machine's numbers mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import IMPLEMENTATIONS, _build, _compiled, train_step  # noqa: E402  (puts examples/ on the path)
from gpt_model import GPTConfig  # noqa: E402

OURS = "megatron_fsdp optim_grads_params fp32-comm"
OURS_IN_PLACE = "megatron_fsdp.fsdp2 fully_shard"
FSDP2 = "torch FSDP2"
EAGER_ROWS = (OURS, OURS_IN_PLACE, FSDP2)
ROWS = [row for name in EAGER_ROWS for row in (name, f"{name} compiled")]
PHASES = ("forward", "backward", "optimizer")


def _ours_in_place(config: GPTConfig, device: torch.device):
    """megatron_fsdp's FSDP2 front door as step_time.py's torch FSDP2 row: an fp32 model,
    ``fully_shard`` per block and on the root, bf16 compute with fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from megatron_fsdp.fsdp2 import fully_shard

    model = _build(config, device, torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), False


BUILDERS = {
    **IMPLEMENTATIONS,
    OURS_IN_PLACE: _ours_in_place,
    f"{OURS_IN_PLACE} compiled": _compiled(_ours_in_place),
}


def _step_phases(model, optimizer, autocast: bool, config: GPTConfig, tokens: torch.Tensor) -> dict[str, float]:
    """One training step's process CPU time (seconds) per phase, and in all."""
    marks = [time.process_time()]
    train_step(model, optimizer, autocast, config, tokens, after_phase=lambda: marks.append(time.process_time()))
    times = {phase: end - start for phase, start, end in zip(PHASES, marks, marks[1:])}
    times["step"] = marks[-1] - marks[0]
    return times


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, layers=args.layers, hidden=args.hidden, heads=args.heads,
        ffn=args.ffn,
    )
    device = torch.device("cpu")
    rows = {name: BUILDERS[name](config, device) for name in ROWS}
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), generator=generator)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in ROWS}
    for round_index in range(args.warmup + args.rounds):
        for name in ROWS:
            times = _step_phases(*rows[name], config, tokens)
            if round_index >= args.warmup:
                samples[name].append(times)
    if rank == 0:
        medians = {
            name: {key: statistics.median(s[key] for s in runs) * 1e3 for key in (*PHASES, "step")}
            for name, runs in samples.items()
        }
        with open(out, "w") as file:
            json.dump(medians, file)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", default=None, help="write the medians and the setting as JSON here")
    args = parser.parse_args()
    result_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"compile_host_time_{os.getpid()}.json")
    mp.spawn(_worker, args=(args.nproc, _free_port(), args, result_path), nprocs=args.nproc)
    with open(result_path) as file:
        medians = json.load(file)
    os.remove(result_path)
    print(f"{'row':<50} {'forward':>8} {'backward':>9} {'optimizer':>9} {'step':>8}  (CPU ms, medians)")
    for name, row in medians.items():
        print(f"{name:<50} {row['forward']:8.2f} {row['backward']:9.2f} {row['optimizer']:9.2f} {row['step']:8.2f}")
    for name in EAGER_ROWS:
        per_block = (medians[f"{name} compiled"]["step"] - medians[name]["step"]) / args.layers
        print(f"{name}: compiled minus eager, per block: {per_block * 1e3:+.0f} us")
    if args.out:
        setting = {**vars(args), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
        with open(args.out, "w") as file:
            json.dump({"setting": setting, "rows": medians}, file, indent=1)


if __name__ == "__main__":
    main()
