"""Muon's cost in sharded training: ours and torch FSDP2, each with AdamW alone and with Muon on
the blocks' matrices (AdamW on the rest), the same GPT (examples/gpt_model.py), data and seed.

    python benchmarks/muon_step.py --nproc-per-node 4 --config 8B --micro-batches 8 --out muon.json

Each row runs in its own ``torchrun --standalone`` (as benchmarks/step_time.py's rows): a step
accumulates ``--micro-batches`` micro-batches of ``--micro-batch`` x ``--seq-len`` tokens per
rank, then steps the optimizers. Ours: a bf16 model, fp32 main weights and gradients, the
transformer blocks as units; FSDP2: an fp32 model, ``fully_shard`` per block and on the root,
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. Muon is ``torch.optim.Muon``
(lr 0.02, its defaults otherwise), AdamW fused (lr 1e-4). FSDP2 hands torch's Muon each rank's
shard of a matrix as the matrix (tests/test_whole_matrix_optimizers.py's docstring and
docs/whole_matrix_optimizers.md: 6.7% off one process after 4 steps); its row is timed for
reference only.

Per row: the median step, the median of Muon's ``step()`` alone and of AdamW's (each between two
synchronisations), peak allocated memory and the last loss. The Muon rows also get the step's
ideal on this machine: Newton-Schulz FLOPs (``5 (4 m^2 n + 2 m^3)`` per ``m x n`` matrix, ``m <=
n``) over the world, at the bf16 matmul rate measured here on the largest matrix's shape, plus
ours's two exchanges (weights and gradients to the owners, ``2 M / W`` values a rank; weights
back, ``M / W``; fp32) at the all-to-all time measured here for those sizes.

Then a projection, from our Muon row's measured parts, of Muon's step at 8 to 1024 GPUs (each
GPU's batch kept): the most loaded owner's Newton-Schulz (owners as the engine assigns them: with
few large matrices and many ranks some own nothing) at the measured matmul rate, plus the
exchanges (``3 M (W-1)/W^2`` values a rank) at the measured all-to-all rate, which holds within a
node (across nodes the rate is lower and the exchange share higher), as a share of our AdamW row's
whole step.

``--device cpu`` runs it on gloo with a small model: a smoke test of the script, times without
meaning.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_time  # noqa: E402
from step_time import TransformerBlock  # noqa: E402

ROWS = ("megatron_fsdp AdamW", "megatron_fsdp Muon", "torch FSDP2 AdamW", "torch FSDP2 Muon")
MUON_LR, ADAMW_LR = 0.02, 1e-4
NEWTON_SCHULZ_STEPS = 5  # torch.optim.Muon's default
PROJECTED_WORLDS = [8, 16, 32, 64, 128, 256, 512, 1024]


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """Muon takes the blocks' 2-D weights; embeddings, the head, norms and biases stay on AdamW."""
    return name.startswith("blocks.") and param.dim() == 2


def newton_schulz_flops(shapes: list[tuple[int, int]]) -> int:
    """FLOPs of Muon's Newton-Schulz over matrices of ``shapes``: per iteration ``X X^T``
    (``2 m^2 n``), ``A A`` (``2 m^3``) and ``B X`` (``2 m^2 n``), ``m <= n``."""
    total = 0
    for rows, columns in shapes:
        m, n = min(rows, columns), max(rows, columns)
        total += NEWTON_SCHULZ_STEPS * (4 * m * m * n + 2 * m**3)
    return total


def _optimizers(named: list[tuple[str, torch.nn.Parameter]], muon: bool) -> list[torch.optim.Optimizer]:
    fused = named[0][1].device.type == "cuda"
    if not muon:
        return [torch.optim.AdamW([p for _, p in named], lr=ADAMW_LR, fused=fused)]
    matrices = [p for n, p in named if is_muon_matrix(n, p)]
    rest = [p for n, p in named if not is_muon_matrix(n, p)]
    return [torch.optim.Muon(matrices, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAMW_LR, fused=fused)]


