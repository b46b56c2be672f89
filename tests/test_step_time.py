"""benchmarks/step_time.py's pieces that need no GPU: the one-GPU floor's arithmetic, which rows
are skipped and why, what a row's processes inherit, and the table."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import step_time  # noqa: E402
from step_time import FLOOR, NVIDIA  # noqa: E402

OURS = "megatron_fsdp optim_grads_params fp32-comm"


def _args(**overrides) -> argparse.Namespace:
    values = dict(config="small", micro_batch=1, seq_len=16, steps=3, warmup=0, impls="all", out=None, layers=None,
                  largest=False, nproc_per_node=None, nvidia_site=None, device="cuda", timeout=60.0)
    return argparse.Namespace(**{**values, **overrides})


def test_floor_trains_like_megatron_fsdp_at_world_size_one(single_rank_group) -> None:
    config = step_time.GPTConfig(seq_len=16, layers=2)
    args, device = _args(), torch.device("cpu")
    losses = {}
    for name in (OURS, FLOOR):
        model, optimizer, autocast = step_time.IMPLEMENTATIONS[name](config, device)
        losses[name] = torch.stack([
            step_time.train_step(model, optimizer, autocast, config, step_time.batch(config, args, step, 0, device))
            for step in range(4)
        ])
    error = (losses[FLOOR] - losses[OURS]).abs().max().item()
    assert error <= 1e-5, f"floor {losses[FLOOR].tolist()} vs ours {losses[OURS].tolist()}: max error {error}"


def test_floor_keeps_fp32_masters_and_casts_them_back_to_bf16_weights() -> None:
    weight = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    optimizer = step_time.MasterWeightAdamW([weight], lr=1e-2)
    weight.grad = torch.randn(8, dtype=torch.bfloat16)
    optimizer.step()
    optimizer.zero_grad()
    (master,) = optimizer.masters
    assert master.dtype == torch.float32 and master.grad.dtype == torch.float32
    assert torch.equal(weight.detach(), master.detach().to(torch.bfloat16)) and weight.grad is None


def test_floor_above_one_gpu_and_nvidia_without_its_site_are_skipped_with_a_reason(tmp_path) -> None:
    config = step_time.CONFIGS["small"]
    assert "--nproc-per-node 1" in step_time._skip_reason(FLOOR, config, _args(), nproc=2)
    assert step_time._skip_reason(FLOOR, config, _args(), nproc=1) is None
    assert "--nvidia-site" in step_time._skip_reason(NVIDIA, config, _args(), nproc=1)
    assert "no megatron_fsdp package" in step_time._skip_reason(NVIDIA, config, _args(nvidia_site=str(tmp_path)), nproc=1)
    (tmp_path / "megatron_fsdp").mkdir()
    assert step_time._skip_reason(NVIDIA, config, _args(nvidia_site=str(tmp_path)), nproc=1) is None
    assert "needs CUDA" in step_time._skip_reason(NVIDIA, config, _args(nvidia_site=str(tmp_path), device="cpu"), nproc=1)


def test_rows_processes_inherit_no_torchrun_variables_and_nvidia_row_imports_its_site_first(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    monkeypatch.setenv("PYTHONPATH", "/repo")
    ours = step_time._child_environment(OURS, _args(nvidia_site="/nv"))
    nvidia = step_time._child_environment(NVIDIA, _args(nvidia_site="/nv"))
    assert "LOCAL_RANK" not in ours and "TORCHELASTIC_RUN_ID" not in ours and ours["PYTHONPATH"] == "/repo"
    assert nvidia["PYTHONPATH"] == os.pathsep.join(["/nv", "/repo"])


def test_documented_impl_lists_still_pick_their_rows() -> None:
    assert step_time.wanted_implementations("optim_grads_params,FSDP2,single") == [
        n for n in step_time.IMPLEMENTATIONS if "optim_grads_params" in n or "FSDP2" in n or n == FLOOR
    ]
    assert step_time.wanted_implementations(f"{OURS},torch FSDP2") == [OURS, "torch FSDP2"]


def test_table_compares_each_row_with_fsdp2_and_the_floor(capsys) -> None:
    def row(name: str, step_s: float, reserved: float) -> dict:
        return {"implementation": name, "layers": 4, "parameters_b": 0.04, "median_step_s": step_s,
                "tokens_per_s_per_gpu": 1000.0, "tflops_per_gpu": 1.0, "peak_allocated_gib": reserved,
                "peak_reserved_gib": reserved, "cpu_ms_per_step": 5.0, "kernels_per_step": 100, "final_loss": 1.0,
                "host_rss_gib": 1.0, "host_pinned_gib": 0.0, "device": "GPU", "torch": "2", "nccl": "2"}

    rows = [row(OURS, 0.05, 2.0), row("torch FSDP2", 0.1, 4.0), row(FLOOR, 0.04, 3.0),
            {"implementation": NVIDIA, "layers": 4, "parameters_b": 0.04, "error": "skipped: no site"}]
    step_time._report(rows, _args(), step_time.CONFIGS["small"], nproc=1)
    table = [[cell.strip() for cell in line.strip()[1:-1].split("|")] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    cells = {line[0]: line for line in table}
    assert cells[OURS][4:6] == ["0.50", "1.25"] and cells[OURS][11] == "0.50" and cells[OURS][13] == "100"
    assert cells[NVIDIA][3] == "skipped: no site"
    assert {len(line) for line in table} == {17}, "every line has the header's cells"


def test_each_row_is_compared_with_fsdp2_in_its_own_configuration() -> None:
    assert step_time.fsdp2_counterpart(OURS) == "torch FSDP2"
    assert step_time.fsdp2_counterpart(f"{OURS} compiled float8") == "torch FSDP2 compiled float8"
    assert step_time.fsdp2_counterpart(f"{OURS} float8") == "torch FSDP2 float8"
    assert step_time.fsdp2_counterpart(f"{OURS} cpu-offload") == "torch FSDP2 cpu-offload"
    assert step_time.fsdp2_counterpart(f"{OURS} hsdp") == "torch FSDP2 hsdp"
    assert step_time.fsdp2_counterpart(f"{OURS} hfsdp") == "torch FSDP2 hsdp"
    assert all(step_time.fsdp2_counterpart(name) in step_time.IMPLEMENTATIONS for name in step_time.IMPLEMENTATIONS)


def test_hybrid_rows_need_a_world_the_two_by_n_mesh_divides() -> None:
    config = step_time.CONFIGS["small"]
    for name in (f"{OURS} hsdp", f"{OURS} hfsdp", "torch FSDP2 hsdp"):
        assert "world size of 4" in step_time._skip_reason(name, config, _args(), nproc=2)
        assert "world size of 4" in step_time._skip_reason(name, config, _args(), nproc=6 + 1)
        assert step_time._skip_reason(name, config, _args(), nproc=4) is None


def test_float8_rows_train_alike_on_the_cpu(single_rank_group) -> None:
    """Ours and FSDP2 in torchtitan's float8 recipe (emulated on the CPU): the same model and
    batches give the same losses within 2e-3 (measured: 4e-4). Not bit for bit: ours computes
    over a bf16 model with fp32 main params, FSDP2 casts its fp32 parameters to bf16 and
    float8 itself, so bf16 roundings fall at other points."""
    config = step_time.GPTConfig(seq_len=16, layers=2)
    args, device = _args(), torch.device("cpu")
    losses = {}
    for name in (f"{OURS} float8", "torch FSDP2 float8"):
        model, optimizer, autocast = step_time.IMPLEMENTATIONS[name](config, device)
        losses[name] = torch.stack([
            step_time.train_step(model, optimizer, autocast, config, step_time.batch(config, args, step, 0, device))
            for step in range(4)
        ])
    ours, fsdp2 = losses.values()
    assert torch.allclose(ours, fsdp2, rtol=2e-3), losses
