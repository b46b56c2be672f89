"""Checksummed checkpoints on 2 gloo ranks: each kind of damage to the newest checkpoint (a flipped
byte in tensor data, in a tensor's header, in .metadata; a truncated, a deleted file; a deleted
manifest) raises the same CheckpointCorruptError on every rank naming step, file and rank, leaves
model and optimizer bit for bit as they were, and fallback=True resumes bit for bit from the
checkpoint before it. One distributed run saves the pair of checkpoints once and damages a copy
of it per case. The main job (examples/train_gpt.py) skips a damaged checkpoint and extends a
finished run past its LR schedule."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import megatron_fsdp
from _dist import run_distributed
from log_messages import LogMessages
from models import Block, make_batch, make_model


def _shard(seed: int):
    model = make_model(seed=seed)
    return megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block], zero_dp_strategy=3)


def _train(model, optimizer, rank: int, world: int, steps: range) -> None:
    for step in steps:
        tokens, targets = make_batch(step, 2 * world)
        model(tokens[rank::world], targets[rank::world]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """This rank's optimizer state, copied."""
    return [
        (value.to_local() if hasattr(value, "to_local") else value).clone()
        for state in optimizer.state_dict()["state"].values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]


def _differing(a: dict | list, b: dict | list) -> list:
    """The keys (or positions) whose tensors differ bit for bit; empty when all are equal."""
    a, b = (a, b) if isinstance(a, dict) else (dict(enumerate(a)), dict(enumerate(b)))
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [key for key in a if not torch.equal(a[key], b[key])]


def _largest_item(directory: str, file: str, prefix: str) -> tuple[int, int, str]:
    """(offset, length, name) of the largest storage item of ``file`` whose name starts with prefix."""
    with open(os.path.join(directory, "manifest.json")) as handle:
        segments = json.load(handle)["files"][file]["segments"]
    return max(((offset, length, item) for offset, length, _, item in segments if item and item.startswith(prefix)), key=lambda s: s[1])


