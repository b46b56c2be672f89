"""What plan_memory refuses, and how its command reports it (issue 59, items 1 and 5).

The planner is never silently wrong: a layout it accepts is planned as the engine lays it out
(tests/test_memory_plan.py holds the plans against every live tensor of each rank), and a layout
the engine cannot run is refused with the fix, in the same words by the function and the
command. Experts laid out apart from the dense parameters (EP > 1, or an ETP other than the TP
size) need fully_shard's expert mesh, which finds unmarked experts by name: the plan finds them
alike. Pipeline stages are sharded by FSDP2's door, which runs optim_grads_params only, without
an expert mesh. The command reports every problem at once, sizes that do not divide the world
first, and a `--hf` run prints the table and nothing else."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp.plan_memory.command import main
from moe_model import MoEBlock
from test_memory_plan import EXPERT_TP_PLAN, GPT_KWARGS, REPO, _meta_gpt, _meta_moe

MIXTRAL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=128, num_local_experts=8)


def _mixtral(tmp_path=None, marked: bool = False) -> tuple[torch.nn.Module, list[type]]:
    """A tiny Mixtral on the meta device (experts as transformers holds them: grouped weights under
    ``mlp.experts``, unmarked), optionally with its experts marked as fully_shard reads them;
    with ``tmp_path``, its config.json written there for the command."""
    import transformers

    config = transformers.MixtralConfig(**MIXTRAL)
    if tmp_path is not None:
        config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        if marked and ".experts." in name:
            param.allreduce = False
    return model, [type(model.model.layers[0])]


@pytest.mark.parametrize("sizes", [
    dict(tensor_parallel_size=2, expert_parallel_size=2, expert_tensor_parallel_size=1),
    dict(expert_tensor_parallel_size=2),  # dense whole, experts split: EP 1 but an expert mesh
    dict(tensor_parallel_size=2, expert_tensor_parallel_size=1, dp_outer_size=2),
], ids=["tp2 ep2 etp1", "tp1 ep1 etp2", "hsdp2 tp2 ep1 etp1"])
def test_experts_found_by_name_are_planned_as_marked_experts(sizes: dict) -> None:
    """Given an expert mesh, fully_shard marks the parameters under an 'experts' module as
    experts: every rank's plan of the unmarked model equals that of the model marked by hand."""
    plans = []
    for marked in (False, True):
        model, units = _mixtral(marked=marked)
        plan = megatron_fsdp.plan_memory(model, 8, fsdp_unit_modules=units, zero_dp_strategy="optim", **sizes)
        plans.append([(m.device_model_states, m.working_set) for m in (plan.for_rank(r) for r in range(8))])
    assert plans[0] == plans[1], plans


def test_an_expert_layout_fully_shard_refuses_is_refused_alike_by_the_function_and_the_command(tmp_path, capsys) -> None:
    """TP 8 over 64 ranks with experts whole (ETP 1): at EP 1 the experts would be sharded over
    all 64 ranks, a group that does not divide the 8 data-parallel ones (fully_shard refuses it),
    as at EP 2; the fix named (EP 8) plans."""
    model, units = _mixtral(tmp_path)
    messages = {}
    for ep in (1, 2):
        with pytest.raises(ValueError) as refused:
            megatron_fsdp.plan_memory(model, 64, fsdp_unit_modules=units, tensor_parallel_size=8,
                                      expert_parallel_size=ep, expert_tensor_parallel_size=1)
        messages[ep] = str(refused.value)
        assert "must be a multiple of tensor_parallel_size 8: e.g. expert_parallel_size 8 with " \
               "expert_tensor_parallel_size 1" in messages[ep], messages[ep]
        with pytest.raises(SystemExit) as exit_info:
            main(["--hf", str(tmp_path), "--world-sizes", "64", "--tensor-parallel-size", "8",
                  "--expert-parallel-size", str(ep), "--expert-tensor-parallel-size", "1"])
        assert messages[ep] in str(exit_info.value.code), (messages[ep], exit_info.value.code)
    fixed = megatron_fsdp.plan_memory(model, 64, fsdp_unit_modules=units, tensor_parallel_size=8, expert_parallel_size=8,
                                      expert_tensor_parallel_size=1)
    assert fixed.options.parallel.etp == 1


