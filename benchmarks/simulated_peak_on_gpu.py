"""The simulator's memory against a real GPU, on the model users give it: a Hugging Face Llama
built from one of `python -m megatron_fsdp.simulate`'s presets, sharded by `fully_shard` with
the simulator's defaults (the decoder layer a unit, bf16 weights, fp32 main weights, bf16 main
gradients and reductions, torch's AdamW, the model's own loss on one sequence).

On the GPU (world 1: the whole model on one rank), the peak of each of a few training steps,
``torch.cuda.max_memory_allocated`` reset before each:

    torchrun --standalone --nproc-per-node 1 benchmarks/simulated_peak_on_gpu.py --measure \\
        --preset llama3-8b --layers 8 --seq-len 4096 --out measured.json

On a CPU, the same rank simulated (docs/scaling.md, "What differs from a GPU rank"), set beside
those peaks:

    python benchmarks/simulated_peak_on_gpu.py --compare measured.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

GIB = 2**30
STEPS = 3


def build_config(preset: str, layers: int):
    from megatron_fsdp.plan_memory.meta_models import hf_config

    config = hf_config(preset)
    config.num_hidden_layers = layers
    return config


def measure(args: argparse.Namespace) -> dict:
    """Trains the preset on this GPU through ``fully_shard`` and returns each step's peak."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import megatron_fsdp
    from megatron_fsdp.simulate.models import hugging_face

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    config = build_config(args.preset, args.layers)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    units = list(hugging_face(config, torch.bfloat16).units)  # the simulator's units: the decoder layer
    model, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), fsdp_unit_modules=units)
    tokens = torch.randint(0, config.vocab_size, (1, args.seq_len), device=device)
    peaks = []
    for _ in range(STEPS):
        torch.cuda.reset_peak_memory_stats()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        peaks.append(torch.cuda.max_memory_allocated())
    dist.destroy_process_group()
    return {"preset": args.preset, "layers": args.layers, "seq_len": args.seq_len, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "step_peaks": peaks, "allocated_after": torch.cuda.memory_allocated()}


def compare(measured: dict) -> dict:
    """The same rank simulated (world 1, two steps) beside the measured peaks."""
    from megatron_fsdp.simulate import MeshSizes, simulate_rank
    from megatron_fsdp.simulate.models import hugging_face

    source = hugging_face(build_config(measured["preset"], measured["layers"]), torch.bfloat16)
    report = simulate_rank(source.build, MeshSizes(1), 0, fsdp_unit_modules=list(source.units),
                           seq_len=measured["seq_len"])
    first, later = measured["step_peaks"][0], max(measured["step_peaks"][1:])
    return {
        **measured,
        "simulated_first_step_peak": report.first_step_peak, "simulated_step_peak": report.step_peak,
        "first_step_error": report.first_step_peak / first - 1, "step_error": report.step_peak / later - 1,
        "simulated_model_states": report.model_state_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", action="store_true", help="train on this GPU and record each step's peak")
    mode.add_argument("--compare", metavar="MEASURED_JSON", help="simulate the measured run's rank on this CPU")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()
    result = measure(args) if args.measure else compare(json.loads(Path(args.compare).read_text()))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
