"""``python -m megatron_fsdp.simulate``: two training steps of megatron_fsdp as chosen ranks of a
world of any size, on this CPU: each rank's memory by kind, its steady-state (second step's) and
first step's peaks, one step's collectives and bytes sent, the buckets' layout, and
plan_memory's model states beside the simulated ones.

    python -m megatron_fsdp.simulate --hf llama3-8b --world-size 4096 --dp-outer 512
    python -m megatron_fsdp.simulate --hf llama3-70b --world-size 512 --tp 8 --ranks first,largest
    python -m megatron_fsdp.simulate --hf llama3-8b --world-size 512 --ranks last --compare fsdp2
    python -m megatron_fsdp.simulate --model examples/gpt_model.py:gpt --units TransformerBlock --world-size 64
    python -m megatron_fsdp.simulate --hf llama3-405b --layers 8 --world-size 512 --tp 8 --pp 8 --door fsdp2
    python -m megatron_fsdp.simulate --hf llama3-8b --world-size 512 --ranks first --step-time --nic-gbps 25
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence

import torch

from megatron_fsdp.engine.planning.pipeline_stages import PipelineSpec
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.plan_memory import plan_memory
from megatron_fsdp.plan_memory.meta_models import PRESETS
from megatron_fsdp.simulate.comparison import compare_with_torch_fsdp2
from megatron_fsdp.simulate.models import LLAMA_TP_PLAN, ModelSource, hugging_face, python_callable
from megatron_fsdp.simulate.doors import DOORS, OPTIMIZERS, check_door, planned_as
from megatron_fsdp.simulate.runner import simulate_rank
from megatron_fsdp.simulate.step_time import Cluster, optimizer_bytes, predict_step_time
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
    parser.add_argument("--dp-outer", type=int, default=1,
                        help="HSDP replicas (the mesh is pp x dp_outer x dp_shard x cp x tp)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel size: each rank runs 1/cp of every sequence; cp ranks join the shard group")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline-parallel size (--door fsdp2, a Hugging Face causal LM): the rank builds its stages only")
    parser.add_argument("--pipeline-schedule", default="1F1B", help="torch's Schedule<name>: GPipe, 1F1B, Interleaved1F1B, LoopedBFS")
    parser.add_argument("--micro-batches", type=int, default=None, help="a step's micro-batches (default: the fewest the schedule runs)")
    parser.add_argument("--virtual-stages", type=int, default=None, help="stages a rank (interleaved schedules; default 2)")
    parser.add_argument("--pipeline-layer-split", default="even",
                        help="layers a stage: even (default), torchtitan (its default: 126 layers over 8 stages "
                             "15,16,...,16,15), or a count for each stage, comma-separated")
    parser.add_argument("--reshard-after-forward", choices=("true", "false"), default="false",
                        help="FSDP2's, for every unit of a stage (default false, as torchtitan passes it under PP)")
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
    parser.add_argument("--batch-size", type=int, default=None,
                        help="sequences per rank in the step (default 1; under --pp one a micro-batch)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--compare", choices=("fsdp2",), default=None,
                        help="also simulate torch's own FSDP2 (fully_shard on each unit and the root, the same "
                             "precision and optimizer; memory by FSDPMemTracker) and print both side by side; "
                             "with --pp and --door fsdp2, the same stages under the same schedule")
    parser.add_argument("--json", action="store_true", help="one JSON object per rank")
    timing = parser.add_argument_group(
        "step time", "--step-time predicts each rank's step on a GPU cluster (docs/scaling.md, \"Step time\"): its "
        "compute at a measured rate, its collectives at NCCL bus bandwidths and ring latencies, overlapped as the "
        "schedule issues them; defaults: 8-GPU H200 SXM nodes with one 400 Gb/s NIC a GPU")
    timing.add_argument("--step-time", action="store_true", help="predict each rank's step time")
    timing.add_argument("--tflops", type=float, default=Cluster.achieved_tflops,
                        help="model TFLOP/s a GPU sustains (default: fitted from our 1 x H200 8B row)")
    timing.add_argument("--hbm-gbps", type=float, default=Cluster.hbm_bytes_per_s / 1e9,
                        help="device memory GB/s a streaming kernel reaches (the optimizer step's)")
    timing.add_argument("--gpus-per-node", type=int, default=Cluster.gpus_per_node)
    timing.add_argument("--intra-node-gbps", type=float, default=Cluster.intra_node_bus_bytes_per_s / 1e9,
                        help="NCCL bus bandwidth within a node, GB/s (NVLink 4: 450)")
    timing.add_argument("--nic-gbps", type=float, default=Cluster.nic_bytes_per_s / 1e9,
                        help="network GB/s of one GPU's NIC across nodes (400 Gb/s InfiniBand: 50)")
    return parser.parse_args(argv)


def _cluster(args: argparse.Namespace) -> Cluster:
    return Cluster(achieved_tflops=args.tflops, hbm_bytes_per_s=args.hbm_gbps * 1e9, gpus_per_node=args.gpus_per_node,
                   intra_node_bus_bytes_per_s=args.intra_node_gbps * 1e9, nic_bytes_per_s=args.nic_gbps * 1e9)


def _step_time(report, sequences: int, seq_len: int, cluster: Cluster) -> dict:
    """``report``'s step timed on ``cluster``; ``sequences`` of ``seq_len`` tokens go through a
    model replica (its tp x cp x pp GPUs) in the step."""
    step = predict_step_time(report.collectives, report.compute, optimizer_bytes(report.model_states), cluster)
    mesh = report.mesh
    tokens_per_gpu = sequences * seq_len / (mesh.tp * mesh.cp * mesh.pp)
    return {"seconds": step.seconds, "compute_s": step.compute, "optimizer_s": step.optimizer,
            "communication_s": step.communication, "exposed_communication_s": step.exposed_communication,
            "tokens_per_s_per_gpu": tokens_per_gpu / step.seconds}


def _step_time_line(timed: dict) -> str:
    return (f"step time: {timed['seconds'] * 1e3:.1f} ms predicted (compute {timed['compute_s'] * 1e3:.1f} ms, optimizer "
            f"{timed['optimizer_s'] * 1e3:.1f} ms, collectives {timed['communication_s'] * 1e3:.1f} ms of which "
            f"{timed['exposed_communication_s'] * 1e3:.1f} ms exposed); {timed['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU")


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
             tp_plan: dict[str, str] | None, policy: MixedPrecisionPolicy, pipeline: dict) -> None:
    """Each rank as ours and as torch's FSDP2, side by side (comparison.py); under --pp through
    ours' FSDP2 door, both sides' stages under torch's schedule with ``pipeline``'s options."""
    if args.strategy != "optim_grads_params" or args.outer_strategy != "no_shard" or max(mesh.ep, mesh.cp) > 1:
        raise SystemExit("error: --compare fsdp2 compares FSDP2's ZeRO-3 (HSDP replicas unsharded, no expert or "
                         "context parallelism): leave --strategy, --outer-strategy, --ep and --cp at their defaults")
    for rank in ranks:
        comparison = compare_with_torch_fsdp2(
            source.build, mesh, rank, fsdp_unit_modules=list(source.units), mixed_precision_policy=policy,
            optimizer=args.optimizer, tensor_parallel_plan=tp_plan, batch_size=args.batch_size, seq_len=args.seq_len,
            door=args.door, **pipeline)
        print(json.dumps(comparison.to_dict()) if args.json else f"{comparison}\n")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        mesh = MeshSizes(args.world_size, dp_outer=args.dp_outer, tp=args.tp, ep=args.ep, pp=args.pp, cp=args.cp)
        source = _source(args)
        cluster = _cluster(args) if args.step_time else None
        if cluster is not None and max(mesh.pp, mesh.cp) > 1:
            raise ValueError("--step-time times data- and tensor-parallel steps only: the model has no pipeline "
                             "bubble and the simulator no context-parallel attention exchange, so with --pp or --cp "
                             "it would under-predict; leave them at 1 to time a step")
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    tp_plan = args.tensor_parallel_plan or (LLAMA_TP_PLAN if args.tp > 1 else None)
    policy = MixedPrecisionPolicy(
        main_params_dtype=_DTYPES[args.main_params_dtype],
        main_grads_dtype=_DTYPES[args.main_grads_dtype] if args.main_grads_dtype else None,
        grad_comm_dtype=_DTYPES[args.grad_comm_dtype] if args.grad_comm_dtype else None,
    )
    options = dict(fsdp_unit_modules=list(source.units), zero_dp_strategy=args.strategy,
                   outer_dp_sharding_strategy=args.outer_strategy)
    pipeline = dict(pipeline_schedule=args.pipeline_schedule, virtual_stages=args.virtual_stages,
                    pipeline_layer_split=args.pipeline_layer_split,
                    reshard_after_forward=args.reshard_after_forward == "true")
    micro_batches = args.micro_batches
    in_float32, planned_policy = planned_as(args.door, policy)
    model = source.build()
    try:  # the planner's refusal names the fix, before anything is simulated
        check_door(args.door, mesh, args.strategy, args.outer_strategy)
        if mesh.pp > 1 and micro_batches is None:  # the planner's default, as the simulation's
            micro_batches = PipelineSpec(mesh.pp, args.pipeline_schedule, 1, args.virtual_stages).fewest_micro_batches()
        plan = plan_memory(model.float() if in_float32 else model, mesh.world_size, dp_outer_size=mesh.dp_outer,
                           tensor_parallel_size=mesh.tp, context_parallel_size=mesh.cp, expert_parallel_size=mesh.ep,
                           pipeline_parallel_size=mesh.pp, micro_batches=micro_batches or 1, tensor_parallel_plan=tp_plan,
                           optimizer=args.optimizer, device_type="cpu", mixed_precision_policy=planned_policy,
                           **options, **(pipeline if mesh.pp > 1 else {}))
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    if not args.json:
        print(f"{source.description}; units: {', '.join(u.__name__ for u in source.units) or 'none'}")
    try:
        ranks = _ranks(args.ranks, mesh.world_size, plan.largest.rank)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from error
    if args.compare:
        _compare(args, source, mesh, ranks, tp_plan, policy,
                 pipeline | dict(micro_batches=micro_batches) if mesh.pp > 1 else {})
        return
    for rank in ranks:
        report = simulate_rank(source.build, mesh, rank, optimizer=args.optimizer, tensor_parallel_plan=tp_plan,
                               batch_size=args.batch_size, seq_len=args.seq_len, door=args.door,
                               mixed_precision_policy=policy, micro_batches=micro_batches, **options, **pipeline)
        row = report.to_dict()
        sequences = args.batch_size or (micro_batches if mesh.pp > 1 else 1)  # simulate_rank's default
        timed = _step_time(report, sequences, args.seq_len, cluster) if cluster is not None else None
        if timed is not None:
            row["step_time"] = timed
        if args.door != "whole_model" and mesh.pp == 1:  # plan_memory plans FSDP2's buckets for pipeline stages only
            print(json.dumps(row) if args.json else f"{report}" + (f"\n{_step_time_line(timed)}" if timed else "") + "\n")
            continue
        planned = plan.for_rank(rank)
        planned_states = planned.device_model_states + planned.host_model_states
        if args.json:
            print(json.dumps(row | {"planned_model_state_bytes": planned_states}))
            continue
        difference = report.model_state_bytes - planned_states
        verdict = "equal" if difference == 0 else f"DIFFERS by {difference}"
        print(report)
        if timed is not None:
            print(_step_time_line(timed))
        print(f"plan_memory's model states for rank {rank}: {planned_states} bytes, simulated "
              f"{report.model_state_bytes}: {verdict}\n")
