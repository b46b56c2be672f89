"""Saving a sharded model through a writer of one process's tensors (issue 47, point 3), through
the clients' own calls on 2 gloo ranks: ``safetensors.torch.save_file(model.state_dict())``,
Accelerate's ``save_state`` outside ``full_state_dicts``, Hugging Face's ``save_pretrained`` of a
module sharded in place, plain ``transformers.Trainer``'s ``save_model`` and its step checkpoints,
over both front doors (``megatron_fsdp.fully_shard``'s wrapper and ``megatron_fsdp.fsdp2``'s
in-place ``FSDPModule``).

Where every rank calls into the writer, every rank raises ``ShardedSaveError`` naming the ways
that work, before the writer writes: no file, and the previous checkpoint byte for byte. Plain
Trainer calls the model on its first rank alone (``Trainer._save`` returns on the others before
touching it), so there only the first rank can raise; the others write nothing of the model
(docs/hugging_face.md says what they do)."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import hf_llama  # noqa: E402
import hf_trainer  # noqa: E402
from _dist import run_distributed  # noqa: E402

WORLD, ROWS, SEQ = 2, 2, 16
# What every refusal names: the ways that write a sharded model.
WAYS = (
    "MegatronFSDPTrainer", "megatron_fsdp.integrations.hugging_face.full_state_dicts", "megatron_fsdp.save_checkpoint",
    "megatron_fsdp.save_pretrained",
)


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _files(directory: str) -> dict[str, str]:
    """Every file under ``directory`` -> its SHA-256 ({} when there is no directory)."""
    found = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, directory)] = hashlib.sha256(handle.read()).hexdigest()
    return found


def _refusal(attempt) -> str | None:
    """``str(error)`` of the ShardedSaveError ``attempt()`` raised; None if it returned; any other
    exception propagates (and fails the test with its traceback)."""
    from megatron_fsdp import ShardedSaveError

    try:
        attempt()
    except ShardedSaveError as error:
        return str(error)
    return None


def _wrapper_llama():
    return hf_trainer.shard(hf_llama.build_model(hf_llama.tiny_llama_config()))


def _in_place_llama():
    from megatron_fsdp.fsdp2 import fully_shard

    model = hf_llama.build_model(hf_llama.tiny_llama_config())
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _cases(rank: int, world: int, out_dir: str) -> dict:
    from accelerate import Accelerator
    from safetensors.torch import save_file
    from transformers import Trainer, TrainingArguments

    import megatron_fsdp
    from megatron_fsdp.integrations.hugging_face import full_state_dicts

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets: Accelerate reads it
    os.environ["OMP_NUM_THREADS"] = "1"
    results: dict = {}
    _reset_accelerate()
    try:
        for door, build in (("wrapper", _wrapper_llama), ("in_place", _in_place_llama)):
            # safetensors itself, on every rank.
            model = build()
            path = os.path.join(out_dir, f"{door}_{rank}.safetensors")
            results[f"{door} save_file"] = (_refusal(lambda: save_file(model.state_dict(), path)), os.path.exists(path))

            # Accelerate's save_state over a checkpoint written the way that works.
            accelerator = Accelerator(cpu=True)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if door == "wrapper":
                optimizer = megatron_fsdp.fully_shard_optimizer(optimizer, model=model)
            model, optimizer = accelerator.prepare(model, optimizer)
            state_dir = os.path.join(out_dir, f"{door}_state")
            if door == "wrapper":
                with full_state_dicts(model, optimizer):
                    accelerator.save_state(state_dir)
            elif rank == 0:  # full_state_dicts takes the wrapper: an earlier file stands in for a checkpoint
                os.makedirs(state_dir, exist_ok=True)
                with open(os.path.join(state_dir, "model.safetensors"), "wb") as handle:
                    handle.write(b"an earlier checkpoint")
            torch.distributed.barrier()
            before = _files(state_dir)
            refused = _refusal(lambda: accelerator.save_state(state_dir))
            results[f"{door} save_state"] = (refused, _files(state_dir) == before)
            _reset_accelerate()

            # Hugging Face's save_pretrained of a module sharded in place, on every rank.
            if door == "in_place":
                pretrained_dir = os.path.join(out_dir, f"pretrained_{rank}")
                refused = _refusal(lambda: model.save_pretrained(pretrained_dir))
                results["in_place save_pretrained"] = (refused, os.path.exists(pretrained_dir))

            # Plain Trainer's save_model (default TrainingArguments): the first rank calls the model.
            saved_dir = os.path.join(out_dir, f"{door}_saved")
            trainer = Trainer(model=model, args=TrainingArguments(output_dir=os.path.join(out_dir, f"{door}_run"), use_cpu=True))
            results[f"{door} save_model"] = (_refusal(lambda: trainer.save_model(saved_dir)), _files(saved_dir))
            _reset_accelerate()

        # Trainer's own step checkpoint, with a sharded optimizer passed in (Trainer's own is
        # refused at its first step): the checkpoint after the first of one step.
        model = _wrapper_llama()
        optimizer = megatron_fsdp.fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model)
        run_dir = os.path.join(out_dir, "steps_run")
        arguments = TrainingArguments(
            output_dir=run_dir, max_steps=1, save_steps=1, per_device_train_batch_size=ROWS, report_to="none", use_cpu=True
        )
        trainer = Trainer(model=model, args=arguments, train_dataset=hf_trainer.dataset(ROWS * world, SEQ), optimizers=(optimizer, None))
        refused = _refusal(trainer.train)
        if refused is not None:
            # The other ranks went on to end train(), whose last collective sums the flops.
            trainer.store_flos()
        results["step checkpoint"] = (refused, _files(os.path.join(run_dir, "checkpoint-1")))
    finally:
        _reset_accelerate()
    return results


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> list[dict]:
    return run_distributed(_cases, WORLD, str(tmp_path_factory.mktemp("hf_save_refusals")))


def _check_refusal(message: str | None, case: str, rank: int) -> None:
    assert message is not None, f"{case}: rank {rank} saved instead of raising ShardedSaveError"
    missing = [way for way in WAYS if way not in message]
    assert not missing, f"{case}: rank {rank}'s error does not name {missing}: {message}"


@pytest.mark.parametrize("door", ["wrapper", "in_place"])
def test_safetensors_save_file_of_the_state_dict_raises_on_every_rank_and_writes_no_file(refusals, door: str) -> None:
    for rank, results in enumerate(refusals):
        message, exists = results[f"{door} save_file"]
        _check_refusal(message, f"{door} save_file", rank)
        assert not exists, f"rank {rank} left a file"


@pytest.mark.parametrize("door", ["wrapper", "in_place"])
def test_accelerate_save_state_outside_full_state_dicts_raises_on_every_rank_and_keeps_the_last_checkpoint(refusals, door: str) -> None:
    for rank, results in enumerate(refusals):
        message, unchanged = results[f"{door} save_state"]
        _check_refusal(message, f"{door} save_state", rank)
        assert unchanged, f"rank {rank}: the checkpoint already in the directory changed"


def test_save_pretrained_of_a_module_sharded_in_place_raises_on_every_rank_before_writing(refusals) -> None:
    for rank, results in enumerate(refusals):
        message, exists = results["in_place save_pretrained"]
        _check_refusal(message, "in_place save_pretrained", rank)
        assert not exists, f"rank {rank} created the directory"


@pytest.mark.parametrize("door", ["wrapper", "in_place"])
def test_plain_trainer_save_model_raises_on_the_first_rank_before_writing_the_weights(refusals, door: str) -> None:
    """Trainer's other ranks return from save_model without touching the model: nothing to raise."""
    first, other = refusals
    message, written = first[f"{door} save_model"]
    _check_refusal(message, f"{door} save_model", 0)
    assert written == {}, f"rank 0 wrote {sorted(written)}"
    assert other[f"{door} save_model"] == (None, {})


def test_plain_trainer_step_checkpoint_raises_on_the_first_rank_before_writing_the_model(refusals) -> None:
    first, other = refusals
    message, written = first["step checkpoint"]
    _check_refusal(message, "step checkpoint", 0)
    # Rank 1 went on through Trainer's checkpoint: its RNG state is all it writes there.
    assert sorted(written) == ["rng_state_1.pth"], sorted(written)
    assert other["step checkpoint"][0] is None