@pytest.mark.parametrize("change, refused", [
    (dict(zero_dp_strategy="optim"), "zero_dp_strategy 'optim' (give 'optim_grads_params')"),
    (dict(dp_outer_size=2, outer_dp_sharding_strategy="optim"), "outer_dp_sharding_strategy 'optim'"),
    (dict(fsdp_double_buffer=True), "fsdp_double_buffer"),
    (dict(report_nan_in_param_grad=True), "report_nan_in_param_grad"),
    (dict(expert_parallel_size=2), "expert parameters sharded over an expert mesh"),
])
def test_a_pipeline_plan_refuses_what_fsdp2s_door_cannot_run(change: dict, refused: str) -> None:
    arguments = dict(world_size=8, fsdp_unit_modules=[MoEBlock], pipeline_parallel_size=2, micro_batches=2) | change
    with pytest.raises(ValueError, match="pipeline parallelism shards each stage module with FSDP2's door") as error:
        megatron_fsdp.plan_memory(_meta_moe(), **arguments)
    assert refused in str(error.value), error.value


GPT4 = ["--model", str(REPO / "examples/gpt_model.py") + ":gpt", "--model-kwargs", json.dumps(GPT_KWARGS | {"layers": 4, "vocab_size": 128}),
        "--units", "TransformerBlock"]


def test_the_command_reports_every_problem_at_once_sizes_first() -> None:
    """World 6 holds no TP 4 x PP 2 mesh (the sizes that would fit are named); at world 8 the
    mesh fits but 1F1B cannot run one micro-batch over two stages: both, the mesh first."""
    with pytest.raises(SystemExit) as exit_info:
        main(GPT4 + ["--world-sizes", "8,6", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
                     "--micro-batches", "1"])
    lines = str(exit_info.value.code).splitlines()
    assert lines == [
        "error: 2 problems, each with its fix:",
        "- world 6, tp 2, pp 2: world_size 6 is not divisible by pipeline_parallel_size x tensor_parallel_size = 2 x 2 = "
        "4 (the mesh is (pp, dp_outer, dp_shard, cp, tp)): sizes that divide it, the others as given: "
        "pipeline_parallel_size 1 or 3; tensor_parallel_size 1 or 3",
        "- world 8, tp 2, pp 2, optim_grads_params; world 6, tp 2, pp 2, optim_grads_params: Schedule1F1B needs at "
        "least as many micro-batches as stages: "
        "1 micro-batch for 2 stages; raise micro_batches to 2 or more",
    ], lines


def test_a_pipeline_plan_without_micro_batches_runs_the_fewest_its_schedule_allows(capsys) -> None:
    """Without --micro-batches a 1F1B row runs pp micro-batches (torch's least), planned as
    plan_memory plans that count, and the table says so; pipeline rows are optim_grads_params."""
    main(GPT4 + ["--world-sizes", "8", "--pipeline-parallel-size", "1,2,4", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["pp"], r["strategy"]) for r in rows if r["pp"] > 1] == [(2, "optim_grads_params"), (4, "optim_grads_params")]
    assert len([r for r in rows if r["pp"] == 1]) == 4, rows
    model, block = _meta_gpt(layers=4, vocab_size=128)
    for row in (r for r in rows if r["pp"] > 1):
        assert row["micro_batches"] == row["pp"], row
        plan = megatron_fsdp.plan_memory(model, 8, fsdp_unit_modules=[block], pipeline_parallel_size=row["pp"],
                                         micro_batches=row["pp"])
        assert (row["model_states"], row["working_set"]) == (plan.largest.device_model_states, plan.largest.working_set)
    main(GPT4 + ["--world-sizes", "8", "--pipeline-parallel-size", "2,4"])
    assert ("pipeline: 1F1B, 2 micro-batches at pp 2, 4 micro-batches at pp 4 (the fewest 1F1B runs; --micro-batches "
            "sets them)") in capsys.readouterr().out


def _run_command(*arguments: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "megatron_fsdp.plan_memory", *arguments], capture_output=True,
                          text=True, env=env, timeout=300, check=False)


