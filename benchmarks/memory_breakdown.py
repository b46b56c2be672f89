"""Where megatron_fsdp's device memory goes in a training step: persistent buffers by kind, the
bucket pool, and the allocator's view at the phases of a step (CUDA).

    torchrun --standalone --nproc_per_node 2 benchmarks/memory_breakdown.py --config 1.3B --seq-len 1024
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_fsdp  # noqa: E402
from gpt_model import GPT, GPTConfig, TransformerBlock  # noqa: E402
from step_time import CONFIGS  # noqa: E402

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="1.3B")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--strategy", default="optim_grads_params")
    parser.add_argument("--comm", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    config = GPTConfig(**{**CONFIGS[args.config].__dict__, "seq_len": args.seq_len})
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config).to(torch.bfloat16)
    policy = megatron_fsdp.MixedPrecisionPolicy(
        main_grads_dtype=torch.float32, grad_comm_dtype=torch.float32 if args.comm == "fp32" else torch.bfloat16
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, optimizer = megatron_fsdp.fully_shard(
        model, optimizer, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=args.strategy, mixed_precision_policy=policy
    )
    phases = {}
    for _ in range(3):
        torch.cuda.reset_peak_memory_stats()
        tokens = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), device=device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1))
        phases["after forward"] = torch.cuda.memory_allocated()
        phases["peak in forward"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        del logits
        loss.backward()
        phases["after backward"] = torch.cuda.memory_allocated()
        phases["peak in backward"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        optimizer.step()
        optimizer.zero_grad()
        phases["after step"] = torch.cuda.memory_allocated()
        phases["peak in step"] = torch.cuda.max_memory_allocated()
    buckets = [b for unit in model.units for b in unit.buckets]
    trainable = [b for b in buckets if b.requires_grad]
    persistent = {
        "compute weights (shards or full)": sum(
            (b.weight_shard if b.weight_shard is not None else b.full_weight).untyped_storage().nbytes()
            for b in buckets
            if b.weight_shard is not None or not b.strategy.shards_weights
        ),
        "main params (separate from weights)": sum(b.main_params.nbytes for b in trainable if not b.main_params_alias_weights),
        "main grads (from backward to zero_grad)": sum(
            (b.grad_end - b.grad_start) * torch.finfo(b.dtypes.main_grads).bits // 8 for b in trainable
        ),
        "optimizer state": sum(v.nbytes for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        "bucket pool, reserved": model.pool.bytes_reserved(),
        "bucket pool, high-water in use": model.pool.high_water_mark(),
    }
    root = model.root_unit
    persistent["root unit, unsharded bytes"] = sum(b.layout.padded_numel * b.params[0].element_size() for b in root.buckets)
    if dist.get_rank() == 0:
        print(f"{args.config} seq {args.seq_len} mbs {args.micro_batch} {args.strategy} {args.comm} comm, rank 0 of {dist.get_world_size()}")
        for name, value in {**persistent, **phases}.items():
            print(f"  {name:40s} {value / GIB:8.2f} GiB")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
