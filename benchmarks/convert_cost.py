"""Time and peak host memory of converting a Megatron-LM fsdp_dtensor checkpoint of a given
size to Hugging Face's format offline (``megatron_fsdp.convert``), on this machine's CPUs.

    python benchmarks/convert_cost.py --shape llama3-8b --dir /tmp/convert_cost [--ranks 2]

Writes a checkpoint of that shape (bf16 weights, Megatron-LM's fsdp_dtensor names, fc1 as
``_w`` / ``_v`` halves, its args) with the converter's own streaming DCP writer, converts it to
Hugging Face in a fresh process (or ``--ranks`` processes under torchrun), prints one JSON line
per rank (seconds, bytes written, peak resident memory: ``ru_maxrss``) and the largest tensor's
size, and deletes both directories.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch

from megatron_fsdp.convert.api import megatron_args
from megatron_fsdp.convert.gpt_dims import GptDims
from megatron_fsdp.convert.megatron_gpt import LOCAL_SPEC, SEQUENTIAL_EXPERTS, gpt_slots, megatron_name
from megatron_fsdp.convert.plan import Plan
from megatron_fsdp.convert.runner import Layout, run_plan
from megatron_fsdp.convert.sources import TensorInfo

SHAPES = {
    # Llama 3 8B: 8.03e9 parameters, 16 GB in bf16.
    "llama3-8b": GptDims("llama", layers=32, hidden=4096, ffn=14336, heads=32, groups=8, head_dim=128, vocab=128256, tied=False, rope_theta=500000.0),
    # Small enough for a test: the largest tensors (embedding, head) are 32 MiB of 268 MiB.
    "test": GptDims("llama", layers=8, hidden=512, ffn=8192, heads=8, groups=2, head_dim=64, vocab=32768, tied=False),
}


class _Filled:
    """A step's build: a tensor of the target's shape, filled with a number (the conversion's cost
    does not depend on the values)."""

    def __init__(self, shapes: list[tuple[int, ...]], value: float) -> None:
        self.shapes, self.value = shapes, value

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.full(shape, self.value, dtype=torch.bfloat16) for shape in self.shapes]


def write_checkpoint(path: str, dims: GptDims) -> int:
    """A Megatron-LM fsdp_dtensor checkpoint of ``dims`` in bf16 at ``path`` (Megatron-LM's
    directory layout); returns the largest tensor's bytes."""
    plan = Plan(objects={"args": megatron_args(dims), "iteration": 0, "checkpoint_version": 3.0})
    for index, slot in enumerate(gpt_slots(dims)):
        name = "model.module." + megatron_name(slot, LOCAL_SPEC, SEQUENTIAL_EXPERTS)
        if slot.kind == "fc1":
            halves = [(name + suffix, TensorInfo(slot.hf_shapes[0], torch.bfloat16)) for suffix in ("_w", "_v")]
            plan.add([], halves, _Filled([slot.hf_shapes[0]] * 2, index))
        else:
            plan.add([], [(name, TensorInfo(slot.megatron_shape, torch.bfloat16))], _Filled([slot.megatron_shape], index))
    run_plan(_NoSource(), plan, path, Layout("megatron"))
    return max(info.nbytes for info in plan.targets.values())


class _NoSource:
    """What ``write_checkpoint``'s steps read: nothing."""

    path = "(generated)"

    def read(self, name: str, region: object = None) -> torch.Tensor:
        raise AssertionError(f"a generated checkpoint reads nothing, not {name}")


def convert_in_fresh_processes(source: str, output: str, ranks: int) -> list[dict]:
    """``python -m megatron_fsdp.convert SOURCE OUTPUT --to huggingface`` (under torchrun for more
    than one rank); each rank's JSON line."""
    command = [sys.executable, "-m", "megatron_fsdp.convert", source, output, "--to", "huggingface"]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *command[1:]]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    finished = subprocess.run(command, check=True, capture_output=True, text=True, env=environment)
    return [json.loads(line) for line in finished.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--dir", default="/tmp/convert_cost")
    parser.add_argument("--ranks", type=int, default=1)
    args = parser.parse_args()
    source, output = os.path.join(args.dir, "fsdp_dtensor"), os.path.join(args.dir, "hf")
    shutil.rmtree(args.dir, ignore_errors=True)
    try:
        start = time.monotonic()
        largest = write_checkpoint(source, SHAPES[args.shape])
        written = time.monotonic() - start
        results = convert_in_fresh_processes(source, output, args.ranks)
        print(json.dumps({"shape": args.shape, "ranks": args.ranks, "largest_tensor_bytes": largest, "generate_seconds": written, "ranks_results": results}))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
