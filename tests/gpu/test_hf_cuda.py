"""Issue 38's CPU tests on CUDA over NCCL, at the machine's world size (one GPU still runs every
CUDA path against the reference): Accelerate on a ``fully_shard`` model, plain and with
``FullyShardedDataParallelPlugin(fsdp_version=2)`` over a model sharded in place by
``megatron_fsdp.fsdp2``, and ``MegatronFSDPTrainer``. The runs and their checks are the CPU
tests' own (tests/test_hf_accelerate.py, tests/test_hf_accelerate_fsdp2.py,
tests/test_hf_trainer.py); the references run on the same GPU. fp32 with deterministic
algorithms, so the tolerances and the bit-for-bit resumes hold as on gloo.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _dist import nccl_world, run_distributed  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_accelerate_trains_saves_and_resumes_a_sharded_model_on_cuda(tmp_path) -> None:
    import test_hf_accelerate as accelerate_case

    world = nccl_world()
    sharded = accelerate_case.sharded_run(world, str(tmp_path), "cuda", backend="nccl")
    assert sharded["distributed_type"] in ("DistributedType.NO", "DistributedType.MULTI_GPU"), sharded["distributed_type"]
    reference = accelerate_case.reference_run(world, "cuda")
    for order in ("shard_then_prepare", "prepare_then_shard"):
        accelerate_case.check_training(sharded, reference, order)
    accelerate_case.check_resumed_exactly(sharded)
    accelerate_case.check_save_pretrained_loads(sharded)
    accelerate_case.check_refusals(sharded)


def test_accelerates_fsdp2_plugin_trains_a_model_sharded_in_place_as_torchs_fsdp2_on_cuda() -> None:
    import test_hf_accelerate_fsdp2 as plugin_case

    world = nccl_world()
    torchs = run_distributed(plugin_case._train, world, False, "cuda", backend="nccl")
    ours = run_distributed(plugin_case._train, world, True, "cuda", backend="nccl")
    plugin_case.compare_runs(torchs, ours, "FSDPLlamaForCausalLM")


def test_megatron_fsdp_trainer_trains_saves_and_resumes_on_cuda(tmp_path) -> None:
    import test_hf_trainer as trainer_case

    world = nccl_world()
    sharded = trainer_case.sharded_run(world, str(tmp_path / "sharded"), "cuda", backend="nccl")
    for optimizer in ("trainers", "passed_in"):
        expected = trainer_case.reference_run(str(tmp_path / optimizer), optimizer == "passed_in", world)
        trainer_case.check_training(sharded, expected, optimizer)
    trainer_case.check_saved_model_loads(sharded)
    trainer_case.check_resumed_exactly(sharded)
