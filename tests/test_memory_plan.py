"""plan_memory (issue 33): the model states planned for each rank equal, to the byte, what the
wrapped model holds after its first optimizer step: every live tensor storage of the rank that
appeared since before the model was built (found through the garbage collector, so a buffer the
planner forgot cannot hide), for every strategy, precision policy, HSDP/HFSDP, CPU offload, the
double buffer and each way of accumulating micro-batches (issue 40), on gloo at world sizes 1
and 2; at world 4 each strategy, offloading, HSDP and HFSDP; and at world 4 under tensor parallelism (TP2 x DP2) and expert parallelism (EP2 x EDP2,
and experts tensor-parallel). The pool's blocks are not tensors Python holds; the working set is an upper bound on them
(the pool's high-water mark), equal to it where gradients held back are all of it."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp.plan_memory import OptimizerSpec
from megatron_fsdp.plan_memory.command import main
from models import Block, make_batch, make_model
from moe_model import MoEBlock, make_moe

BF16_POLICIES = {
    "bf16 default": megatron_fsdp.MixedPrecisionPolicy(),
    "bf16 fp32 grads, bf16 comm": megatron_fsdp.MixedPrecisionPolicy(
        main_grads_dtype=torch.float32, grad_comm_dtype=torch.bfloat16),
    "bf16 main params": megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=None),
}
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _cases(world: int) -> list[tuple[str, torch.dtype, dict]]:
    cases = [(f"{s} fp32", torch.float32, dict(zero_dp_strategy=s)) for s in STRATEGIES]
    if world == 4:
        # World 2 covers every policy and way of accumulating; world 4 adds what only a larger
        # group has: other shard boundaries and padding for each strategy, and the outer group.
        return cases + [
            ("offload optim fp32", torch.float32, dict(cpu_offload=True, zero_dp_strategy="optim")),
            ("hsdp optim_grads_params bf16", torch.bfloat16, dict(dp_outer_size=2)),
            ("hfsdp bf16", torch.bfloat16, dict(dp_outer_size=2, outer_dp_sharding_strategy="optim")),
        ]
    for name, policy in BF16_POLICIES.items():
        cases += [(f"{s} {name}", torch.bfloat16, dict(zero_dp_strategy=s, mixed_precision_policy=policy)) for s in STRATEGIES]
    cases += [
        ("offload optim_grads_params bf16", torch.bfloat16, dict(cpu_offload=True)),
        ("offload optim fp32", torch.float32, dict(cpu_offload=True, zero_dp_strategy="optim")),
        ("double buffer nan report bf16", torch.bfloat16, dict(fsdp_double_buffer=True, report_nan_in_param_grad=True)),
        ("sgd momentum", torch.float32, dict(optimizer="sgd_momentum")),
        # Not stepped by the C++ ops: torch's RMSprop reads a copy of the bf16 gradients in fp32.
        ("rmsprop bf16 default", torch.bfloat16, dict(optimizer="rmsprop")),
    ]
    if importlib.util.find_spec("torchao") is not None:
        # torchao Float8Linear blocks: their weights' compute copies are float8, one byte each.
        # Not strategies 1/2, whose step ends in an all-gather from a copy of the shard that gloo
        # may still hold when the test counts (measured: once, the copy's 1888 bytes).
        cases += [(f"{s} fp32 float8", torch.float32, dict(zero_dp_strategy=s, float8=True)) for s in ("no_shard", "optim_grads_params")]
        cases.append(("optim_grads_params bf16 default float8", torch.bfloat16, dict(float8=True)))
    if world > 1:
        # Three micro-batches a step, synced each time or held back until the last (each way a
        # user asks for it): 0/1 then hold every bucket's un-reduced gradients in between.
        for s in STRATEGIES:
            cases += [
                (f"{s} fp32 3 micro-batches synced each", torch.float32, dict(zero_dp_strategy=s, accumulation="sync_each")),
                (f"{s} fp32 3 micro-batches no_sync", torch.float32, dict(zero_dp_strategy=s, accumulation="no_sync")),
                (f"{s} bf16 fp32 grads, bf16 comm 3 micro-batches auto-sync off", torch.bfloat16, dict(
                    zero_dp_strategy=s, accumulation="auto_sync_off", mixed_precision_policy=BF16_POLICIES[
                        "bf16 fp32 grads, bf16 comm"])),
            ]
        cases.append(("offload optim fp32 3 micro-batches no_sync", torch.float32,
                      dict(cpu_offload=True, zero_dp_strategy="optim", accumulation="no_sync")))
    return cases


def _make_model(dtype: torch.dtype, float8: bool) -> nn.Module:
    model = make_model(layers=3, dtype=dtype)
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: name.startswith("blocks"))
    return model


def _live_storages() -> dict[int, int]:
    """data pointer -> bytes of every tensor storage Python can reach, except the rank tables of
    device meshes (a few int32 per rank: not model states). The engine's collectives returned
    only once gloo's workers let go of their tensors (collectives.HostWork), so no temporary of
    theirs is counted."""
    objects = gc.get_objects()
    # issubclass on the type: isinstance against DeviceMesh goes through torch's opaque-object
    # check, seconds for every object a rank holds.
    mesh_tables = {obj.mesh.untyped_storage().data_ptr() for obj in objects if issubclass(type(obj), DeviceMesh)}
    storages = {}
    for obj in objects:
        if type(obj) not in (torch.Tensor, nn.Parameter):
            continue  # DTensor faces are wrappers: their local tensors are found themselves
        storage = obj.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in mesh_tables:
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


def _optimizer_spec(kind: str) -> str | OptimizerSpec:
    return OptimizerSpec("rmsprop", states=1) if kind == "rmsprop" else kind


def _held_and_planned(rank: int, world: int) -> list[tuple[str, int, int, int, int]]:
    results = []
    for name, dtype, options in _cases(world):
        options = dict(options)
        optimizer_kind = options.pop("optimizer", "adamw")
        dp_outer_size = options.pop("dp_outer_size", 1)
        accumulation = options.pop("accumulation", None)
        float8 = options.pop("float8", False)
        micro_batches = 1 if accumulation is None else 3
        if accumulation == "auto_sync_off":
            options["sync_model_each_microbatch"] = False
        mesh = None
        if dp_outer_size > 1:
            mesh = torch.distributed.device_mesh.init_device_mesh(
                "cpu", (dp_outer_size, world // dp_outer_size), mesh_dim_names=("dp_outer", "dp_shard"))
            options.update(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
        with torch.device("meta"):
            meta_model = _make_model(dtype, float8)
        plan_options = {k: v for k, v in options.items()
                        if k not in ("device_mesh", "dp_shard_dim", "dp_outer_dim", "sync_model_each_microbatch")}
        plan = megatron_fsdp.plan_memory(
            meta_model, world, dp_outer_size=dp_outer_size, fsdp_unit_modules=[Block], optimizer=_optimizer_spec(optimizer_kind),
            device_type="cpu", micro_batches=micro_batches,
            deferred_reduction=accumulation in ("no_sync", "auto_sync_off"), **plan_options)
        gc.collect()
        before = _live_storages()
        model = _make_model(dtype, float8)
        model, optimizer = megatron_fsdp.fully_shard(
            model, _optimizer(optimizer_kind, model.parameters()), fsdp_unit_modules=[Block], **options)
        for micro in range(micro_batches):
            tokens, targets = make_batch(rank * micro_batches + micro, 2)
            held_back = accumulation == "no_sync" and micro < micro_batches - 1
            with model.no_sync() if held_back else contextlib.nullcontext():
                model(tokens, targets).backward()
        optimizer.step()
        del tokens, targets
        gc.collect()
        held = sum(nbytes for ptr, nbytes in _live_storages().items() if ptr not in before)
        planned = plan.for_rank(rank)
        results.append((name, held, planned.device_model_states + planned.host_model_states,
                        model.pool.high_water_mark(), planned.working_set))
        del model, optimizer, plan
    return results


@pytest.mark.parametrize("world", [1, 2, 4])
def test_planned_model_states_equal_what_each_rank_holds_after_the_first_step(world: int) -> None:
    wrong = []
    for rank, results in enumerate(run_distributed(_held_and_planned, world, timeout=600)):
        for name, held, planned, pool_peak, working_set in results:
            if held != planned:
                wrong.append(f"rank {rank} {name}: holds {held} bytes, planned {planned}")
            if pool_peak > working_set:
                wrong.append(f"rank {rank} {name}: the pool peaked at {pool_peak} bytes, above the planned working set {working_set}")
            if name.endswith("fp32 3 micro-batches no_sync") and not name.startswith("optim_grads") and working_set > 1.01 * pool_peak:
                # Where gradients are the whole working set and need no cast, the plan is the peak
                # (within the root bucket's allocation granule).
                wrong.append(f"rank {rank} {name}: planned {working_set} bytes for a pool peak of {pool_peak}")
    assert not wrong, f"world {world}:\n" + "\n".join(wrong)


def _held_after_first_step(build, batch: tuple[torch.Tensor, torch.Tensor], **shard_options) -> tuple[int, int]:
    """The bytes of every tensor storage this rank holds after fully_shard(build()) and one
    AdamW step on ``batch`` that it did not hold before the model was built, and the bucket
    pool's peak."""
    gc.collect()
    before = _live_storages()
    model = build()
    model, optimizer = megatron_fsdp.fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), **shard_options)
    model(*batch).backward()
    optimizer.step()
    del batch
    gc.collect()
    held = sum(nbytes for ptr, nbytes in _live_storages().items() if ptr not in before)
    pool_peak = model.pool.high_water_mark()
    del model, optimizer
    return held, pool_peak