def test_a_hugging_face_run_prints_the_table_and_nothing_else(tmp_path) -> None:
    """No torchao library load failures nor torch deprecation warnings (transformers imports
    torchao where it is installed; the plan needs it for float8 only) nor any warning of ours."""
    import transformers

    transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128).save_pretrained(tmp_path)
    run = _run_command("--hf", str(tmp_path / "config.json"), "--world-sizes", "4", "--strategies", "optim_grads_params")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith("0.00B parameters (bf16), units: LlamaDecoderLayer"), run.stdout
    assert lines[1].split()[:4] == ["strategy", "world", "outer", "offload"], run.stdout
    assert lines[2].split()[:4] == ["optim_grads_params", "4", "1", "no"], run.stdout
    usage = _run_command("--help")
    assert usage.returncode == 0 and usage.stderr == "", usage.stderr
    assert usage.stdout.startswith("usage: python -m megatron_fsdp.plan_memory") and "--micro-batches" in usage.stdout


def _expert_layouts(world: int) -> list[tuple[int, int, int, int]]:
    """Every (tp, ep, etp, dp_outer) whose dense and expert meshes fit ``world`` ranks."""
    sizes = [size for size in range(1, world + 1) if world % size == 0]
    return [(tp, ep, etp, outer) for tp, ep, etp, outer in itertools.product(sizes, sizes, sizes, sizes)
            if world % (tp * outer) == 0 and world % (ep * etp * outer) == 0]


def _engine_accepts_expert_layouts(rank: int, world: int) -> dict[tuple[int, int, int, int], str | None]:
    """fully_shard's own groups (FSDPDistributedIndex) for each layout: None where it accepts
    the dense (dp_outer, dp_shard, tp) and expert (dp_outer, dp_shard, ep, tp) meshes, else its
    refusal."""
    from megatron_fsdp.engine.groups.distributed_index import FSDPDistributedIndex

    verdicts, meshes = {}, {}
    for tp, ep, etp, outer in _expert_layouts(world):
        # Each mesh once: a mesh's groups take most of the time.
        for shape, names in (((outer, world // (outer * tp), tp), ("dp_outer", "dp_shard", "tp")),
                             ((outer, world // (outer * ep * etp), ep, etp), ("dp_outer", "dp_shard", "ep", "tp"))):
            if shape not in meshes:
                meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dense, experts = meshes[(outer, world // (outer * tp), tp)], meshes[(outer, world // (outer * ep * etp), ep, etp)]
        try:
            FSDPDistributedIndex(device_mesh=dense, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer" if outer > 1 else None,
                                 tp_dim="tp", expt_device_mesh=experts)
            verdicts[(tp, ep, etp, outer)] = None
        except ValueError as error:
            verdicts[(tp, ep, etp, outer)] = str(error)
    return verdicts


def test_the_plan_accepts_exactly_the_expert_layouts_fully_shard_accepts() -> None:
    """At world 4, every (TP, EP, ETP, HSDP replicas) whose meshes fit: plan_memory plans the
    layouts whose groups fully_shard builds and refuses the others (the model's 4 experts and
    split dims divide every size, so only the meshes decide)."""
    engine = run_distributed(_engine_accepts_expert_layouts, 4)[0]
    disagree = []
    for (tp, ep, etp, outer), refusal in engine.items():
        try:
            megatron_fsdp.plan_memory(_meta_moe(), 4, fsdp_unit_modules=[MoEBlock], tensor_parallel_size=tp,
                                      expert_parallel_size=ep, expert_tensor_parallel_size=etp, dp_outer_size=outer,
                                      tensor_parallel_plan=EXPERT_TP_PLAN)
            planned = None
        except ValueError as error:
            planned = str(error)
        if (refusal is None) != (planned is None):
            disagree.append(f"tp {tp} ep {ep} etp {etp} dp_outer {outer}: fully_shard {refusal or 'accepts'}; "
                            f"plan_memory {planned or 'accepts'}")
    assert len(engine) == 25 and sum(r is None for r in engine.values()) == 21, engine
    assert not disagree, "\n".join(disagree)


def test_a_model_file_never_replaces_the_module_its_stem_names(capsys: pytest.CaptureFixture[str]) -> None:
    """--model FILE.py:CALLABLE runs the file under a name of its own: a process that imported the
    same file by its stem (the suite's ``models``, a user's ``gpt_model``) keeps its classes, which
    pickling to other ranks looks up by name (this once broke every later test using models.Block)."""
    import models

    block = models.Block
    main(["--model", str(REPO / "tests" / "models.py") + ":make_model", "--units", "Block", "--world-sizes", "2"])
    assert "optim_grads_params" in capsys.readouterr().out
    assert sys.modules["models"] is models and models.Block is block
