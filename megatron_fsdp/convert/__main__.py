"""The command line: ``python -m megatron_fsdp.convert SOURCE OUTPUT --to FORMAT [options]``.

Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set) every process joins a gloo group and converts
its share of the tensors; the output directory appears once all have finished. Prints one JSON
line per rank with its seconds, bytes written and peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch.distributed as dist

from megatron_fsdp.convert.api import DTYPES, TARGETS, convert
from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.gpt_dims import FAMILIES
from megatron_fsdp.convert.megatron_gpt import FUSED_FC1, GROUPED_EXPERTS, LOCAL_SPEC, SEQUENTIAL_EXPERTS, SPLIT_FC1, TE_SPEC


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_fsdp.convert", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a checkpoint directory: ours (step_<N> or its parent), Megatron-LM's (iter_<N> or --save dir), or Hugging Face's")
    parser.add_argument("output", help="the directory to create (it appears whole or not at all)")
    parser.add_argument("--to", required=True, choices=TARGETS)
    parser.add_argument("--config", help="the model's config.json (or a Hugging Face directory holding one); Megatron-LM checkpoints default to their args")
    parser.add_argument("--family", choices=sorted(FAMILIES), help="the Hugging Face model family (default: mixtral with experts, qwen2 with QKV bias, mistral with a sliding window, else llama)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the tensors written (default: as stored)")
    parser.add_argument("--spec", choices=(TE_SPEC, LOCAL_SPEC), default=TE_SPEC, help="Megatron-LM names: Transformer Engine's fused norms (te) or the local spec's")
    parser.add_argument("--experts", choices=(SEQUENTIAL_EXPERTS, GROUPED_EXPERTS), default=SEQUENTIAL_EXPERTS, help="Megatron-LM expert names: local_experts.N (sequential) or weightN (grouped GEMM)")
    parser.add_argument("--fc1", choices=(SPLIT_FC1, FUSED_FC1), default=SPLIT_FC1, help="fsdp_dtensor SwiGLU fc1: megatron-core's _w/_v halves (split) or whole (fused)")
    parser.add_argument("--no-optimizer", dest="optimizer", action="store_false", help="fsdp_dtensor <-> torch_dist: the weights alone")
    parser.add_argument(
        "--step", type=int,
        help="which checkpoint of SOURCE (a save directory holding several step_<N> / iter_<N>) to convert, default the latest; "
        "the output keeps its number. From Hugging Face: the step the output is saved as (default 0: Megatron-LM's 'release')",
    )
    parser.add_argument("--max-file-gib", type=float, default=5.0, help="Hugging Face output: the largest safetensors file")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT once the conversion has succeeded")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    try:
        result = convert(
            args.source, args.output, args.to, overwrite=args.overwrite, max_file_bytes=int(args.max_file_gib * 2**30),
            config=args.config, family=args.family, dtype=args.dtype, spec=args.spec, experts=args.experts, fc1=args.fc1, step=args.step, optimizer=args.optimizer,
        )
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if distributed:
            dist.destroy_process_group()
    print(json.dumps({"rank": int(os.environ.get("RANK", 0)), **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
