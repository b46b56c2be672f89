"""``python -m megatron_fsdp.simulate``: one training step of megatron_fsdp as chosen ranks of a
world of any size, on this CPU: each rank's memory by kind, its collectives and bytes sent, the
buckets' layout, and plan_memory's model states beside the simulated ones.

    python -m megatron_fsdp.simulate --hf llama3-8b --world-size 4096 --dp-outer 512
    python -m megatron_fsdp.simulate --hf llama3-70b --world-size 512 --tp 8 --ranks first,largest
    python -m megatron_fsdp.simulate --hf llama3-8b --world-size 512 --ranks last --compare fsdp2
    python -m megatron_fsdp.simulate --model examples/gpt_model.py:gpt --units TransformerBlock --world-size 64
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence

import torch

from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.plan_memory import plan_memory
from megatron_fsdp.plan_memory.meta_models import PRESETS
from megatron_fsdp.simulate.comparison import compare_with_torch_fsdp2
from megatron_fsdp.simulate.models import LLAMA_TP_PLAN, ModelSource, hugging_face, python_callable
from megatron_fsdp.simulate.doors import DOORS, OPTIMIZERS
from megatron_fsdp.simulate.runner import simulate_rank
from megatron_fsdp.simulate.world import MeshSizes

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_fsdp.simulate",
        description="Simulate ranks of a megatron_fsdp world under fake tensors and a fake process group.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help=f"a preset ({', '.join(PRESETS)}), a config.json, or a Hugging Face model id")
    source.add_argument("--model", help="FILE.py:CALLABLE returning the model, e.g. examples/gpt_model.py:gpt")
    parser.add_argument("--model-kwargs", type=json.loads, default={}, help="JSON keyword arguments for --model")
    parser.add_argument("--units", default="", help="unit class names (--model; --hf uses its decoder layer)")
    parser.add_argument("--layers", type=int, default=None, help="--hf: override the config's layer count")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--dp-outer", type=int, default=1, help="HSDP replicas (the mesh is dp_outer x dp_shard x tp)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (--hf Llama-style: Megatron-LM's split)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (a model's 'experts' modules, grouped weights)")
    parser.add_argument("--tensor-parallel-plan", type=json.loads, default=None,
                        help="JSON {module pattern: 'colwise'|'rowwise'}; default for --tp > 1: Llama's q/k/v, "
                             "gate/up colwise, o/down rowwise")
    parser.add_argument("--ranks", default="first,largest,last",
                        help="comma-separated ranks, or first, middle, last, largest (plan_memory's most loaded)")
    parser.add_argument("--door", choices=DOORS, default="whole_model",
                        help="fully_shard's whole-model door, or megatron_fsdp's FSDP2 door (fsdp2.fully_shard on each "
                             "unit and the root, float32 parameters computing in --dtype, gradients reduced in float32)")
    parser.add_argument("--strategy", choices=_STRATEGIES, default="optim_grads_params")
    parser.add_argument("--outer-strategy", choices=("no_shard", "optim"), default="no_shard")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16", help="the parameters' (compute) dtype")
    parser.add_argument("--main-params-dtype", choices=tuple(_DTYPES), default="fp32")
    parser.add_argument("--main-grads-dtype", choices=tuple(_DTYPES), default=None, help="default: the compute dtype")
    parser.add_argument("--grad-comm-dtype", choices=tuple(_DTYPES), default=None, help="default: the main grads dtype")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank in the step")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--compare", choices=("fsdp2",), default=None,
                        help="also simulate torch's own FSDP2 (fully_shard on each unit and the root, the same "
                             "precision and optimizer; memory by FSDPMemTracker) and print both side by side")
    parser.add_argument("--json", action="store_true", help="one JSON object per rank")
    return parser.parse_args(argv)


def _source(args: argparse.Namespace) -> ModelSource:
    dtype = _DTYPES[args.dtype]
    if args.hf:
        return hugging_face(args.hf, dtype, args.layers)
    return python_callable(args.model, args.model_kwargs, [u.strip() for u in args.units.split(",") if u.strip()], dtype)


def _ranks(spec: str, world_size: int, largest: int) -> list[int]:
    named = {"first": 0, "middle": world_size // 2, "last": world_size - 1, "largest": largest}
    ranks = []
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        rank = named[item] if item in named else int(item)
        if not 0 <= rank < world_size:
            raise ValueError(f"--ranks: {rank} is outside a world of {world_size}")
        if rank not in ranks:
            ranks.append(rank)
    return ranks


def _compare(args: argparse.Namespace, source: ModelSource, mesh: MeshSizes, ranks: list[int],
             tp_plan: dict[str, str] | None, policy: MixedPrecisionPolicy) -> None:
    """Each rank as ours and as torch's FSDP2, side by side (comparison.py)."""
    if args.strategy != "optim_grads_params" or args.outer_strategy != "no_shard" or mesh.ep > 1:
        raise SystemExit("error: --compare fsdp2 compares FSDP2's ZeRO-3 (HSDP replicas unsharded, no expert "
                         "parallelism): leave --strategy, --outer-strategy and --ep at their defaults")
    for rank in ranks:
        comparison = compare_with_torch_fsdp2(
            source.build, mesh, rank, fsdp_unit_modules=list(source.units), mixed_precision_policy=policy,
            optimizer=args.optimizer, tensor_parallel_plan=tp_plan, batch_size=args.batch_size, seq_len=args.seq_len,
            door=args.door)
        print(json.dumps(comparison.to_dict()) if args.json else f"{comparison}\n")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        mesh = MeshSizes(args.world_size, dp_outer=args.dp_outer, tp=args.tp, ep=args.ep)
        source = _source(args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    tp_plan = args.tensor_parallel_plan or (LLAMA_TP_PLAN if args.tp > 1 else None)
    policy = MixedPrecisionPolicy(
        main_params_dtype=_DTYPES[args.main_params_dtype],
        main_grads_dtype=_DTYPES[args.main_grads_dtype] if args.main_grads_dtype else None,
        grad_comm_dtype=_DTYPES[args.grad_comm_dtype] if args.grad_comm_dtype else None,
    )
    options = dict(fsdp_unit_modules=list(source.units), zero_dp_strategy=args.strategy,
                   outer_dp_sharding_strategy=args.outer_strategy, mixed_precision_policy=policy)
    try:  # the planner's refusal names the fix, before anything is simulated
        plan = plan_memory(source.build(), mesh.world_size, dp_outer_size=mesh.dp_outer, tensor_parallel_size=mesh.tp,
                           expert_parallel_size=mesh.ep, tensor_parallel_plan=tp_plan, optimizer=args.optimizer,
                           device_type="cpu", **options)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    if not args.json:
        print(f"{source.description}; units: {', '.join(u.__name__ for u in source.units) or 'none'}")
    try:
        ranks = _ranks(args.ranks, mesh.world_size, plan.largest.rank)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    if args.compare:
        _compare(args, source, mesh, ranks, tp_plan, policy)
        return
    for rank in ranks:
        report = simulate_rank(source.build, mesh, rank, optimizer=args.optimizer, tensor_parallel_plan=tp_plan,
                               batch_size=args.batch_size, seq_len=args.seq_len, door=args.door, **options)
        if args.door != "whole_model":  # plan_memory plans the whole-model door's buckets
            print(json.dumps(report.to_dict()) if args.json else f"{report}\n")
            continue
        planned = plan.for_rank(rank)
        planned_states = planned.device_model_states + planned.host_model_states
        if args.json:
            print(json.dumps(report.to_dict() | {"planned_model_state_bytes": planned_states}))
            continue
        difference = report.model_state_bytes - planned_states
        verdict = "equal" if difference == 0 else f"DIFFERS by {difference}"
        print(report)
        print(f"plan_memory's model states for rank {rank}: {planned_states} bytes, simulated "
              f"{report.model_state_bytes}: {verdict}\n")
