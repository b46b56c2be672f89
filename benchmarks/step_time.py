"""Training step time and memory of megatron_fsdp against torch FSDP2, DDP and the single-GPU
floor, on the same GPT (examples/gpt_model.py), data and seed, in one run.

    torchrun --standalone --nproc_per_node 2 benchmarks/step_time.py --config 1.3B --micro-batch 1 --seq-len 1024

Every implementation computes in bf16 with fp32 master weights and AdamW. Reported per
implementation: median step time over --steps timed steps after --warmup, tokens/s/GPU, model
TFLOP/s/GPU, peak allocated and reserved memory, the final loss, and the host memory held
(resident set, pinned bytes; with CPU offloading the optimizer lives there).

``--layers 8,16`` runs --config's width at those depths; ``--largest`` goes through the depths
in order (default 8..64) and stops at the first that fails: the deepest model each
implementation trains. A depth whose offloaded state would not fit the host's available memory
(16 bytes per parameter) is skipped without trying, since the kernel would kill the run.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def _megatron(
    strategy: int, comm: torch.dtype, double_buffer: bool = False, nccl_ub: bool = False, offload: bool = False
) -> Callable:
    def make(config, device):
        model = _build(config, device, torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32, grad_comm_dtype=comm)
        return megatron_fsdp.fully_shard(
            model, optimizer, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy, mixed_precision_policy=policy,
            fsdp_double_buffer=double_buffer, nccl_ub=nccl_ub, cpu_offload=offload,
        ) + (False,)

    return make


def _fsdp2_with(offload: bool) -> Callable:
    def make(config, device):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        model = _build(config, device, torch.float32)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload_policy = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
        for block in model.blocks:
            fully_shard(block, mp_policy=policy, offload_policy=offload_policy)
        fully_shard(model, mp_policy=policy, offload_policy=offload_policy)
        # Offloaded, the parameters are on the host: torch's fused AdamW has a CPU kernel too.
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), False

    return make


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
    "megatron_fsdp optim_grads_params fp32-comm cpu-offload": _megatron(3, torch.float32, offload=True),
    "torch FSDP2": _fsdp2_with(offload=False),
    "torch FSDP2 compiled": _compiled(_fsdp2_with(offload=False)),
    "torch FSDP2 cpu-offload": _fsdp2_with(offload=True),
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
    # Pinned blocks an offloaded run freed stay cached by torch's host allocator: give them back.
    torch._C._host_emptyCache()
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
        **_host_memory(model, optimizer),
    }
    # The last loss's graph reaches the parameters (and through their hooks, the whole model).
    del model, optimizer, losses, loss
    return row


def _host_memory(model, optimizer) -> dict:
    """Host memory this process holds now (resident set and its high-water mark), pinned bytes
    of torch's host allocator, the optimizer state on the host, and megatron_fsdp's own
    offloaded buffers."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    host_state = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.device.type == "cpu"
    )
    row = {
        "host_rss_gib": int(status["VmRSS"].split()[0]) / 2**20,
        "host_peak_rss_gib": int(status["VmHWM"].split()[0]) / 2**20,
        "host_optimizer_state_gib": host_state / 2**30,
        "host_pinned_gib": torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / 2**30,
    }
    if isinstance(model, megatron_fsdp.MegatronFSDP):
        row["offloaded_buffers_gib"] = model.offloaded_host_bytes() / 2**30
    return row


def _parameters(config: GPTConfig) -> int:
    per_layer = 4 * config.hidden * config.hidden + 3 * config.hidden * config.ffn + 2 * config.hidden
    return config.layers * per_layer + (2 * config.vocab_size + config.seq_len + 1) * config.hidden


def _host_bytes_available() -> int:
    """MemAvailable of this host, the same on every rank (the smallest any rank read)."""
    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines())
    available = torch.tensor(int(meminfo["MemAvailable"].split()[0]) * 1024, device="cuda")
    dist.all_reduce(available, op=dist.ReduceOp.MIN)
    return int(available.item())


