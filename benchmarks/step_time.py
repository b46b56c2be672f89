"""Training step time and memory of megatron_fsdp against torch FSDP2, DDP and the single-GPU
floor, on the same GPT (examples/gpt_model.py), data and seed, in one run.

    torchrun --standalone --nproc_per_node 2 benchmarks/step_time.py --config 1.3B --micro-batch 1 --seq-len 1024

Every implementation computes in bf16 with fp32 master weights and AdamW. Reported per
implementation: median step time over --steps timed steps after --warmup, tokens/s/GPU, model
TFLOP/s/GPU, peak allocated and reserved memory, and the final loss.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import megatron_fsdp  # noqa: E402
from gpt_model import GPT, GPTConfig, TransformerBlock, training_flops_per_token  # noqa: E402

CONFIGS = {
    "small": GPTConfig(vocab_size=32000, seq_len=1024, layers=4, hidden=512, heads=8, ffn=1408),
    "1.3B": GPTConfig(vocab_size=32000, seq_len=2048, layers=24, hidden=2048, heads=16, ffn=5632),
    "8B": GPTConfig(vocab_size=128256, seq_len=4096, layers=32, hidden=4096, heads=32, ffn=14336),
}


def _build(config: GPTConfig, device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    return model.to(dtype)


def _megatron(strategy: int, comm: torch.dtype, double_buffer: bool = False, nccl_ub: bool = False) -> Callable:
    def make(config, device):
        model = _build(config, device, torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32, grad_comm_dtype=comm)
        return megatron_fsdp.fully_shard(
            model, optimizer, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy, mixed_precision_policy=policy,
            fsdp_double_buffer=double_buffer, nccl_ub=nccl_ub,
        ) + (False,)

    return make


def _fsdp2(config, device):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _build(config, device, torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), False


def _compiled(make: Callable) -> Callable:
    """``make`` with each transformer block compiled after sharding (torchtitan's recipe)."""

    def build(config, device):
        model, optimizer, autocast = make(config, device)
        inner = model.module if isinstance(model, megatron_fsdp.MegatronFSDP) else model
        for block in inner.blocks:
            block.compile()
        return model, optimizer, autocast

    return build


def _ddp(config, device):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_build(config, device, torch.float32), device_ids=[device.index])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), True


def _single(config, device):
    model = _build(config, device, torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), True


IMPLEMENTATIONS: dict[str, Callable] = {
    "megatron_fsdp optim_grads_params fp32-comm": _megatron(3, torch.float32),
    "megatron_fsdp optim_grads_params fp32-comm compiled": _compiled(_megatron(3, torch.float32)),
    "megatron_fsdp optim_grads_params bf16-comm": _megatron(3, torch.bfloat16),
    "megatron_fsdp optim_grads_params fp32-comm double-buffer": _megatron(3, torch.float32, double_buffer=True),
    "megatron_fsdp optim_grads_params fp32-comm nccl-ub": _megatron(3, torch.float32, nccl_ub=True),
    "megatron_fsdp optim_grads fp32-comm": _megatron(2, torch.float32),
    "megatron_fsdp optim fp32-comm": _megatron(1, torch.float32),
    "torch FSDP2": _fsdp2,
    "torch FSDP2 compiled": _compiled(_fsdp2),
    "torch DDP": _ddp,
    "single GPU (no communication)": _single,
}


def batch(config: GPTConfig, args, step: int, rank: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(step * 1000 + rank)
    return torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), device=device, generator=generator)


