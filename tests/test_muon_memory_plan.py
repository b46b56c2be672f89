"""plan_memory for the Muon + AdamW split (issue 59): torch's Muon on the blocks' 2-D matrices,
AdamW on the rest, both sharded with the model (whole-model door). Each matrix is stepped whole
on one owner rank, which keeps its momentum; the plan deals the owners by the engine's own rule
(engine/params/owner_assignment.py), so its model states equal, to the byte, every live tensor
storage a rank holds after the first step (tests/test_memory_plan.py's count), rank by rank,
and it names how many matrices each rank owns. World 1 runs in the test process; one run of 4
gloo ranks covers world 4 (FSDP with every matrix whole on every rank and sharded, HSDP in bf16
with fp32 main weights, HFSDP, offloading) and world 2 (each half of the ranks a world-2 FSDP mesh
of its own).
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp.plan_memory import plan_memory
from megatron_fsdp.plan_memory.command import main
from models import Block, make_batch, make_model
from test_memory_plan import _live_storages


def _is_block_matrix(name: str, param: torch.Tensor) -> bool:
    return name.startswith("blocks.") and param.dim() == 2


def _muon_and_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    return [torch.optim.Muon([p for n, p in named if _is_block_matrix(n, p)], lr=0.02),
            torch.optim.AdamW([p for n, p in named if not _is_block_matrix(n, p)], lr=1e-3)]


# (name, world planned, compute dtype, fully_shard's options); "world" 2 runs on a (2, 2) mesh
# whose halves shard apart, "hsdp"/"hfsdp" on a (dp_outer 2, dp_shard 2) one.
CASES = [
    ("no_shard fp32", 4, torch.float32, dict(zero_dp_strategy="no_shard")),
    ("optim_grads_params fp32", 4, torch.float32, dict(zero_dp_strategy="optim_grads_params")),
    ("offload optim fp32", 4, torch.float32, dict(zero_dp_strategy="optim", cpu_offload=True)),
    ("hsdp bf16", 4, torch.bfloat16, dict(dp_outer_size=2)),
    ("hfsdp fp32", 4, torch.float32, dict(dp_outer_size=2, outer_dp_sharding_strategy="optim")),
    ("world 2 optim_grads_params fp32", 2, torch.float32, dict(zero_dp_strategy="optim_grads_params")),
]


def _held_and_planned(rank: int, world: int, cases: list) -> list[tuple[str, int, int, int, int, int]]:
    """Per case: the bytes this rank holds after one Muon + AdamW step, the plan's model states for
    it, the matrices whose momentum it holds, the plan's count, and the momenta's bytes."""
    results = []
    for name, planned_world, dtype, options in cases:
        options = dict(options)
        dp_outer_size = options.pop("dp_outer_size", 1)
        shard = {}
        if dp_outer_size > 1:
            mesh = init_device_mesh("cpu", (dp_outer_size, world // dp_outer_size), mesh_dim_names=("dp_outer", "dp_shard"))
            shard = dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
        elif planned_world < world:
            mesh = init_device_mesh("cpu", (world // planned_world, planned_world), mesh_dim_names=("apart", "dp_shard"))
            shard = dict(device_mesh=mesh["dp_shard"], dp_shard_dim="dp_shard")
        with torch.device("meta"):
            meta = make_model(dtype=dtype)
        plan = plan_memory(meta, planned_world, dp_outer_size=dp_outer_size, fsdp_unit_modules=[Block],
                           optimizer=_muon_and_adamw(meta), device_type="cpu", **options)
        gc.collect()
        before = _live_storages()
        model = make_model(dtype=dtype)
        muon, adamw = _muon_and_adamw(model)
        model, muon = megatron_fsdp.fully_shard(model, muon, fsdp_unit_modules=[Block], **shard, **options)
        adamw = megatron_fsdp.fully_shard_optimizer(adamw, model=model)
        model(*make_batch(rank, 2)).backward()
        for optimizer in (muon, adamw):
            optimizer.step()
        gc.collect()
        held = sum(nbytes for ptr, nbytes in _live_storages().items() if ptr not in before)
        momenta = [entries["momentum_buffer"] for entries in muon.state.values() if "momentum_buffer" in entries]
        planned = plan.for_rank(rank % planned_world)
        results.append((name, held, planned.device_model_states + planned.host_model_states, len(momenta),
                        planned.owned_matrices, sum(m.numel() * m.element_size() for m in momenta)))
        del model, muon, adamw, plan
    return results


def _wrong(rank: int, results: list) -> list[str]:
    wrong = []
    for name, held, planned, owned, planned_owned, _ in results:
        if held != planned or owned != planned_owned:
            wrong.append(f"rank {rank} {name}: holds {held} bytes and {owned} momenta, planned {planned} and {planned_owned}")
    return wrong


def test_muon_plan_equals_what_each_rank_holds_at_world_1(single_rank_group) -> None:
    cases = [("world 1 optim_grads_params fp32", 1, torch.float32, {}),
             ("world 1 bf16, fp32 main", 1, torch.bfloat16, {})]
    results = _held_and_planned(0, 1, cases)
    assert all(owned == 8 for _, _, _, owned, _, _ in results), results  # 2 blocks x 4 matrices, all on the one rank
    assert not (wrong := _wrong(0, results)), "\n".join(wrong)


def test_muon_plan_equals_what_each_rank_holds_at_worlds_2_and_4() -> None:
    per_rank = run_distributed(_held_and_planned, 4, CASES, timeout=600)
    wrong = [line for rank, results in enumerate(per_rank) for line in _wrong(rank, results)]
    assert not wrong, "\n".join(wrong)
    # Owners make ranks differ: under FSDP over 4 ranks each owns 2 of the 8 matrices, of other sizes.
    momenta = [results[1][5] for results in per_rank]
    assert len(set(momenta)) > 1, momenta


def _meta_model(layers: int = 2) -> torch.nn.Module:
    with torch.device("meta"):
        return make_model(layers=layers)


def test_muon_plus_adamw_by_name_is_muon_on_the_layers_matrices_and_adamw_on_the_rest() -> None:
    meta = _meta_model()
    by_name = plan_memory(meta, 4, fsdp_unit_modules=[Block], optimizer="muon+adamw")
    by_instances = plan_memory(meta, 4, fsdp_unit_modules=[Block], optimizer=_muon_and_adamw(meta))
    assert [vars(m) for m in by_name.ranks] == [vars(m) for m in by_instances.ranks]
    assert by_name.options.whole_matrix.params == tuple(n for n, p in meta.named_parameters() if _is_block_matrix(n, p))
    # The owners hold the momenta (4 bytes a value, fp32 main weights) of all 8 matrices between them, once.
    matrices = sum(p.numel() for n, p in meta.named_parameters() if _is_block_matrix(n, p))
    adamw = plan_memory(meta, 4, fsdp_unit_modules=[Block], optimizer="adamw")
    momenta = sum(m.device["optimizer state"] for m in by_name.ranks)
    moments_left = sum(m.device["optimizer state"] for m in adamw.ranks) - 2 * 4 * matrices
    assert momenta == moments_left + 4 * matrices, (momenta, moments_left)
    assert sum(m.owned_matrices for m in by_name.ranks) == 8
    assert by_name.largest.step_peak >= by_name.typical.step_peak


@pytest.mark.parametrize("optimizer, sizes, message", [
    ("muon", {}, "e.g. .muon\\+adamw."),
    ("muon+muon", {}, "unknown optimizer split"),
    ("muon+adamw", {"tensor_parallel_size": 2}, "tensor_parallel_size 2"),
    ("muon+adamw", {"pipeline_parallel_size": 2, "micro_batches": 2}, "pipeline_parallel_size 2"),
    ("muon+adamw", {"cpu_offload": True}, "without offloading"),
])
def test_what_the_muon_plan_does_not_cover_is_refused_with_the_fix(optimizer: str, sizes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_memory(_meta_model(), 4, fsdp_unit_modules=[Block], optimizer=optimizer, **sizes)


def test_a_parameter_in_no_optimizer_is_refused() -> None:
    meta = _meta_model()
    muon, _ = _muon_and_adamw(meta)
    with pytest.raises(ValueError, match="in no optimizer"):
        plan_memory(meta, 2, fsdp_unit_modules=[Block], optimizer=[muon])


def test_the_command_plans_muon_plus_adamw_and_shows_the_typical_rank(capsys) -> None:
    main(["--model", "tests/models.py:make_model", "--model-kwargs", '{"layers": 3}', "--units", "Block", "--dtype", "fp32",
          "--world-sizes", "1,4", "--strategies", "optim_grads_params", "--optimizer", "muon+adamw", "--json"])
    rows = [__import__("json").loads(line) for line in capsys.readouterr().out.splitlines()]
    for row in rows:
        plan = plan_memory(_meta_model(3), row["world"], fsdp_unit_modules=[Block], optimizer="muon+adamw")
        assert (row["optimizer"], row["owned_matrices"]) == (plan.largest.device["optimizer state"], plan.largest.owned_matrices)
        assert (row["typical_states"], row["typical_device"]) == (plan.typical.device_model_states, plan.typical.device_total)
    assert [row["owned_matrices"] for row in rows] == [12, 3]  # 3 blocks x 4 matrices over 1 rank, then 4
    main(["--model", "tests/models.py:make_model", "--units", "Block", "--world-sizes", "4", "--optimizer", "muon+adamw"])
    table = capsys.readouterr().out
    assert "owns" in table and "typ.state" in table and "most loaded owner" in table