def _at_depth(name: str, config: GPTConfig, args, device: torch.device) -> dict:
    """The row of ``name`` on ``config``, or why it did not run."""
    params = _parameters(config)
    base = {"implementation": name, "layers": config.layers, "parameters_b": params / 1e9}
    # Offloaded main params, gradients and Adam's two moments: 16 bytes per parameter, split
    # over the ranks of this host; 10% headroom for the rest of the process.
    needed = 16 * params if "offload" in name else 0
    available = _host_bytes_available()
    if needed > 0.9 * available:
        return {**base, "error": f"skipped: needs ~{needed / 2**30:.0f} GiB of host memory, {available / 2**30:.0f} GiB available"}
    return {**base, **_run_or_oom(name, config, args, device)}


def _run_or_oom(name: str, config: GPTConfig, args, device: torch.device) -> dict:
    try:
        return _run(name, IMPLEMENTATIONS[name], config, args, device)
    except torch.OutOfMemoryError as error:
        # Where it ran out (the innermost frame of ours or the benchmark's) and how much was held.
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "torch/" not in f.filename]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"
        gc.collect()
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()
        return {"implementation": name, "error": "out of memory", "where": where,
                "message": str(error).split("See documentation")[0].strip()}


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
    parser.add_argument("--layers", default=None,
                        help="comma-separated depths to run --config's width at (default: its own depth)")
    parser.add_argument("--largest", action="store_true",
                        help="go through --layers (default 8,16,20,24,28,32,40,48,56,64) up to the first that fails")
    args = parser.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    config = GPTConfig(**{**CONFIGS[args.config].__dict__, "seq_len": args.seq_len})
    wanted = _wanted(args.impls)
    depths = args.layers or ("8,16,20,24,28,32,40,48,56,64" if args.largest else str(config.layers))
    rows = []
    for name in wanted:
        for layers in [int(depth) for depth in depths.split(",")]:
            rows.append(_at_depth(name, dataclasses.replace(config, layers=layers), args, device))
            if dist.get_rank() == 0:
                print(json.dumps(rows[-1]), flush=True)
            if args.largest and "error" in rows[-1]:
                break
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
        "largest": args.largest,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "timed_steps": args.steps,
        "warmup": args.warmup,
    }
    # Each row against FSDP2 on the same model: the offloaded FSDP2 for offloaded rows.
    fsdp2 = {
        (r["implementation"], r.get("layers")): r for r in rows if r["implementation"].startswith("torch FSDP2") and "error" not in r
    }
    print(f"\n{setting['device']} x{setting['gpus']}, torch {setting['torch']}, NCCL {setting['nccl']}, {setting['date']}; "
          f"{args.config}, micro-batch {args.micro_batch}, seq {args.seq_len}, median of {args.steps} steps")
    print("| implementation | layers | params (B) | step ms | vs FSDP2 | tokens/s/GPU | TFLOP/s/GPU | peak alloc GiB | "
          "peak reserved GiB | vs FSDP2 reserved | host RSS GiB | host pinned GiB | final loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        layers = r.get("layers", config.layers)
        params = r.get("parameters_b", _parameters(config) / 1e9)
        if "error" in r:
            print(f"| {r['implementation']} | {layers} | {params:.1f} | {r['error']} | | | | | | | | | |")
            continue
        other = fsdp2.get(("torch FSDP2 cpu-offload" if "offload" in r["implementation"] else "torch FSDP2", r.get("layers")))
        step_ratio = f"{r['median_step_s'] / other['median_step_s']:.2f}" if other else "-"
        mem_ratio = f"{r['peak_reserved_gib'] / other['peak_reserved_gib']:.2f}" if other else "-"
        print(f"| {r['implementation']} | {layers} | {params:.1f} | {r['median_step_s'] * 1e3:.1f} | {step_ratio} | "
              f"{r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | {r['peak_allocated_gib']:.1f} | "
              f"{r['peak_reserved_gib']:.1f} | {mem_ratio} | {r['host_rss_gib']:.1f} | {r['host_pinned_gib']:.1f} | {r['final_loss']:.4f} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"setting": setting, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