def train_step(model, optimizer, autocast: bool, config: GPTConfig, tokens: torch.Tensor) -> torch.Tensor:
    """One step: forward, backward, optimizer step; returns the loss (not synchronised)."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _run(name: str, make: Callable, config: GPTConfig, args, device: torch.device) -> dict:
    # The previous implementation's model and optimizer sit in reference cycles (hooks): collect
    # them before measuring this one's memory.
    gc.collect()
    torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model, optimizer, autocast = make(config, device)
    rank = dist.get_rank()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        tokens = batch(config, args, step, rank, device)
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = train_step(model, optimizer, autocast, config, tokens)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
        losses.append(loss)
    final_loss = torch.stack(losses[-5:]).float().mean()
    dist.all_reduce(final_loss)
    median = statistics.median(times)
    tokens_per_s = args.micro_batch * args.seq_len / median
    flops = training_flops_per_token(config, args.seq_len)
    row = {
        "implementation": name,
        "median_step_s": median,
        "tokens_per_s_per_gpu": tokens_per_s,
        "tflops_per_gpu": flops * tokens_per_s / 1e12,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "final_loss": final_loss.item() / dist.get_world_size(),
        # Memory still allocated by earlier implementations when this one started (should be ~0).
        "leftover_gib": leftover / 2**30,
    }
    # The last loss's graph reaches the parameters (and through their hooks, the whole model).
    del model, optimizer, losses, loss
    return row


def _wanted(impls: str) -> list[str]:
    """Implementations by comma-separated names: an exact name picks itself, anything else every
    name containing it; 'all' picks all."""
    if impls == "all":
        return list(IMPLEMENTATIONS)
    picked = set()
    for item in impls.split(","):
        picked.update([item] if item in IMPLEMENTATIONS else [n for n in IMPLEMENTATIONS if item in n])
    return [n for n in IMPLEMENTATIONS if n in picked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="1.3B")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--impls", default="all", help="comma-separated names (exact, else substrings) or 'all'")
    parser.add_argument("--out", default=None, help="write rows and setting as JSON here")
    args = parser.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    config = GPTConfig(**{**CONFIGS[args.config].__dict__, "seq_len": args.seq_len})
    wanted = _wanted(args.impls)
    rows = []
    for name in wanted:
        try:
            rows.append(_run(name, IMPLEMENTATIONS[name], config, args, device))
        except torch.OutOfMemoryError as error:
            # Where it ran out (the innermost frame of ours or the benchmark's) and how much was held.
            frames = [f for f in traceback.extract_tb(error.__traceback__) if "torch/" not in f.filename]
            where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"
            rows.append({"implementation": name, "error": "out of memory", "where": where,
                         "message": str(error).split("See documentation")[0].strip()})
            gc.collect()
            torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            print(json.dumps(rows[-1]), flush=True)
    if dist.get_rank() == 0:
        _report(rows, args, config)
    dist.destroy_process_group()


def _report(rows: list[dict], args, config: GPTConfig) -> None:
    setting = {
        "device": torch.cuda.get_device_name(),
        "gpus": dist.get_world_size(),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "date": datetime.date.today().isoformat(),
        "config": args.config,
        "model": config.__dict__,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "timed_steps": args.steps,
        "warmup": args.warmup,
    }
    fsdp2 = next((r for r in rows if r["implementation"] == "torch FSDP2" and "error" not in r), None)
    print(f"\n{setting['device']} x{setting['gpus']}, torch {setting['torch']}, NCCL {setting['nccl']}, {setting['date']}; "
          f"{args.config}, micro-batch {args.micro_batch}, seq {args.seq_len}, median of {args.steps} steps")
    print("| implementation | step ms | vs FSDP2 | tokens/s/GPU | TFLOP/s/GPU | peak alloc GiB | peak reserved GiB | vs FSDP2 reserved | final loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['implementation']} | {r['error']} | | | | | | | |")
            continue
        step_ratio = f"{r['median_step_s'] / fsdp2['median_step_s']:.2f}" if fsdp2 else "-"
        mem_ratio = f"{r['peak_reserved_gib'] / fsdp2['peak_reserved_gib']:.2f}" if fsdp2 else "-"
        print(f"| {r['implementation']} | {r['median_step_s'] * 1e3:.1f} | {step_ratio} | {r['tokens_per_s_per_gpu']:,.0f} | "
              f"{r['tflops_per_gpu']:.0f} | {r['peak_allocated_gib']:.1f} | {r['peak_reserved_gib']:.1f} | {mem_ratio} | {r['final_loss']:.4f} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"setting": setting, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