def _ours(config, device: torch.device, muon: bool):
    import megatron_fsdp

    model = step_time._build(config, device, torch.bfloat16)
    optimizers = _optimizers(list(model.named_parameters()), muon)
    policy = megatron_fsdp.MixedPrecisionPolicy(
        main_params_dtype=torch.float32, main_grads_dtype=torch.float32, grad_comm_dtype=torch.float32
    )
    model, first = megatron_fsdp.fully_shard(
        model, optimizers[0], fsdp_unit_modules=[TransformerBlock], zero_dp_strategy="optim_grads_params",
        mixed_precision_policy=policy,
    )
    return model, [first] + [megatron_fsdp.fully_shard_optimizer(o, model=model) for o in optimizers[1:]]


def _fsdp2(config, device: torch.device, muon: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = step_time._build(config, device, torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, _optimizers(list(model.named_parameters()), muon)


def _timed(device: torch.device, work) -> float:
    step_time._synchronize(device)
    started = time.perf_counter()
    work()
    step_time._synchronize(device)
    return time.perf_counter() - started


def _matmul_tflops(shape: tuple[int, int], device: torch.device) -> float:
    """bf16 ``X X^T`` throughput on a matrix of ``shape`` (Newton-Schulz's largest product)."""
    m, n = min(shape), max(shape)
    x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    x @ x.T
    seconds = statistics.median(_timed(device, lambda: x @ x.T) for _ in range(10))
    return 2 * m * m * n / seconds / 1e12


def _all_to_all_seconds(values: int, device: torch.device) -> float:
    """An all-to-all of ``values`` fp32 values a rank (split evenly), median of five."""
    world = dist.get_world_size()
    values = max(world, values - values % world)
    sent, received = torch.zeros(values, device=device), torch.empty(values, device=device)
    dist.all_to_all_single(received, sent)
    return statistics.median(_timed(device, lambda: dist.all_to_all_single(received, sent)) for _ in range(5))


def _ideal(config, device: torch.device) -> dict:
    """The Muon step's ideal on this machine (see the module docstring)."""
    model = step_time._build(config, torch.device("meta"), torch.float32)
    shapes = [tuple(p.shape) for n, p in model.named_parameters() if is_muon_matrix(n, p)]
    world = dist.get_world_size()
    values = sum(rows * columns for rows, columns in shapes)
    tflops = _matmul_tflops(max(shapes, key=lambda s: s[0] * s[1]), device)
    compute = newton_schulz_flops(shapes) / world / (tflops * 1e12)
    exchanges = _all_to_all_seconds(2 * values // world, device) + _all_to_all_seconds(values // world, device)
    return {
        "ideal_muon_ms": (compute + exchanges) * 1e3, "matmul_tflops": tflops, "ideal_exchange_ms": exchanges * 1e3,
        "torch_muon_on_owned_ms": _torch_muon_on_owned_seconds(shapes, device) * 1e3,
        # What a rank sent the others in those two all-to-alls, per second.
        "exchange_gb_per_s": _exchanged_values(values, world) * 4 / exchanges / 1e9,
    }


def _torch_muon_on_owned_seconds(shapes: list[tuple[int, int]], device: torch.device) -> float:
    """torch's Muon step alone on plain fp32 matrices: those this rank owns (the engine's
    ``assign_owners``), with gradients, as the owner steps them; the median of five after one."""
    from megatron_fsdp.engine.params.owner_assignment import assign_owners

    rank, world = dist.get_rank(), dist.get_world_size()
    owned = [shape for shape, owner in zip(shapes, assign_owners(shapes, world)) if owner == rank]
    matrices = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in owned]
    for matrix in matrices:
        matrix.grad = torch.randn_like(matrix)
    muon = torch.optim.Muon(matrices, lr=MUON_LR)
    muon.step()
    seconds = statistics.median(_timed(device, muon.step) for _ in range(5))
    dist.barrier()
    return seconds


def _exchanged_values(values: int, world: int) -> float:
    """fp32 values a rank sends the others in the owner exchanges for ``values`` values in all:
    ``2 M (W-1)/W^2`` to the owners (weights and gradients), ``M (W-1)/W^2`` back."""
    return 3 * values * (world - 1) / world**2


def projected_muon_step(shapes: list[tuple[int, int]], worlds: list[int], tflops: float, gb_per_s: float) -> list[dict]:
    """Muon's step at each world size of ``worlds`` from the parts measured at one: the most loaded
    owner's Newton-Schulz (owners as the engine assigns them) at ``tflops``, plus the exchanges at
    ``gb_per_s`` a rank (the measured rate: within a node; across nodes it is lower)."""
    from megatron_fsdp.engine.params.owner_assignment import assign_owners

    values = sum(rows * columns for rows, columns in shapes)
    projected = []
    for world in worlds:
        load = [0] * world
        for shape, owner in zip(shapes, assign_owners(shapes, world)):
            load[owner] += newton_schulz_flops([shape])
        newton_schulz_ms = max(load) / (tflops * 1e12) * 1e3
        exchange_ms = _exchanged_values(values, world) * 4 / (gb_per_s * 1e9) * 1e3
        projected.append({"world": world, "newton_schulz_ms": newton_schulz_ms, "exchange_ms": exchange_ms,
                          "muon_step_ms": newton_schulz_ms + exchange_ms})
    return projected


def _run_row(name: str, config, args, device: torch.device) -> dict:
    muon = name.endswith("Muon")
    row = _ideal(config, device) if muon else {}
    if device.type == "cuda":  # the ideal's buffers are not the row's memory
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, optimizers = (_ours if name.startswith("megatron_fsdp") else _fsdp2)(config, device, muon)
    steps, optimizer_times, losses = [], {type(o).__name__: [] for o in optimizers}, []
    rank = dist.get_rank()
    for step in range(args.warmup + args.steps):
        step_time._synchronize(device)
        started = time.perf_counter()
        loss = torch.zeros((), device=device)
        for micro in range(args.micro_batches):
            tokens = step_time.batch(config, args, step * args.micro_batches + micro, rank, device)
            logits = model(tokens[:, :-1])
            micro_loss = F.cross_entropy(logits.float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1))
            (micro_loss / args.micro_batches).backward()
            loss += micro_loss.detach() / args.micro_batches
        timed = {type(o).__name__: _timed(device, o.step) for o in optimizers}
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        step_time._synchronize(device)
        if step >= args.warmup:
            steps.append(time.perf_counter() - started)
            for kind, seconds in timed.items():
                optimizer_times[kind].append(seconds)
        losses.append(loss)
    dist.all_reduce(losses[-1])
    row.update({
        "median_step_s": statistics.median(steps),
        **{f"median_{kind.lower()}_step_ms": statistics.median(times) * 1e3 for kind, times in optimizer_times.items()},
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "final_loss": losses[-1].item() / dist.get_world_size(),
    })
    if muon:
        row["muon_step_over_ideal"] = row["median_muon_step_ms"] / row["ideal_muon_ms"]
    del model, optimizers
    gc.collect()
    return row


def _work(args) -> None:
    """One row in this torchrun's processes; rank 0 writes it to ``args.row_out``."""
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    config = step_time.model_config(args)
    if args.layers is not None:
        config = dataclasses.replace(config, layers=args.layers)
    row = {"implementation": args.worker, "layers": config.layers, "world": dist.get_world_size(), **_run_row(args.worker, config, args, device)}
    if dist.get_rank() == 0:
        with open(args.row_out, "w") as handle:
            json.dump(row, handle)
    dist.destroy_process_group()


def _row_in_own_processes(name: str, args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "row.json")
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc_per_node}",
            os.path.abspath(__file__), "--worker", name, "--row-out", path, "--config", args.config,
            "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--micro-batches", str(args.micro_batches),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
        ] + (["--layers", str(args.layers)] if args.layers is not None else [])
        process = subprocess.Popen(command, env=step_time._child_environment(name, args))
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            step_time._stop(process)
            return {"implementation": name, "error": f"timed out after {args.timeout:g} s"}
        if not os.path.exists(path):
            return {"implementation": name, "error": f"failed: torchrun exited with {code} (its output is above)"}
        with open(path) as handle:
            return json.load(handle)


