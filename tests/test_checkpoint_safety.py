"""Loading a checkpoint runs no code that came with it (issue 41). A payload whose unpickling
creates a marker file, placed in each file of a checkpoint that is unpickled (``extra_state.pt``,
``.metadata`` with and without a re-written manifest, a non-tensor and a tensor item of a
``.distcp`` file), never runs: every rank raises the same UnsafeCheckpointError and model and
optimizer stay bit for bit as they were. ``manifest.json`` and ``latest`` are JSON and text,
never unpickled. Saving refuses extra state that loading would refuse, before writing anything.
Common training state, plain checkpoints of every strategy and ``dcp.save``'s own checkpoints
still load. Torch's own readers run each payload (checked here), so each test fails without the
restricted readers."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil

import numpy
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta, TensorStorageMetadata

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp.checkpoint.integrity import write_manifest
from megatron_fsdp.checkpoint.weights_only import load_weights_only, serialize_weights_only
from models import Block, make_batch, make_model, train_steps

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class CreatesMarker:
    """Unpickling it creates the file ``path``: what a stranger's checkpoint could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class Opaque:
    """A harmless class that weights-only loading does not know."""


def _shard(seed: int, strategy: str = "optim_grads_params"):
    model = make_model(seed=seed)
    return megatron_fsdp.fully_shard(model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)