TP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
# The grouped expert weights of tests/moe_model.py: (experts, hidden, ffn) and (experts, ffn, hidden).
EXPERT_TP_PLAN = {"blocks.*.moe.w_in": 2, "blocks.*.moe.w_out": 1}


def _meta_moe() -> nn.Module:
    with torch.device("meta"):
        model = make_moe()
    for block in model.blocks:
        block.moe.w_in.allreduce = block.moe.w_out.allreduce = False  # as fully_shard reads experts
    return model


def _tensor_parallel_held_and_planned(rank: int, world: int) -> list[tuple[str, int, int, int, int]]:
    """TP2 x DP2 (a (dp, tp) mesh; parallelize_module splits each block's MLP, as
    tests/test_tensor_parallel.py): per strategy and precision, held vs planned bytes."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build(dtype: torch.dtype) -> nn.Module:
        model = make_model(layers=3, dtype=dtype)
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return model

    results = []
    for name, dtype, options in [
        ("tp2 optim_grads_params fp32", torch.float32, dict(zero_dp_strategy="optim_grads_params")),
        ("tp2 optim bf16 fp32 grads, bf16 comm", torch.bfloat16, dict(
            zero_dp_strategy="optim", mixed_precision_policy=BF16_POLICIES["bf16 fp32 grads, bf16 comm"])),
    ]:
        with torch.device("meta"):
            meta_model = make_model(layers=3, dtype=dtype)
        plan = megatron_fsdp.plan_memory(meta_model, world, tensor_parallel_size=2, tensor_parallel_plan=TP_PLAN,
                                         fsdp_unit_modules=[Block], device_type="cpu", **options)
        held, pool_peak = _held_after_first_step(
            lambda: build(dtype), make_batch(mesh["dp"].get_local_rank(), 2), device_mesh=mesh, dp_shard_dim="dp",
            tp_dim="tp", fsdp_unit_modules=[Block], **options)
        planned = plan.for_rank(rank)
        results.append((name, held, planned.device_model_states + planned.host_model_states, pool_peak,
                        planned.working_set))
    return results


def _expert_parallel_held_and_planned(rank: int, world: int) -> list[tuple[str, int, int, int, int]]:
    """tests/test_expert_parallel.py's two layouts: experts over EP2 x EDP2 with dense FSDP over
    4 (under optim_grads_params and optim, whose whole weights tell 2 experts a rank from 4), and
    experts over EP2 x ETP2 (no expert data parallelism) with dense FSDP over 2; HFSDP (2
    replicas of 2 shards, optimizer state split over the replicas) with experts at EP2, which the
    replicas shard as they shard dense parameters; and expert tensor parallelism other than the
    dense one (issue 59): TP2 (each block's mix column-parallel) with experts whole at EP2 x ETP1,
    and HSDP over 2 replicas of TP2 with experts whole at EP1 x ETP1, sharded over the 2 ranks of
    each replica (an expert-data-parallel group larger than the dense shard group of 1)."""
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    experts = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "ep"))
    dense_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    experts_tp = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ep", "etp"))
    experts_etp1 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    dense_hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard"))
    experts_hsdp = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=("dp_outer", "dp_shard", "ep"))
    dense_hsdp_tp = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    experts_hsdp_ep1 = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp_outer", "dp_shard", "ep"))
    ep, ep_etp = dict(expert_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel_size=2,
                                                    tensor_parallel_plan=EXPERT_TP_PLAN)
    mix_tp = dict(tensor_parallel_size=2, expert_tensor_parallel_size=1,
                  tensor_parallel_plan={"blocks.*.mix": "colwise"} | EXPERT_TP_PLAN)
    hfsdp = dict(dp_outer_dim="dp_outer", outer_dp_sharding_strategy="optim")
    hsdp = dict(dp_outer_dim="dp_outer", outer_dp_sharding_strategy="no_shard")
    results = []
    for name, expert_mesh, dense_mesh, dp_rank, planned_sizes, strategy, outer in [
        ("ep2 edp2 optim_grads_params", experts, dense, rank, ep, "optim_grads_params", {}),
        ("ep2 edp2 optim", experts, dense, rank, ep, "optim", {}),
        ("ep2 etp2 optim", experts_tp, dense_tp, dense_tp["dp"].get_local_rank(), ep_etp, "optim", {}),
        ("hfsdp2 ep2 optim_grads_params", experts_hsdp, dense_hsdp, rank, ep, "optim_grads_params", hfsdp),
        ("tp2 ep2 etp1 optim_grads_params", experts_etp1, dense_tp, dense_tp["dp"].get_local_rank(),
         mix_tp | ep, "optim_grads_params", {}),
        ("hsdp2 tp2 ep1 etp1 optim", experts_hsdp_ep1, dense_hsdp_tp, dense_hsdp_tp["dp_outer"].get_local_rank(),
         mix_tp, "optim", hsdp),
    ]:
        plan = megatron_fsdp.plan_memory(
            _meta_moe(), world, fsdp_unit_modules=[MoEBlock], device_type="cpu", zero_dp_strategy=strategy,
            dp_outer_size=2 if outer else 1, outer_dp_sharding_strategy=outer.get("outer_dp_sharding_strategy", "no_shard"),
            **planned_sizes)
        split = expert_mesh[expert_mesh.mesh_dim_names[-2:]] if expert_mesh is experts_tp else expert_mesh["ep"]
        tp_mesh = dense_mesh["tp"] if "mix" in str(planned_sizes.get("tensor_parallel_plan")) else None
        held, pool_peak = _held_after_first_step(
            lambda: _moe_with_mix_split(split, tp_mesh), make_batch(dp_rank, 2), device_mesh=dense_mesh,
            dp_shard_dim="dp_shard" if outer else dense_mesh.mesh_dim_names[0], expt_device_mesh=expert_mesh,
            fsdp_unit_modules=[MoEBlock], zero_dp_strategy=strategy, **({"tp_dim": "tp"} if tp_mesh else {}), **outer)
        planned = plan.for_rank(rank)
        results.append((name, held, planned.device_model_states + planned.host_model_states, pool_peak,
                        planned.working_set))
    return results


def _moe_with_mix_split(expert_mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> nn.Module:
    """tests/moe_model.py's model, each block's mix column-parallel over ``tp_mesh`` (its output
    gathered whole for the residual)."""
    model = make_moe(expert_mesh)
    for block in model.blocks if tp_mesh is not None else ():
        parallelize_module(block, tp_mesh, {"mix": ColwiseParallel(output_layouts=Replicate())})
    return model


@pytest.mark.parametrize("run", [_tensor_parallel_held_and_planned, _expert_parallel_held_and_planned],
                         ids=["tensor_parallel", "expert_parallel"])
def test_planned_model_states_equal_what_each_rank_holds_under_model_parallelism(run) -> None:
    wrong = []
    for rank, results in enumerate(run_distributed(run, 4, timeout=300)):
        for name, held, planned, pool_peak, working_set in results:
            if held != planned:
                wrong.append(f"rank {rank} {name}: holds {held} bytes, planned {planned}")
            if pool_peak > working_set:
                wrong.append(f"rank {rank} {name}: the pool peaked at {pool_peak} bytes, above the planned working "
                             f"set {working_set}")
    assert not wrong, "\n".join(wrong)


REPO = Path(__file__).resolve().parents[1]
GPT_KWARGS = {"layers": 3, "hidden": 64, "heads": 4, "ffn": 176, "vocab_size": 101, "seq_len": 32}


def _meta_gpt(**changes: int) -> tuple[nn.Module, type]:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from gpt_model import TransformerBlock, gpt
    finally:
        sys.path.pop(0)
    with torch.device("meta"):
        return gpt(**GPT_KWARGS | changes).to(torch.bfloat16), TransformerBlock


def test_the_command_prints_one_row_per_choice_with_the_functions_numbers(capsys) -> None:
    main([
        "--model", str(REPO / "examples/gpt_model.py") + ":gpt", "--model-kwargs", json.dumps(GPT_KWARGS),
        "--units", "TransformerBlock", "--world-sizes", "2,8", "--dp-outer-sizes", "1,2", "--cpu-offload", "both",
        "--device-memory", "80", "--json",
    ])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 * 2 * 4 * 2  # world sizes x outer sizes x strategies x offload
    model, block = _meta_gpt()
    for row in rows:
        plan = megatron_fsdp.plan_memory(model, row["world"], dp_outer_size=row["dp_outer"], fsdp_unit_modules=[block],
                                         zero_dp_strategy=row["strategy"], cpu_offload=row["offload"])
        assert row["model_states"] == plan.largest.device_model_states and row["host"] == plan.largest.host_model_states
        assert row["fits"] is True
    sharded = {(r["strategy"], r["offload"]): r["model_states"] for r in rows if r["world"] == 8 and r["dp_outer"] == 1}
    assert sharded[("optim_grads_params", False)] < sharded[("optim", False)] < sharded[("no_shard", False)]
    assert sharded[("optim_grads_params", True)] < sharded[("optim_grads_params", False)]


def test_the_command_reads_a_hugging_face_config_and_prints_a_table(tmp_path, capsys) -> None:
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=211)
    config.save_pretrained(tmp_path)
    main(["--hf", str(tmp_path), "--world-sizes", "4", "--strategies", "optim_grads_params", "--device-memory", "0.000001"])
    out = capsys.readouterr().out
    assert "units: LlamaDecoderLayer" in out, out
    header, row = out.splitlines()[1:3]
    assert header.split()[:4] == ["strategy", "world", "outer", "offload"] and header.endswith("fits"), out
    assert row.split()[:4] == ["optim_grads_params", "4", "1", "no"] and row.endswith("no"), out


@pytest.mark.parametrize("change, message", [
    (dict(world_size=6, dp_outer_size=4), "world_size 6 is not divisible by dp_outer_size 4 .*: sizes that divide it, "
                                          "the others as given: dp_outer_size 1, 2, 3 or 6"),
    (dict(zero_dp_strategy="zero4"), "unknown zero_dp_strategy 'zero4'"),
    (dict(optimizer="lion"), "unknown optimizer 'lion'"),
    (dict(outer_dp_sharding_strategy="optim"), "needs dp_outer_dim"),
    (dict(tensor_parallel_size=2, context_parallel_size=3), "world_size 8 is not divisible by tensor_parallel_size x "
                                                            "context_parallel_size = 2 x 3 = 6 .*: context_parallel_size 1, 2 or 4"),
    (dict(tensor_parallel_size=2, tensor_parallel_plan={"blocks.*.mlp": "colwise"}),
     "tensor_parallel_plan key 'blocks.*.mlp' matches no module"),
    (dict(tensor_parallel_size=2, tensor_parallel_plan={"blocks.*.attn_norm": "colwise"}),
     "'colwise' applies to nn.Linear and nn.Embedding"),
    (dict(expert_parallel_size=2), "expert_parallel_size=2 but the model has no expert parameter"),
])
def test_bad_choices_are_named(change: dict, message: str) -> None:
    model, block = _meta_gpt()
    arguments = dict(world_size=8, fsdp_unit_modules=[block]) | change
    with pytest.raises(ValueError, match=message):
        megatron_fsdp.plan_memory(model, **arguments)


def test_a_model_not_on_the_meta_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"needs a model on the meta device .*torch.device\('meta'\)"):
        megatron_fsdp.plan_memory(make_model(), 2, fsdp_unit_modules=[Block])


@pytest.mark.parametrize("arguments, message", [
    (["--world-sizes", "6", "--dp-outer-sizes", "4"], "world_size 6 is not divisible by dp_outer_size 4"),
    (["--world-sizes", "0"], "--world-sizes: expected integers >= 1"),
    (["--dp-outer-sizes", "-2"], "--dp-outer-sizes: expected integers >= 1"),
    (["--device-memory", "-5"], "--device-memory: expected a number > 0"),
    (["--micro-batches", "0"], "--micro-batches: expected integers >= 1"),
    (["--strategies", "zero9"], "unknown zero_dp_strategy 'zero9'"),
    (["--world-sizes", "6", "--tensor-parallel-size", "4"], "error: world 6, tp 4: world_size 6 is not divisible by "
     "tensor_parallel_size 4 (the mesh is (pp, dp_outer, dp_shard, cp, tp)): sizes that divide it, the others as given: "
     "tensor_parallel_size 1, 2, 3 or 6"),
    (["--world-sizes", "8", "--tensor-parallel-size", "2", "--context-parallel-size", "3"],
     "world_size 8 is not divisible by tensor_parallel_size x context_parallel_size = 2 x 3 = 6"),
    (["--world-sizes", "6", "--tensor-parallel-size", "3"], "tensor_parallel_size 3 does not divide dim 0 (128) of embed.weight"),
    (["--tensor-parallel-size", "0"], "--tensor-model-parallel-size: expected integers >= 1"),
    (["--tensor-parallel-plan", "[1]"], "--tensor-parallel-plan: expected a JSON object"),
])
def test_the_command_refuses_impossible_choices_without_a_traceback(arguments: list, message: str, capsys) -> None:
    model_arguments = ["--model", str(REPO / "examples/gpt_model.py") + ":gpt", "--units", "TransformerBlock"]
    with pytest.raises(SystemExit) as exit_info:
        main(model_arguments + arguments)
    printed = capsys.readouterr().err + (exit_info.value.code if isinstance(exit_info.value.code, str) else "")
    assert exit_info.value.code not in (0, None) and message in printed and "Traceback" not in printed, printed


def test_the_command_takes_model_parallel_sizes_and_prints_them(capsys) -> None:
    """--tensor/--context-parallel-size reach plan_memory (Megatron-LM's split by default) and the
    table shows them; under optim (weights whole on each rank) TP2 about halves the weights."""
    kwargs = json.dumps(GPT_KWARGS | {"vocab_size": 128})  # a vocabulary TP2 can split
    common = ["--model", str(REPO / "examples/gpt_model.py") + ":gpt", "--model-kwargs", kwargs,
              "--units", "TransformerBlock", "--world-sizes", "8", "--strategies", "optim"]
    main(common + ["--tensor-parallel-size", "1,2", "--context-parallel-size", "2", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    model, block = _meta_gpt(vocab_size=128)
    for row in rows:
        plan = megatron_fsdp.plan_memory(model, 8, tensor_parallel_size=row["tp"], context_parallel_size=2,
                                         fsdp_unit_modules=[block], zero_dp_strategy="optim")
        assert (row["cp"], row["ep"], row["etp"]) == (2, 1, row["tp"]), row
        assert row["model_states"] == plan.largest.device_model_states, row
    whole, split = (r["weights"] for r in rows)
    assert 0.5 * whole < split < 0.52 * whole, (whole, split)  # norms and position embeddings stay whole
    # An expert-tensor-parallel size of its own asks for an expert mesh, which a model without
    # experts cannot have (fully_shard refuses an expert mesh without expert parameters).
    with pytest.raises(SystemExit, match="expert_tensor_parallel_size=1 .not the tensor_parallel_size 2. but the model "
                                         "has no expert parameter"):
        main(common + ["--tensor-parallel-size", "2", "--expert-tensor-parallel-size", "1"])


def test_the_command_refuses_expert_parallel_sizes_that_do_not_divide_the_experts(tmp_path, capsys) -> None:
    import transformers

    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128, num_local_experts=4)
    config.save_pretrained(tmp_path)
    main(["--hf", str(tmp_path), "--world-sizes", "8", "--tensor-parallel-size", "2", "--expert-parallel-size", "2,4",
          "--strategies", "optim", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["tp"], r["ep"], r["etp"]) for r in rows] == [(2, 2, 2), (2, 4, 2)], rows
    assert rows[1]["weights"] < rows[0]["weights"], "4 experts over EP4 hold less than over EP2"
    with pytest.raises(SystemExit) as exit_info:
        main(["--hf", str(tmp_path), "--world-sizes", "24", "--expert-parallel-size", "3"])
    assert "expert_parallel_size 3 does not divide the 4 experts of model.layers.0.mlp.experts.gate_up_proj" in str(
        exit_info.value.code), exit_info.value.code


def test_the_command_names_a_missing_config_file(tmp_path) -> None:
    missing = tmp_path / "config.json"
    with pytest.raises(SystemExit, match=f"--hf {missing}: no such file or folder"):
        main(["--hf", str(missing)])


def test_the_command_plans_micro_batches_held_back_as_the_function_does(capsys) -> None:
    """--micro-batches/--deferred-reduction reach plan_memory: under optim, held-back
    micro-batches keep every bucket's un-reduced gradients, so the working set grows."""
    model, block = _meta_gpt()
    common = ["--model", str(REPO / "examples/gpt_model.py") + ":gpt", "--model-kwargs", json.dumps(GPT_KWARGS),
              "--units", "TransformerBlock", "--world-sizes", "4", "--strategies", "optim", "--json"]
    main(common + ["--micro-batches", "4", "--deferred-reduction"])
    held = json.loads(capsys.readouterr().out)
    main(common + ["--micro-batches", "4"])
    synced = json.loads(capsys.readouterr().out)
    plan = megatron_fsdp.plan_memory(model, 4, fsdp_unit_modules=[block], zero_dp_strategy="optim",
                                     micro_batches=4, deferred_reduction=True)
    assert held["working_set"] == plan.largest.working_set > synced["working_set"], (held, synced)


def test_fsdp2s_gradient_sync_off_holds_every_strategys_unreduced_gradients() -> None:
    """Under no_sync() strategies 2/3 reduce-scatter each micro-batch, so holding back changes
    nothing in their plan; under FSDP2's set_requires_gradient_sync(False) every bucket's
    un-reduced gradients (in the communication dtype) stay, which the working set then holds."""
    model, block = _meta_gpt()
    plans = {mode: megatron_fsdp.plan_memory(model, 4, fsdp_unit_modules=[block], micro_batches=3, deferred_reduction=mode)
             for mode in (False, "no_sync", "requires_gradient_sync")}
    assert plans[False].largest.working_set == plans["no_sync"].largest.working_set
    held = sum(p.numel() for p in model.parameters()) * 2  # bf16 communication, before padding
    sync_off = plans["requires_gradient_sync"].largest.grad_buffers
    # Everything held, plus at most what one micro-batch's reductions take on top (and padding).
    assert held <= sync_off <= 1.05 * held + plans[False].largest.grad_buffers, (held, sync_off)
    with pytest.raises(ValueError, match="deferred_reduction must be one of"):
        megatron_fsdp.plan_memory(model, 4, fsdp_unit_modules=[block], micro_batches=3, deferred_reduction="always")


def _fsdp2_pool_peaks(rank: int, world: int) -> dict:
    """Through megatron_fsdp.fsdp2 (per Block, then the root; AdamW after), three micro-batches
    a step, synced each time or with set_requires_gradient_sync(False) until the last: the bucket
    pool's peak and the plan's working set."""
    from megatron_fsdp.fsdp2 import fully_shard
    from megatron_fsdp.fsdp2.state import shared_resources

    peaks = {}
    for mode in (False, "requires_gradient_sync"):
        model = make_model(layers=3)
        for module in model.modules():
            if isinstance(module, Block):
                fully_shard(module)
        fully_shard(model)
        pool = shared_resources().pool
        pool.reset_high_water_mark()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for micro in range(3):
            model.set_requires_gradient_sync(not mode or micro == 2)
            model(*make_batch(rank * 3 + micro, 2)).backward()
        optimizer.step()
        with torch.device("meta"):
            meta_model = make_model(layers=3)
        plan = megatron_fsdp.plan_memory(meta_model, world, fsdp_unit_modules=[Block], micro_batches=3,
                                         deferred_reduction=mode, device_type="cpu")
        peaks[mode] = (pool.high_water_mark(), plan.for_rank(rank).working_set)
        del model, optimizer
    return peaks


def test_the_plan_bounds_fsdp2s_accumulation_without_gradient_sync() -> None:
    for rank, peaks in enumerate(run_distributed(_fsdp2_pool_peaks, 2)):
        for mode, (peak, planned) in peaks.items():
            assert 0 < peak <= planned, f"rank {rank} deferred_reduction={mode!r}: pool peaked at {peak}, planned {planned}"
        assert peaks["requires_gradient_sync"][0] > peaks[False][0], f"rank {rank}: holding back held nothing more: {peaks}"
