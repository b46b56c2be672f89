"""Planned against measured device memory on a GPU (issue 33): ``megatron_fsdp.plan_memory`` for
the benchmark GPTs, then the same model trained with ``fully_shard`` on every GPU of the machine.

    torchrun --standalone --nproc_per_node 1 benchmarks/memory_plan_check.py --out plan_check.json

Per run it reports, on rank 0:
- model states: planned (each tensor rounded as the CUDA caching allocator rounds it) against
  ``torch.cuda.memory_allocated()`` after the first optimizer step, less what was allocated before
  the model was built;
- the step's peak: the planned model states plus the larger of the working set's bound with the
  measured activation peak (forward and backward) and the optimizer step's planned temporaries,
  against ``torch.cuda.max_memory_allocated()`` over the second step, each phase also apart.
  The activation peak is measured on the same model in plain PyTorch, bf16, its weights frozen
  and the embedding's output requiring grad: the peak of forward and backward above the weights
  is then what activations and their gradients take, without any weight gradient.

Before anything is measured a small matmul with a backward allocates cuBLAS's workspaces, which
the caching allocator holds from then on (64 MiB on an H100).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_fsdp  # noqa: E402
from gpt_model import GPT, GPTConfig, TransformerBlock  # noqa: E402
from step_time import CONFIGS  # noqa: E402

# The 8B model's fp32 main weights, gradients and AdamW state (132 GiB) fit neither one GPU nor
# the GPU machine's host memory: 8 of its 32 layers keep its shapes (hidden 4096, vocab 128256).
RUNS = {
    "1.3B": dict(config="1.3B", layers=None, cpu_offload=False),
    "1.3B offloaded": dict(config="1.3B", layers=None, cpu_offload=True),
    "8B width 8 layers": dict(config="8B", layers=8, cpu_offload=False),
}
GIB = 2**30


def warm_up_cublas(device: torch.device) -> None:
    weight = torch.randn(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    (weight @ weight).float().sum().backward()
    torch.cuda.synchronize()


def activation_peak(config: GPTConfig, tokens: torch.Tensor, device: torch.device) -> int:
    """Peak bytes above the weights of a forward and backward of the plain model."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config).to(torch.bfloat16).requires_grad_(False)
    model.embed.register_forward_hook(lambda module, args, out: out.requires_grad_())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss_of(model, config, tokens).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del model
    torch.cuda.empty_cache()
    return peak


def loss_of(model: torch.nn.Module, config: GPTConfig, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1))


def check(name: str, config_name: str, layers: int | None, cpu_offload: bool, micro_batch: int, seq_len: int,
          device: torch.device) -> dict:
    sizes = {**CONFIGS[config_name].__dict__, "seq_len": seq_len}
    config = GPTConfig(**{**sizes, "layers": layers or sizes["layers"]})
    world = dist.get_world_size()
    policy = megatron_fsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32)
    with torch.device("meta"):
        meta = GPT(config).to(torch.bfloat16)
    started = time.perf_counter()
    plan = megatron_fsdp.plan_memory(meta, world, fsdp_unit_modules=[TransformerBlock], mixed_precision_policy=policy,
                                     optimizer="adamw", cpu_offload=cpu_offload)
    planning_s = time.perf_counter() - started
    planned = plan.for_rank(dist.get_rank())
    generator = torch.Generator(device).manual_seed(dist.get_rank())
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq_len + 1), device=device, generator=generator)
    activations = activation_peak(config, tokens, device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = meta  # built on the meta device, materialised unit by unit on the GPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # torch's default: step counters on the host
    model, optimizer = megatron_fsdp.fully_shard(
        model, optimizer, fsdp_unit_modules=[TransformerBlock], mixed_precision_policy=policy,
        init_model_with_meta_device=True, device=device, cpu_offload=cpu_offload,
    )
    loss_of(model, config, tokens).backward()
    optimizer.step()
    torch.cuda.synchronize()
    states = torch.cuda.memory_allocated() - base
    optimizer.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model.pool.reset_high_water_mark()
    loss_of(model, config, tokens).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    before_step = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    optimizer.step()
    torch.cuda.synchronize()
    step_transient = torch.cuda.max_memory_allocated() - before_step
    predicted_backward = planned.allocator_bytes + planned.working_set + activations
    predicted_step = planned.allocator_bytes + planned.optimizer_step
    predicted = max(predicted_backward, predicted_step)
    measured = max(peak, before_step - base + step_transient)
    return {
        "run": name, "config": config_name, "layers": config.layers, "world": world, "micro_batch": micro_batch, "seq_len": seq_len,
        "cpu_offload": cpu_offload, "planning_s": round(planning_s, 3),
        "planned_states_gib": planned.allocator_bytes / GIB, "measured_states_gib": states / GIB,
        "states_difference_bytes": states - planned.allocator_bytes,
        "planned_working_set_gib": planned.working_set / GIB, "pool_peak_gib": model.pool.high_water_mark() / GIB,
        "activations_gib": activations / GIB, "predicted_backward_peak_gib": predicted_backward / GIB,
        "measured_backward_peak_gib": peak / GIB, "planned_optimizer_step_gib": planned.optimizer_step / GIB,
        "measured_optimizer_step_gib": step_transient / GIB, "predicted_peak_gib": predicted / GIB,
        "measured_peak_gib": measured / GIB, "peak_error": (predicted - measured) / measured, "planned_host_gib": planned.host_model_states / GIB,
        "breakdown": {k: v / GIB for k, v in planned.device.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    warm_up_cublas(device)
    results = []
    for name in args.runs.split(","):
        run = RUNS[name]
        results.append(check(name, run["config"], run["layers"], run["cpu_offload"], args.micro_batch, args.seq_len, device))
        if dist.get_rank() == 0:
            print(json.dumps(results[-1]), flush=True)
            with open(args.out, "w") as out:
                json.dump(results, out, indent=1)
        gc.collect()  # the run's model and optimizer hold cycles
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