def _snapshot(model, optimizer) -> list[torch.Tensor]:
    """The full parameters and this rank's optimizer state, copied."""
    optimizer_state = [
        (value.to_local() if hasattr(value, "to_local") else value).clone()
        for state in optimizer.state_dict()["state"].values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return list(model.full_parameters().values()) + optimizer_state


def _unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def _trusted_metadata(step_dir: str):
    with open(os.path.join(step_dir, ".metadata"), "rb") as handle:
        return pickle.load(handle)  # written by this test's own save


def _write_metadata(step_dir: str, metadata) -> None:
    with open(os.path.join(step_dir, ".metadata"), "wb") as handle:
        pickle.dump(metadata, handle)


def _rewrite_manifest(step_dir: str) -> None:
    """A manifest whose checksums match the forged files, as a forger would write it."""
    with open(os.path.join(step_dir, "manifest.json")) as handle:
        step = json.load(handle)["step"]
    write_manifest(step_dir, step, [])


def _point_item_at_payload(step_dir: str, want_tensor: bool, payload: bytes) -> str:
    """Appends ``payload`` to the data file of the model's or optimizer's last item (in file
    order) of one kind, a tensor chunk or a non-tensor item, and points that item at it;
    returns the item's key."""
    metadata = _trusted_metadata(step_dir)
    kind = TensorStorageMetadata if want_tensor else BytesStorageMetadata
    index = max(
        (index for index in metadata.storage_data
         if index.fqn.startswith(("model.", "optimizer.")) and isinstance(metadata.state_dict_metadata[index.fqn], kind)),
        key=lambda index: (metadata.storage_data[index].relative_path, metadata.storage_data[index].offset),
    )
    data_file = metadata.storage_data[index].relative_path
    path = os.path.join(step_dir, data_file)
    offset = os.path.getsize(path)
    with open(path, "ab") as handle:
        handle.write(payload)
    metadata.storage_data[index] = _StorageInfo(data_file, offset, len(payload))
    _write_metadata(step_dir, metadata)
    _rewrite_manifest(step_dir)
    return index.fqn


def _forge(case: str, step_dir: str, marker: str) -> str:
    """Puts a payload that creates ``marker`` into the checkpoint; returns what the error names."""
    payload = io.BytesIO()
    torch.save(CreatesMarker(marker), payload)
    if case == "extra_state.pt":
        torch.save({"data_step": 3, "sampler": CreatesMarker(marker)}, os.path.join(step_dir, "extra_state.pt"))
        _rewrite_manifest(step_dir)
        return "extra_state.pt"
    if case.startswith(".metadata"):
        metadata = _trusted_metadata(step_dir)
        metadata.planner_data = {**metadata.planner_data, "forged": CreatesMarker(marker)}
        _write_metadata(step_dir, metadata)
        if case == ".metadata, manifest re-written":
            _rewrite_manifest(step_dir)
        return ".metadata"
    if case == "non-tensor item":
        return _point_item_at_payload(step_dir, False, payload.getvalue())
    assert case == "tensor item", case
    return _point_item_at_payload(step_dir, True, payload.getvalue())


PAYLOAD_CASES = ["extra_state.pt", ".metadata, verify=False", ".metadata, manifest re-written", "non-tensor item", "tensor item"]


def _payload_scenario(rank: int, world: int, root: str) -> dict:
    pristine = os.path.join(root, "pristine")
    model, optimizer = _shard(seed=0)
    train_steps(model, optimizer, rank, world, range(1))
    megatron_fsdp.save_checkpoint(pristine, 3, model, optimizer, extra_state={"data_step": 3})
    results: dict = {"cases": {}}
    for case in PAYLOAD_CASES:
        directory = os.path.join(root, case.replace(" ", "_").replace(",", ""))
        marker = os.path.join(root, f"marker_{len(results['cases'])}")
        named = [None]
        if rank == 0:
            shutil.copytree(pristine, directory)
            named[0] = _forge(case, os.path.join(directory, "step_00000003"), marker)
        dist.broadcast_object_list(named, src=0)
        model, optimizer = _shard(seed=7)  # other weights, a fresh optimizer
        before = _snapshot(model, optimizer)
        try:
            megatron_fsdp.load_checkpoint(directory, model, optimizer, verify=case != ".metadata, verify=False")
            error = None
        except megatron_fsdp.UnsafeCheckpointError as raised:
            error = str(raised)
        results["cases"][case] = {
            "named": named[0], "error": error, "marker": os.path.exists(marker), "untouched": _unchanged(before, _snapshot(model, optimizer)),
        }
        dist.barrier()

    # Saving extra state that loading would refuse: refused before anything is written.
    try:
        extra_state = {"sampler": Opaque(), "numpy_rng": numpy.random.RandomState(0).get_state()}
        megatron_fsdp.save_checkpoint(pristine, 4, model, optimizer, extra_state=extra_state)
        results["save_error"] = None
    except ValueError as raised:
        results["save_error"] = str(raised)
    results["after_refused_save"] = (megatron_fsdp.latest_checkpoint_step(pristine), sorted(os.listdir(pristine)))
    return results


@pytest.fixture(scope="module")
def payload_results(tmp_path_factory) -> list[dict]:
    return run_distributed(_payload_scenario, 2, str(tmp_path_factory.mktemp("payloads")))


@pytest.mark.parametrize("case", PAYLOAD_CASES)
def test_a_payload_never_runs_and_every_rank_raises_the_same_error_before_touching_model_or_optimizer(payload_results, case) -> None:
    outcomes = [result["cases"][case] for result in payload_results]
    assert not any(outcome["marker"] for outcome in outcomes), f"{case}: the payload ran"
    errors = [outcome["error"] for outcome in outcomes]
    assert errors[0] is not None, f"{case}: the forged checkpoint loaded"
    assert errors[0] == errors[1], f"{case}: the ranks raised different errors: {errors}"
    assert outcomes[0]["named"] in errors[0] and "nothing of it was run" in errors[0], errors[0]
    assert all(outcome["untouched"] for outcome in outcomes), f"{case}: the failed load changed the model or optimizer"
    if case == "extra_state.pt":
        assert "torch.serialization.add_safe_globals([" in errors[0], "the message gives the line that allows a trusted class"


def test_saving_extra_state_that_loading_would_refuse_raises_on_every_rank_and_writes_nothing(payload_results) -> None:
    messages = [result["save_error"] for result in payload_results]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert f"refers to ['{Opaque.__module__}.Opaque']" in messages[0], "names the refused class, and only it"
    assert f"torch.serialization.add_safe_globals([{Opaque.__module__}.Opaque])" in messages[0], messages[0]
    assert payload_results[0]["after_refused_save"] == (3, ["latest", "step_00000003"]), payload_results[0]["after_refused_save"]


def _training_extra_state() -> dict:
    """What training scripts keep beside model and optimizer: schedules' and samplers' state
    dicts, RNG states of Python, numpy and torch, numbers, strings, lists, tensors, arrays."""
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([parameter], lr=0.1)
    schedules = torch.optim.lr_scheduler
    warmup, decay = schedules.LinearLR(optimizer, 0.1, total_iters=2), schedules.CosineAnnealingLR(optimizer, 10)
    return {
        "sequential": schedules.SequentialLR(optimizer, [warmup, decay], milestones=[2]).state_dict(),
        "one_cycle": schedules.OneCycleLR(torch.optim.SGD([parameter], lr=0.1), 0.1, total_steps=10).state_dict(),
        "plateau": schedules.ReduceLROnPlateau(torch.optim.SGD([parameter], lr=0.1)).state_dict(),
        "lambda": schedules.LambdaLR(torch.optim.SGD([parameter], lr=0.1), lambda step: 1.0).state_dict(),
        "sampler": {"epoch": 2, "consumed": 1234, "seed": 7, "order": [3, 1, 2]},
        "python_rng": random.getstate(),
        "numpy_rng": numpy.random.get_state(),
        "numpy_generator": numpy.random.default_rng(0).bit_generator.state,
        "torch_rng": torch.get_rng_state(),
        "cuda_rngs": [torch.get_rng_state(), torch.get_rng_state()],  # torch.cuda.get_rng_state_all()'s form
        "numbers": (1, 2.5, float("inf"), True, None, 2**70),
        "name": "run-7",
        "array": numpy.arange(6, dtype=numpy.float32).reshape(2, 3),
        "scalars": [numpy.float64(0.5), numpy.int64(3)],
        "tensor": torch.arange(4, dtype=torch.bfloat16),
    }


def _assert_same(a, b, where: str = "extra_state") -> None:
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, numpy.ndarray):
        assert a.dtype == b.dtype and numpy.array_equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_common_training_state_round_trips_through_weights_only_extra_state() -> None:
    state = _training_extra_state()
    _assert_same(state, load_weights_only(io.BytesIO(serialize_weights_only(state, "extra_state")), "extra_state"))