def _report(rows: list[dict]) -> None:
    columns = [("step s", "median_step_s", ".3f"), ("Muon ms", "median_muon_step_ms", ".1f"),
               ("AdamW ms", "median_adamw_step_ms", ".1f"), ("ideal ms", "ideal_muon_ms", ".1f"),
               ("torch ms", "torch_muon_on_owned_ms", ".1f"),
               ("x ideal", "muon_step_over_ideal", ".2f"), ("peak GiB", "peak_allocated_gib", ".1f")]
    print(f"{'row':<22}" + "".join(f"{title:>10}" for title, _, _ in columns))
    for row in rows:
        if "error" in row:
            print(f"{row['implementation']:<22}{row['error']}")
            continue
        cells = (format(row[key], form) if row.get(key) is not None else "-" for _, key, form in columns)
        print(f"{row['implementation']:<22}" + "".join(f"{cell:>10}" for cell in cells))


def _report_projection(rows: list[dict], args) -> list[dict]:
    """How Muon's step would fall with the world (weak scaling: each GPU's batch stays), from our
    Muon row's measured parts, as a share of our AdamW row's whole step."""
    muon = next((row for row in rows if row.get("implementation") == "megatron_fsdp Muon" and "error" not in row), None)
    adamw = next((row for row in rows if row.get("implementation") == "megatron_fsdp AdamW" and "error" not in row), None)
    if muon is None:
        return []
    if muon["world"] == 1:
        print("\nNo projection by world size: at world 1 there is no exchange to measure its rate from.")
        return []
    config = step_time.model_config(args)
    if args.layers is not None:
        config = dataclasses.replace(config, layers=args.layers)
    model = step_time._build(config, torch.device("meta"), torch.float32)
    shapes = [tuple(p.shape) for n, p in model.named_parameters() if is_muon_matrix(n, p)]
    projected = projected_muon_step(shapes, PROJECTED_WORLDS, muon["matmul_tflops"], muon["exchange_gb_per_s"])
    print(f"\nMuon's step by world size, from the parts measured at world {muon['world']} "
          f"({muon['matmul_tflops']:.0f} TFLOP/s bf16, {muon['exchange_gb_per_s']:.0f} GB/s a rank):")
    print(f"{'world':>6}{'NS ms':>10}{'exch. ms':>10}{'step ms':>10}{'of AdamW step':>15}")
    for entry in projected:
        share = f"{entry['muon_step_ms'] / (adamw['median_step_s'] * 1e3):.1%}" if adamw else "-"
        print(f"{entry['world']:>6}{entry['newton_schulz_ms']:>10.1f}{entry['exchange_ms']:>10.1f}"
              f"{entry['muon_step_ms']:>10.1f}{share:>15}")
    return projected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step_time.add_model_arguments(parser)
    parser.add_argument("--layers", type=int, default=None, help="--config's width at this depth")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches accumulated a step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated, of: " + ", ".join(ROWS))
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _work(args)
        return
    wanted = [name.strip() for name in args.rows.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    rows = []
    for name in wanted:
        rows.append(_row_in_own_processes(name, args))
        print(json.dumps(rows[-1]), flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"rows": rows, "arguments": vars(args)}, handle, indent=2)
    _report(rows)
    projected = _report_projection(rows, args)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"rows": rows, "projected_muon_step": projected, "arguments": vars(args)}, handle, indent=2)


if __name__ == "__main__":
    main()
