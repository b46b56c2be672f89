"""``python -m megatron_fsdp.plan_memory``: the per-rank memory of a Hugging Face model (an id or a
config.json) or of a model built by a Python callable, for each strategy, world size, HSDP replica
count, tensor-, context-, expert- and pipeline-parallel size and offload choice, as a table in GiB
(or JSON lines).

    python -m megatron_fsdp.plan_memory --hf meta-llama/Llama-3.1-8B --world-sizes 8,64 --device-memory 80
    python -m megatron_fsdp.plan_memory --hf meta-llama/Llama-3.1-70B --world-sizes 64 --tensor-parallel-size 1,2,4,8
    python -m megatron_fsdp.plan_memory --model examples/gpt_model.py:gpt --model-kwargs '{"layers": 24}' \\
        --units TransformerBlock --world-sizes 1,2,8
    python -m megatron_fsdp.plan_memory --hf meta-llama/Llama-3.1-8B --world-sizes 16 --pipeline-parallel-size 2,4 \\
        --pipeline-schedule Interleaved1F1B --micro-batches 8 --activation-mib-per-layer 256
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence

import torch
from torch import nn

from megatron_fsdp.engine.planning.memory_plan import OptimizerSpec, gib
from megatron_fsdp.engine.planning.model_plan import PlanRefused
from megatron_fsdp.engine.planning.pipeline_stages import LAYER_SPLITS, PipelineSpec
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.plan_memory import MemoryPlan, meta_models, plan_memory

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _load_hf_model(name: str, dtype: torch.dtype) -> tuple[nn.Module, list[str]]:
    """A Hugging Face causal LM on the meta device, and its decoder-layer class names."""
    try:
        model = meta_models.hf_model_on_meta(meta_models.hf_config(name), dtype)
    except ValueError as error:
        raise SystemExit(f"--hf {error}") from error
    return model, meta_models.decoder_layer_names(model)


def _load_factory_model(spec: str, kwargs: dict, dtype: torch.dtype) -> nn.Module:
    try:
        factory = meta_models.model_factory(spec)
    except ValueError as error:
        raise SystemExit(f"--model {error}") from error
    return meta_models.factory_model_on_meta(factory, kwargs, dtype)


def _unit_classes(model: nn.Module, names: list[str]) -> list[type]:
    try:
        return meta_models.unit_classes(model, names)
    except ValueError as error:
        raise SystemExit(f"--units: {error}") from error


def _csv(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _positive_ints(value: str) -> list[int]:
    try:
        numbers = [int(item) for item in _csv(value)]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from error
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {value!r}")
    return numbers


def _positive_int(value: str) -> int:
    numbers = _positive_ints(value)
    if len(numbers) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer >= 1, got {value!r}")
    return numbers[0]


def _json_object(value: str) -> dict:
    try:
        loaded = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}: {error}") from error
    if not isinstance(loaded, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return loaded


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from error
    if not number > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}")
    return number


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_fsdp.plan_memory",
        description="Per-rank memory of a model sharded by megatron_fsdp, for each strategy and world size: one row "
                    "per combination of the sizes given (each flag takes one value or a comma-separated list).",
        epilog="examples:\n"
               "  python -m megatron_fsdp.plan_memory --hf examples/configs/llama3_8b.json --world-sizes 8,64 "
               "--device-memory 80\n"
               "  python -m megatron_fsdp.plan_memory --model examples/gpt_model.py:gpt --units TransformerBlock "
               "--world-sizes 8 --tensor-parallel-size 1,2\n"
               "docs/memory_planning.md explains every column.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help=f"a Hugging Face model id, a config.json (or its folder), or a preset of "
                        f"published shapes ({', '.join(meta_models.PRESETS)}); needs transformers")
    source.add_argument("--model", help="FILE.py:CALLABLE returning the model, e.g. examples/gpt_model.py:gpt")
    parser.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments for --model's callable")
    parser.add_argument("--units", default=None, help="unit class names (default for --hf: its decoder layer)")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16", help="the parameters' (compute) dtype")
    parser.add_argument("--main-params-dtype", choices=tuple(_DTYPES), default="fp32",
                        help="the dtype of the weights the optimizer steps")
    parser.add_argument("--main-grads-dtype", choices=tuple(_DTYPES), default=None, help="default: the compute dtype")
    parser.add_argument("--grad-comm-dtype", choices=tuple(_DTYPES), default=None, help="default: the main grads dtype")
    parser.add_argument("--world-sizes", type=_positive_ints, default=[8],
                        help="all ranks of the job, comma-separated, e.g. 8,64,1024")
    parser.add_argument("--dp-outer-sizes", type=_positive_ints, default=[1], help="HSDP replica counts to try, e.g. 1,8")
    parser.add_argument("--outer-strategy", choices=("no_shard", "optim"), default="no_shard",
                        help="with --dp-outer-sizes > 1: 'optim' also shards the optimizer state over the replicas "
                             "(HFSDP; optim_grads_params rows only)")
    # Megatron-LM's flags, each one size or a comma-separated list of sizes to compare.
    parser.add_argument("--tensor-parallel-size", "--tensor-model-parallel-size", type=_positive_ints, default=[1],
                        help="TP sizes, e.g. 1,2,8; splits what --tensor-parallel-plan names")
    parser.add_argument("--tensor-parallel-plan", type=_json_object, default=None,
                        help="JSON {module pattern: 'colwise'|'rowwise', parameter pattern: dim}; default: Megatron-LM's "
                             "split (attention q/k/v and MLP gate/up colwise, o/down rowwise, token embedding and output "
                             "layer over the vocabulary, the rest whole)")
    parser.add_argument("--context-parallel-size", type=_positive_ints, default=[1],
                        help="CP sizes; CP ranks join the shard group and hold whole parameters")
    parser.add_argument("--expert-parallel-size", "--expert-model-parallel-size", type=_positive_ints, default=[1],
                        help="EP sizes: each rank holds num_experts / EP experts")
    parser.add_argument("--expert-tensor-parallel-size", type=_positive_ints, default=None,
                        help="ETP sizes (default: the TP size, as Megatron-LM)")
    parser.add_argument("--pipeline-parallel-size", "--pipeline-model-parallel-size", type=_positive_ints, default=[1],
                        help="PP sizes: the layers (--units) split over PP x --virtual-stages stages (--pipeline-layer-"
                             "split), what comes before the first on the first stage, after the last on the last")
    parser.add_argument("--pipeline-layer-split", default="even",
                        help="layers a stage: even (default, as Megatron-LM), torchtitan (its default: the embedding "
                             "and the head count as a layer each, e.g. 126 layers over 8 stages 15,16,...,16,15), or "
                             "a count for each stage, comma-separated")
    parser.add_argument("--pipeline-schedule", default="1F1B",
                        help="torch.distributed.pipelining's schedule: GPipe, 1F1B, Interleaved1F1B or LoopedBFS "
                             "(--micro-batches a step)")
    parser.add_argument("--virtual-stages", type=_positive_int, default=None,
                        help="stages a pipeline rank (default: 1, or 2 for the interleaved schedules)")
    parser.add_argument("--reshard-after-forward", choices=("true", "false"), default=None,
                        help="FSDP2's, for every unit (default: false under pipeline parallelism, as torchtitan)")
    parser.add_argument("--activation-mib-per-layer", type=_positive_float, default=None,
                        help="MiB one micro-batch's activations take in one layer: adds the activation estimate and "
                             "the step's estimated peak")
    parser.add_argument("--strategies", default=None,
                        help="comma-separated, e.g. optim,optim_grads_params (default: all four; pipeline rows "
                             "optim_grads_params only, the one FSDP2's door runs)")
    parser.add_argument("--cpu-offload", choices=("off", "on", "both"), default="off",
                        help="main weights, gradients and optimizer state on the host ('both': a row for each)")
    parser.add_argument("--optimizer", default="adamw",
                        help=", ".join(OptimizerSpec.KINDS) + "; or muon+<one of those>, e.g. muon+adamw: torch's Muon on "
                             "the layers' (--units) 2-D matrices, each on one owner rank, the other on the rest")
    parser.add_argument("--double-buffer", action="store_true", help="fsdp_double_buffer")
    parser.add_argument("--micro-batches", type=_positive_int, default=None,
                        help="backward passes per optimizer step (default: 1, or under pipeline parallelism the "
                             "fewest the schedule runs, e.g. pp for 1F1B)")
    parser.add_argument("--deferred-reduction", nargs="?", const="no_sync", default=False,
                        choices=("no_sync", "requires_gradient_sync"),
                        help="micro-batches before the last hold back: inside no_sync() or with auto-sync off (the "
                             "default when given alone), or under FSDP2's set_requires_gradient_sync(False)")
    parser.add_argument("--device-memory", type=_positive_float, default=None, help="GiB per device: marks the rows that fit")
    parser.add_argument("--json", action="store_true", help="print one JSON object per row instead of a table")
    return parser.parse_args(argv)


_ALL_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _strategies(args: argparse.Namespace, pp: int) -> list[str]:
    """--strategies, or by default all four; a pipeline stage (plan_memory plans one whenever a
    pipeline size, schedule or virtual stages are given): optim_grads_params, FSDP2's door's."""
    if args.strategies is not None:
        return _csv(args.strategies)
    pipelined = pp != 1 or args.pipeline_schedule != "1F1B" or args.virtual_stages not in (None, 1)
    return ["optim_grads_params"] if pipelined else list(_ALL_STRATEGIES)


def _micro_batches(args: argparse.Namespace, pp: int) -> int:
    """--micro-batches, or by default the fewest the schedule runs (1 without pipeline
    parallelism; a schedule or virtual-stage count it refuses is plan_memory's to name)."""
    if args.micro_batches is not None:
        return args.micro_batches
    try:
        return PipelineSpec(pp, args.pipeline_schedule, 1, args.virtual_stages).fewest_micro_batches()
    except ValueError:
        return 1


class _Problems:
    """Every problem of a command, each once with the choices it came from (the first three, and
    how many more), in plan_memory's order: sizes that do not divide the world, the model and what the
    engine cannot shard, then the schedule's micro-batches."""

    def __init__(self) -> None:
        self.found: dict[str, dict[str, list[str]]] = {"mesh": {}, "structural": {}, "schedule": {}}

    def add(self, kind: str, message: str, where: str) -> None:
        places = self.found[kind].setdefault(message, [])
        if where not in places:
            places.append(where)

    def report(self) -> str | None:
        lines = []
        for by_message in self.found.values():
            for message, places in by_message.items():
                more = f" and {len(places) - 3} more" if len(places) > 3 else ""
                lines.append(f"{'; '.join(places[:3])}{more}: {message}")
        if not lines:
            return None
        if len(lines) == 1:
            return f"error: {lines[0]}"
        return f"error: {len(lines)} problems, each with its fix:\n" + "\n".join(f"- {line}" for line in lines)


def _where(world: int, outer: int, tp: int, cp: int, pp: int, ep: int, etp: int | None) -> str:
    """The mesh a problem came from: the world size and the model-parallel sizes given."""
    sizes = [f"world {world}"] + [f"{name} {size}" for name, size in (
        ("dp_outer", outer), ("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep)) if size > 1]
    return ", ".join(sizes + ([f"etp {etp}"] if etp is not None else []))


def _rows(model: nn.Module, units: list[type], args: argparse.Namespace) -> list[dict]:
    policy = MixedPrecisionPolicy(
        main_params_dtype=_DTYPES[args.main_params_dtype],
        main_grads_dtype=_DTYPES[args.main_grads_dtype] if args.main_grads_dtype else None,
        grad_comm_dtype=_DTYPES[args.grad_comm_dtype] if args.grad_comm_dtype else None,
    )
    offloads = {"off": [False], "on": [True], "both": [False, True]}[args.cpu_offload]
    rows = []
    problems = _Problems()
    meshes = itertools.product(args.world_sizes, args.tensor_parallel_size, args.context_parallel_size,
                               args.dp_outer_sizes, args.pipeline_parallel_size)
    expert_sizes = list(itertools.product(args.expert_parallel_size, args.expert_tensor_parallel_size or [None]))
    reshard = None if args.reshard_after_forward is None else args.reshard_after_forward == "true"
    activations = None if args.activation_mib_per_layer is None else round(args.activation_mib_per_layer * 2**20)
    for (world, tp, cp, outer_size, pp), (ep, etp) in itertools.product(meshes, expert_sizes):
        micro_batches = _micro_batches(args, pp)
        for strategy, offload in itertools.product(_strategies(args, pp), offloads):
            outer = args.outer_strategy if outer_size > 1 else "no_shard"
            if outer == "optim" and strategy != "optim_grads_params":
                continue
            try:
                plan = plan_memory(
                    model, world, dp_outer_size=outer_size, tensor_parallel_size=tp, context_parallel_size=cp,
                    expert_parallel_size=ep, expert_tensor_parallel_size=etp,
                    tensor_parallel_plan=args.tensor_parallel_plan, fsdp_unit_modules=units, zero_dp_strategy=strategy,
                    outer_dp_sharding_strategy=outer, mixed_precision_policy=policy, optimizer=args.optimizer,
                    fsdp_double_buffer=args.double_buffer, cpu_offload=offload, micro_batches=micro_batches,
                    deferred_reduction=args.deferred_reduction, pipeline_parallel_size=pp,
                    pipeline_schedule=args.pipeline_schedule, virtual_stages=args.virtual_stages,
                    pipeline_layer_split=args.pipeline_layer_split, reshard_after_forward=reshard,
                    activation_bytes_per_layer=activations,
                )
            except PlanRefused as refused:
                mesh = _where(world, outer_size, tp, cp, pp, ep, etp)
                for kind in ("mesh", "structural", "schedule"):
                    for message in getattr(refused, kind):
                        problems.add(kind, message, mesh if kind == "mesh" else f"{mesh}, {strategy}")
                continue
            except ValueError as error:  # a choice plan_memory refuses before planning
                problems.add("structural", str(error), f"{_where(world, outer_size, tp, cp, pp, ep, etp)}, {strategy}")
                continue
            rows.append(_row(plan, strategy, world, outer_size, tp, cp, ep, pp, offload, args))
    if report := problems.report():
        raise SystemExit(report)
    return rows


def _row(plan: MemoryPlan, strategy: str, world: int, outer_size: int, tp: int, cp: int, ep: int, pp: int,
         offload: bool, args: argparse.Namespace) -> dict:
    memory = plan.largest
    row = {
        "strategy": strategy, "world": world, "dp_outer": outer_size, "tp": tp, "cp": cp, "ep": ep,
        "etp": plan.options.parallel.etp, "pp": pp, "offload": offload,
        "weights": memory.device["compute weights"], "main_weights": memory.device["main weights"],
        "main_grads": memory.device["main grads"], "optimizer": memory.device["optimizer state"],
        "model_states": memory.device_model_states, "working_set": memory.working_set,
        "device_total": memory.device_total, "host": memory.host_model_states, "pinned_host": memory.pinned_host,
    }
    if plan.options.pipeline is not None:
        row |= {"schedule": plan.options.pipeline.schedule, "virtual_stages": plan.options.pipeline.virtual_stages,
                "micro_batches": plan.options.micro_batches, "stages": list(memory.stages),
                "gathered_between_micro_batches": memory.gathered_between_micro_batches}
    if plan.options.whole_matrix is not None:  # owners hold more than the others: the median rank too
        typical = plan.typical
        row |= {"owned_matrices": memory.owned_matrices, "typical_states": typical.device_model_states,
                "typical_device": typical.device_total}
    if plan.options.activation_bytes_per_layer is not None:
        row |= {"activations": memory.activations, "peak": memory.step_peak}
    if args.device_memory is not None:
        row["fits"] = gib(row.get("peak", memory.device_total)) <= args.device_memory
    return row


_COLUMNS = (("weights", "weights"), ("main_weights", "main w"), ("main_grads", "main g"), ("optimizer", "optim"),
            ("model_states", "states"), ("working_set", "working"), ("device_total", "device"), ("host", "host"))


def _parallel_columns(rows: list[dict]) -> list[str]:
    """The model-parallel sizes some row sets: tp, cp, ep and pp when not 1, etp when not the TP size."""
    return [key for key in ("tp", "cp", "ep", "etp", "pp")
            if any(row[key] != (row["tp"] if key == "etp" else 1) for row in rows)]


def _columns(rows: list[dict]) -> tuple[tuple[str, str], ...]:
    """The size columns: with the activation estimate also it and the step's estimated peak."""
    estimated = (("activations", "activ."), ("peak", "peak")) if rows and "peak" in rows[0] else ()
    owners = (("owned_matrices", "owns"), ("typical_states", "typ.state"), ("typical_device", "typ.dev"))
    return _COLUMNS + (owners if rows and "owned_matrices" in rows[0] else ()) + estimated


def format_table(rows: list[dict]) -> str:
    """One line per row, sizes in GiB."""
    parallel = _parallel_columns(rows)
    header = f"{'strategy':<19}{'world':>6}{'outer':>6}" + "".join(f"{key:>5}" for key in parallel) + f"{'offload':>8}"
    columns = _columns(rows)
    header += "".join(f"{title:>10}" for _, title in columns)
    if rows and "fits" in rows[0]:
        header += "  fits"
    lines = [header]
    for row in rows:
        line = f"{row['strategy']:<19}{row['world']:>6}{row['dp_outer']:>6}" + "".join(f"{row[key]:>5}" for key in parallel)
        line += f"{'yes' if row['offload'] else 'no':>8}"
        line += "".join(f"{row[key]:>10}" if key == "owned_matrices" else f"{gib(row[key]):>10.2f}" for key, _ in columns)
        if "fits" in row:
            line += "  " + ("yes" if row["fits"] else "no")
        lines.append(line)
    return "\n".join(lines)


def _micro_batch_count(count: int) -> str:
    return f"{count} micro-batch{'es' if count > 1 else ''}"


def _pipeline_note(staged: list[dict], args: argparse.Namespace) -> str:
    """The pipeline rows' schedule, micro-batches (the fewest the schedule runs, when not given)
    and strategy."""
    first = staged[0]
    if args.micro_batches is not None:
        batches = _micro_batch_count(args.micro_batches)
    else:
        counts = {row["pp"]: row["micro_batches"] for row in staged}
        batches = (f"{', '.join(f'{_micro_batch_count(count)} at pp {pp}' for pp, count in counts.items())} (the "
                   f"fewest {first['schedule']} runs; --micro-batches sets them)")
    strategy = ", optim_grads_params only (FSDP2's door shards the stages)" if args.strategies is None else ""
    split = args.pipeline_layer_split
    layers = f"{split} layer split" if split in LAYER_SPLITS else f"layers a stage {split}"
    return (f"; pipeline: {first['schedule']}, {batches}, {first['virtual_stages']} stage(s) a rank, {layers}, "
            f"the largest rank's stages shown{strategy}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    dtype = _DTYPES[args.dtype]
    if args.hf:
        model, default_units = _load_hf_model(args.hf, dtype)
    else:
        model, default_units = _load_factory_model(args.model, json.loads(args.model_kwargs), dtype), []
    units = _unit_classes(model, _csv(args.units) if args.units else default_units)
    params = sum(p.numel() for p in model.parameters())
    rows = _rows(model, units, args)
    if args.json:
        print("\n".join(json.dumps(row) for row in rows))
        return
    print(f"{params / 1e9:.2f}B parameters ({args.dtype}), units: {', '.join(c.__name__ for c in units) or 'none'}; "
          f"GiB per rank (the largest); 'states' = model states held from the first step, 'working' = "
          f"gathered weights and gradient buffers at their peak, 'device' = states plus the larger of 'working' and the optimizer step's temporaries, before activations")
    if columns := _parallel_columns(rows):
        split = ""
        if any(row["tp"] > 1 or row["etp"] > 1 for row in rows):
            split = "; tensor-parallel split: " + ("--tensor-parallel-plan's" if args.tensor_parallel_plan else
                                                   "Megatron-LM's, by module names")
        if any(row["pp"] > 1 for row in rows):
            split += _pipeline_note([row for row in rows if row["pp"] > 1], args)
        print(f"model-parallel sizes: {', '.join(columns)} (world: all ranks){split}")
    if any("owned_matrices" in row for row in rows):
        print(f"{args.optimizer.split('+')[0]}: each layer matrix is stepped whole on one owner rank, which keeps its "
              "momentum; the rank shown is the most loaded owner ('owns' = its matrices), 'typ.state'/'typ.dev' = "
              "the median rank's")
    if any("peak" in row for row in rows):
        print("'activ.' = activations the schedule keeps in flight (an estimate from --activation-mib-per-layer, layers "
              "only), 'peak' = the step's estimated peak with them")
    print(format_table(rows))