def test_safe_reader_refuses_payloads_that_torchs_reader_runs_for_users_of_dcp_load(tmp_path) -> None:
    """One process, no process group: dcp.load as a user would call it on our checkpoints."""
    path = str(tmp_path / "forged")
    dcp.save({"weights": torch.ones(3), "note": CreatesMarker(str(tmp_path / "marker_item"))}, checkpoint_id=path)
    forged_metadata = _trusted_metadata(path)
    forged_metadata.planner_data = {**forged_metadata.planner_data, "forged": CreatesMarker(str(tmp_path / "marker_metadata"))}

    dcp.load({"weights": torch.zeros(3), "note": None}, storage_reader=FileSystemReader(path))
    assert os.path.exists(tmp_path / "marker_item"), "the payload is live: torch's own reader runs it"
    os.remove(tmp_path / "marker_item")
    with pytest.raises(CheckpointException, match=r"the item note of checkpoint .* refers to \['_?io.open'\]"):
        dcp.load({"weights": torch.zeros(3), "note": None}, storage_reader=megatron_fsdp.SafeFileSystemReader(path))
    assert not os.path.exists(tmp_path / "marker_item")

    _write_metadata(path, forged_metadata)
    with pytest.raises(megatron_fsdp.UnsafeCheckpointError, match="is not one of the classes DCP's metadata is made of"):
        megatron_fsdp.SafeFileSystemReader(path).read_metadata()
    assert not os.path.exists(tmp_path / "marker_metadata")
    FileSystemReader(path).read_metadata()
    assert os.path.exists(tmp_path / "marker_metadata"), "the payload is live: torch's own reader runs it"

    # Only allowed classes, but setting an attribute of one (for the whole process), as plain
    # pickle would: BUILD with a (None, slot state) pair on the class StorageMeta.
    with open(os.path.join(path, ".metadata"), "wb") as handle:
        handle.write(b"\x80\x02ctorch.distributed.checkpoint.metadata\nStorageMeta\nN}X\x07\x00\x00\x00save_id"
                     b"X\x06\x00\x00\x00forgeds\x86b.")
    with pytest.raises(megatron_fsdp.UnsafeCheckpointError, match="sets attributes of the class StorageMeta"):
        megatron_fsdp.SafeFileSystemReader(path).read_metadata()
    assert StorageMeta.save_id is None


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _plain_scenario(rank: int, world: int, root: str) -> dict:
    """Each checkpoint resumes bit for bit: a step after loading it equals a step after saving it."""
    results: dict = {}
    # The same on every rank (only rank 0's is saved, every rank gets it back).
    extra = {"schedule": {"last_epoch": 2, "base_lrs": [0.01]}, "rng": torch.Generator().manual_seed(3).get_state(),
             "numpy_rng": numpy.random.RandomState(3).get_state()}
    for strategy in STRATEGIES:
        directory = os.path.join(root, strategy)
        model, optimizer = _shard(seed=0, strategy=strategy)
        train_steps(model, optimizer, rank, world, range(1))
        megatron_fsdp.save_checkpoint(directory, 1, model, optimizer, extra_state=extra)
        train_steps(model, optimizer, rank, world, range(1, 2))
        reference = model.full_parameters()
        model, optimizer = _shard(seed=7, strategy=strategy)
        step, loaded_extra = megatron_fsdp.load_checkpoint(directory, model, optimizer)
        train_steps(model, optimizer, rank, world, range(1, 2))
        same_extra = torch.equal(loaded_extra["rng"], extra["rng"]) and numpy.array_equal(loaded_extra["numpy_rng"][1], extra["numpy_rng"][1])
        results[strategy] = step == 1 and same_extra and _same(reference, model.full_parameters())

    # torch's own dcp.save, read by load_checkpoint and by dcp.load through the safe reader.
    model, optimizer = _shard(seed=0)
    train_steps(model, optimizer, rank, world, range(1))
    plain = os.path.join(root, "dcp", "step_00000001")
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=plain)
    train_steps(model, optimizer, rank, world, range(1, 2))
    reference = model.full_parameters()
    model, optimizer = _shard(seed=7)
    loaded = megatron_fsdp.load_checkpoint(os.path.dirname(plain), model, optimizer, step=1)
    train_steps(model, optimizer, rank, world, range(1, 2))
    results["dcp.save by load_checkpoint"] = loaded == (1, None) and _same(reference, model.full_parameters())
    model, optimizer = _shard(seed=7)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, storage_reader=megatron_fsdp.SafeFileSystemReader(plain))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    train_steps(model, optimizer, rank, world, range(1, 2))
    results["dcp.save by dcp.load"] = _same(reference, model.full_parameters())
    return results


def test_plain_checkpoints_of_every_strategy_and_of_dcp_save_still_load(tmp_path) -> None:
    for rank, result in enumerate(run_distributed(_plain_scenario, 2, str(tmp_path))):
        assert all(result.values()), f"rank {rank}: these did not load as saved: {[k for k, ok in result.items() if not ok]}"