def _tensor_bytes_at(path: str, offset: int, length: int) -> int:
    """Where the raw tensor bytes of the item at ``offset`` start: the item is a torch.save file."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        item = handle.read(length)
    raw = torch.load(io.BytesIO(item), weights_only=True).contiguous().numpy().tobytes()
    return offset + item.index(raw)


def _flip(path: str, offset: int, count: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        data = handle.read(count)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in data))


def _damage(case: str, directory: str) -> tuple[str, str]:
    """Damages the checkpoint of step 3 in ``directory``; returns the file and a piece of the
    reason the error must give."""
    step3 = os.path.join(directory, "step_00000003")
    if case == "flipped tensor data":
        offset, length, item = _largest_item(step3, "__1_0.distcp", "model.")
        path = os.path.join(step3, "__1_0.distcp")
        _flip(path, _tensor_bytes_at(path, offset, length) + 8, 100)  # values, not structure: DCP would load them
        return "__1_0.distcp", f"bytes {offset}..{offset + length} ({item}) have CRC-32C"
    if case == "flipped tensor header":
        offset, _, item = _largest_item(step3, "__0_0.distcp", "optimizer.")
        _flip(os.path.join(step3, "__0_0.distcp"), offset, 8)  # the item's zip header
        return "__0_0.distcp", f"({item}) have CRC-32C"
    if case == "flipped .metadata":
        _flip(os.path.join(step3, ".metadata"), 2, 8)
        return ".metadata", "have CRC-32C"
    if case == "truncated file":
        path = os.path.join(step3, "__1_0.distcp")
        os.truncate(path, os.path.getsize(path) // 2)
        return "__1_0.distcp", "it is truncated"
    if case == "deleted file":
        os.remove(os.path.join(step3, "__0_0.distcp"))
        return "__0_0.distcp", "it is missing"
    assert case == "deleted manifest", case
    os.remove(os.path.join(step3, "manifest.json"))
    return "manifest.json", "it is missing, but the checkpoint was saved with one"


CASES = ["flipped tensor data", "flipped tensor header", "flipped .metadata", "truncated file", "deleted file", "deleted manifest"]


def _scenario(rank: int, world: int, root: str) -> dict:
    pristine, legacy = os.path.join(root, "pristine"), os.path.join(root, "legacy")
    model, optimizer = _shard(seed=0)
    _train(model, optimizer, rank, world, range(2))
    megatron_fsdp.save_checkpoint(pristine, 2, model, optimizer, extra_state={"data_step": 2})
    at_2 = model.full_parameters()
    # A checkpoint as megatron_fsdp wrote it before manifests: DCP files and `latest`.
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=os.path.join(legacy, "step_00000002"))
    if rank == 0:
        with open(os.path.join(legacy, "latest"), "w") as handle:
            handle.write("2\n")
    _train(model, optimizer, rank, world, range(2, 3))
    megatron_fsdp.save_checkpoint(pristine, 3, model, optimizer, extra_state={"data_step": 3})
    at_3 = model.full_parameters()

    warnings = LogMessages(logging.WARNING)
    logging.getLogger("megatron_fsdp.checkpoint.io").addHandler(warnings)
    results: dict = {"cases": {}}
    for case in CASES:
        directory = os.path.join(root, case.replace(" ", "_"))
        expected = None
        if rank == 0:
            shutil.copytree(pristine, directory)
            expected = _damage(case, directory)
        shared = [expected]
        dist.broadcast_object_list(shared, src=0)
        model, optimizer = _shard(seed=7)  # other weights, a fresh optimizer
        before, optimizer_before = model.full_parameters(), _optimizer_tensors(optimizer)
        outcome: dict = {"expected": shared[0]}
        try:
            megatron_fsdp.load_checkpoint(directory, model, optimizer)
            outcome["error"] = None
        except megatron_fsdp.CheckpointCorruptError as error:
            outcome["error"] = {"step": error.step, "file": error.file, "rank": error.rank, "message": str(error)}
        outcome["changed"] = _differing(before, model.full_parameters()) + _differing(optimizer_before, _optimizer_tensors(optimizer))
        if case == "flipped tensor data":
            outcome["unverified_step"] = megatron_fsdp.load_checkpoint(directory, model, optimizer, verify=False)[0]
        warnings.messages.clear()
        outcome["resumed"] = megatron_fsdp.load_checkpoint(directory, model, optimizer, fallback=True)
        outcome["not_at_2"] = _differing(at_2, model.full_parameters())
        _train(model, optimizer, rank, world, range(2, 3))
        outcome["not_at_3_after_a_step"] = _differing(at_3, model.full_parameters())
        outcome["warnings"] = list(warnings.messages)
        outcome["latest"] = megatron_fsdp.latest_checkpoint_step(directory)
        outcome["set_aside"] = os.path.isdir(os.path.join(directory, "step_00000003.corrupt"))
        results["cases"][case] = outcome
        dist.barrier()  # rank 0 renamed step 3 aside during the fallback load

    # Every checkpoint damaged, step 2 down to an unreadable .metadata and no manifest: fallback
    # has nowhere to go.
    directory = os.path.join(root, "all_damaged")
    if rank == 0:
        shutil.copytree(pristine, directory)
        _damage("deleted file", directory)
        os.remove(os.path.join(directory, "step_00000002", "manifest.json"))
        os.truncate(os.path.join(directory, "step_00000002", ".metadata"), 10)
    dist.barrier()
    model, optimizer = _shard(seed=7)
    warnings.messages.clear()
    try:
        megatron_fsdp.load_checkpoint(directory, model, optimizer, fallback=True)
        results["all_damaged"] = None
    except megatron_fsdp.CheckpointCorruptError as error:
        results["all_damaged"] = str(error)
    results["all_damaged_warnings"] = list(warnings.messages)

    warnings.messages.clear()
    results["legacy"] = megatron_fsdp.load_checkpoint(legacy, model, optimizer)
    results["legacy_not_at_2"] = _differing(at_2, model.full_parameters())
    results["legacy_warnings"] = list(warnings.messages)

    # A `latest` that names no step: rank 0 reads it, every rank raises.
    if rank == 0:
        with open(os.path.join(legacy, "latest"), "w") as handle:
            handle.write("step 2")
    try:
        megatron_fsdp.load_checkpoint(legacy, model, optimizer)
        results["malformed_latest"] = None
    except ValueError as error:
        results["malformed_latest"] = str(error)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_scenario, 2, str(tmp_path_factory.mktemp("integrity")))


@pytest.mark.parametrize("case", CASES)
def test_damage_raises_the_same_checkpoint_corrupt_error_on_every_rank_naming_step_file_and_rank(results, case) -> None:
    errors = [r["cases"][case]["error"] for r in results]
    assert errors[0] is not None, f"{case}: the damaged checkpoint loaded"
    assert errors[0] == errors[1], f"{case}: the ranks raised different errors: {errors}"
    file, reason = results[0]["cases"][case]["expected"]
    error = errors[0]
    assert (error["step"], error["file"]) == (3, file), error
    assert "checkpoint step 3 (" in error["message"] and f"rank {error['rank']} found {file}: " in error["message"], error["message"]
    assert reason in error["message"], f"{reason!r} not in {error['message']!r}"
    assert "fallback=True" in error["message"], "the message names the way out"


@pytest.mark.parametrize("case", CASES)
def test_a_failed_load_leaves_model_and_optimizer_untouched_and_fallback_resumes_bit_for_bit(results, case) -> None:
    for rank, result in enumerate(results):
        outcome = result["cases"][case]
        assert not outcome["changed"], f"{case}, rank {rank}: the failed load changed {outcome['changed']}"
        assert outcome["resumed"] == (2, {"data_step": 2}), f"{case}: fallback loaded {outcome['resumed']}"
        assert not outcome["not_at_2"], f"{case}, rank {rank}: {outcome['not_at_2']} differ from the step-2 checkpoint's"
        assert not outcome["not_at_3_after_a_step"], f"{case}, rank {rank}: one step after resuming, {outcome['not_at_3_after_a_step']} differ from the original step 3"
        assert outcome["latest"] == 2 and outcome["set_aside"], f"{case}: latest {outcome['latest']}, set aside {outcome['set_aside']}"
    logged = results[0]["cases"][case]["warnings"]
    assert any(m.startswith("skipping checkpoint step 3: ") for m in logged), logged
    assert not results[1]["cases"][case]["warnings"], "rank 0 logs for the job"


def test_verify_false_skips_the_check(results) -> None:
    assert all(r["cases"]["flipped tensor data"]["unverified_step"] == 3 for r in results)


def test_fallback_without_an_intact_checkpoint_raises_naming_every_step_tried(results) -> None:
    message = results[0]["all_damaged"]
    assert message is not None and message == results[1]["all_damaged"], results[0]["all_damaged"]
    assert "checkpoint step 3 (" in message and "No older checkpoint" in message and "tried steps [3, 2]" in message, message
    skipped = results[0]["all_damaged_warnings"]
    assert any(m.startswith("skipping checkpoint step 2: rank ") and " found .metadata: it cannot be read" in m for m in skipped), skipped


def test_a_malformed_latest_raises_on_every_rank_saying_what_it_holds(results) -> None:
    messages = [r["malformed_latest"] for r in results]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert "holds 'step 2', not a step number" in messages[0], messages[0]


def test_fallback_needs_verification(tmp_path) -> None:
    with pytest.raises(ValueError, match="fallback=True needs verify=True"):
        megatron_fsdp.load_checkpoint(str(tmp_path), None, fallback=True, verify=False)


def test_a_checkpoint_without_a_manifest_loads_with_one_warning(results) -> None:
    assert all(r["legacy"] == (2, None) and not r["legacy_not_at_2"] for r in results), [r["legacy_not_at_2"] for r in results]
    warnings = results[0]["legacy_warnings"] + results[1]["legacy_warnings"]
    assert len(warnings) == 1 and "has no manifest" in warnings[0], warnings


TRAIN_GPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt.py")
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--micro-batch", "4", "--sample-chars", "0"]


def _train_gpt(checkpoint_dir: str, steps: int) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", TRAIN_GPT,
               "--checkpoint-dir", checkpoint_dir, "--checkpoint-every", "2", "--steps", str(steps), *TINY]
    run = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=180)
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"train_gpt.py --steps {steps} failed ({run.returncode}):\n{log[-4000:]}"
    return log


def test_train_gpt_skips_a_corrupt_checkpoint_and_extends_a_finished_run(tmp_path) -> None:
    checkpoints = str(tmp_path / "run")
    _train_gpt(checkpoints, steps=4)
    _flip(os.path.join(checkpoints, "step_00000004", "__0_0.distcp"), 5000, 4)
    log = _train_gpt(checkpoints, steps=6)  # past the 4-step schedule the checkpoint holds
    for expected in ("skipping checkpoint step 4: rank ", " found __0_0.distcp: ", "LR schedule rebuilt for 6 steps", "at step 2"):
        assert expected in log, f"{expected!r} not in the log:\n{log[-4000:]}"
    assert megatron_fsdp.latest_checkpoint_step(checkpoints) == 6


def test_segment_checksums_continue_across_map_windows(tmp_path, monkeypatch) -> None:
    from megatron_fsdp import _ops
    from megatron_fsdp.checkpoint import integrity as checkpoint_integrity

    data = torch.randint(0, 256, (40_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "file"
    path.write_bytes(data.numpy().tobytes())
    items = [(100, 9_000, "a"), (9_100, 4_096, "b"), (20_000, 19_000, "c")]  # gaps before, between and after
    monkeypatch.setattr(checkpoint_integrity, "_WINDOW_BYTES", 4096)  # every segment crosses windows
    entry = checkpoint_integrity.checksum_segments(str(path), items)
    assert entry["size"] == data.numel()
    assert [(o, n) for o, n, _, _ in entry["segments"]] == [(0, 100), (100, 9_000), (9_100, 4_096), (13_196, 6_804), (20_000, 19_000), (39_000, 1_000)]
    for offset, length, crc, _ in entry["segments"]:
        assert crc == _ops.crc32c(data[offset : offset + length]), f"segment at {offset}"
