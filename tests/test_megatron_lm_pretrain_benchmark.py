"""benchmarks/megatron_lm_pretrain.py's pieces that need no GPU: the torchrun command of a row,
the row selection, and the numbers read from Megatron-LM's log."""

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import megatron_lm_pretrain as bench  # noqa: E402

OURS_PP = "megatron_fsdp (ours) optim_grads_params"
DDP_PP = "megatron-core DDP, distributed optimizer"


def _args(**overrides) -> argparse.Namespace:
    values = dict(pipeline_model_parallel_size=1, virtual_stage_layers=None, nproc_per_node=4, iterations=8,
                  global_batch_size=16)
    return argparse.Namespace(**{**values, **overrides})


def test_pipeline_rows_tie_the_embedding_and_launch_only_ours_through_megatron_fsdp(monkeypatch) -> None:
    monkeypatch.setenv("MEGATRON_LM_DIR", "/mlm")
    args = _args(pipeline_model_parallel_size=2, virtual_stage_layers=6)
    ours, ddp = bench.command(OURS_PP, "1.3B", args), bench.command(DDP_PP, "1.3B", args)
    assert ours[ours.index("/mlm/pretrain_gpt.py") - 1] == "megatron_fsdp.integrations.launch"
    assert ddp[ddp.index("/mlm/pretrain_gpt.py") - 1] == "--nproc-per-node=4"
    for command in (ours, ddp):
        assert "--untie-embeddings-and-output-weights" not in command
        assert command[command.index("--pipeline-model-parallel-size") + 1] == "2"
        assert command[command.index("--num-layers-per-virtual-pipeline-stage") + 1] == "6"
        assert command[command.index("--global-batch-size") + 1] == "16" and "--overlap-grad-reduce" in command
    assert "optim_grads_params" in ours and "--use-megatron-fsdp" not in ddp and "--use-distributed-optimizer" in ddp
    plain = bench.command("megatron_fsdp (ours)", "1.3B", _args())
    assert "--untie-embeddings-and-output-weights" in plain and "--pipeline-model-parallel-size" not in plain


def test_rows_are_picked_by_name_or_substring_from_the_table_in_use() -> None:
    assert bench.wanted_rows(None, 2) == [OURS_PP, DDP_PP]
    assert bench.wanted_rows("DDP", 2) == [DDP_PP]
    assert bench.wanted_rows("ours", 1) == ["megatron_fsdp (ours)"]
    with pytest.raises(SystemExit, match="no row"):
        bench.wanted_rows("bundled", 2)


def test_the_log_gives_the_median_after_the_warm_up_and_each_stages_peak_memory() -> None:
    log = "\n".join([
        *(f" [2026-11-28 10:00:0{i}] iteration        {i}/       6 | consumed samples:  {16 * i} | "
          f"elapsed time per iteration (ms): {ms} | learning rate: 3.0E-04 |" for i, ms in enumerate([900.0, 500.0, 100.0, 120.0, 110.0, 300.0], 1)),
        "[Rank 0] (after 1 iterations) memory (MB) | allocated: 1.00 | max allocated: 200.00 | reserved: 3.00 | max reserved: 3.00",
        "[Rank 2] (after 1 iterations) memory (MB) | allocated: 1.00 | max allocated: 150.00 | reserved: 3.00 | max reserved: 3.00",
        "[Rank 0] (after 2 iterations) memory (MB) | allocated: 1.00 | max allocated: 250.00 | reserved: 3.00 | max reserved: 3.00",
        "[Rank 2] (after 2 iterations) memory (MB) | allocated: 1.00 | max allocated: 180.00 | reserved: 3.00 | max reserved: 3.00",
    ])
    numbers = bench.parse(log, warm_up=2)
    assert (numbers["median_ms"], numbers["max_ms"], numbers["iterations_timed"]) == (115.0, 300.0, 4)
    assert numbers["max_allocated_mb"] == 250.0 and numbers["max_allocated_mb_by_rank"] == {"0": 250.0, "2": 180.0}
    assert bench.parse("no iterations", warm_up=2) == {}
