"""transformers.Trainer with its own FSDP2 settings (``fsdp="full_shard"``, ``fsdp_config=
{"fsdp_version": 2, ...}``) on CUDA, issue 38 with issue 37's front door: the same Trainer run
over a Llama that torch's ``fully_shard`` shards (Accelerate applies it) and over one sharded
beforehand by ``megatron_fsdp.fsdp2.fully_shard`` per decoder layer and on the root (Accelerate's
FSDP2 path takes an ``FSDPModule`` as it is). fp32, so the two agree as torch's FSDP2 and ours
do on gloo (bit for bit there; 1e-5 allowed for CUDA kernels of another order); ``save_model``
writes what ``from_pretrained`` loads equal to the trained weights.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))

import hf_llama  # noqa: E402
import hf_trainer  # noqa: E402
from _dist import nccl_world, run_distributed  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS, ROWS, SEQ = 4, 2, 32


def _train(rank: int, world: int, ours: bool) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from megatron_fsdp.fsdp2 import fully_shard

    model = hf_llama.build_model(hf_llama.tiny_llama_config(tie_word_embeddings=False)).cuda()
    if ours:
        for module in model.modules():
            if isinstance(module, LlamaDecoderLayer):
                fully_shard(module)
        fully_shard(model)
    out = tempfile.mkdtemp()
    # Accelerate looks the layer class up by name before it shards, and a module sharded in place
    # (by torch's fully_shard too) is an FSDP<Cls>: an already sharded model asks for no wrapping.
    wrapping = {"auto_wrap_policy": "NO_WRAP"} if ours else {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    arguments = TrainingArguments(
        output_dir=out, per_device_train_batch_size=ROWS, max_steps=STEPS, learning_rate=3e-3, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, fsdp="full_shard",
        fsdp_config={"fsdp_version": 2, "reshard_after_forward": True, **wrapping},
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=hf_trainer.dataset(STEPS * ROWS * world, SEQ))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trainer.save_model(os.path.join(out, "saved"))
    result = {"losses": losses}
    if rank == 0:
        loaded = LlamaForCausalLM.from_pretrained(os.path.join(out, "saved"))
        result["saved"] = {name: p.detach().float().cpu() for name, p in loaded.named_parameters()}
    return result


def test_trainers_fsdp2_settings_train_a_model_sharded_by_megatron_fsdp_as_torchs_fsdp2() -> None:
    world = nccl_world()
    reference = run_distributed(_train, world, False, backend="nccl", timeout=300)[0]
    ours = run_distributed(_train, world, True, backend="nccl", timeout=300)[0]
    assert len(ours["losses"]) == len(reference["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(ours["losses"], reference["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} against FSDP2's {b}"
    for name, value in reference["saved"].items():
        error = (ours["saved"][name] - value).abs().max().item()
        assert error <= 1e-5 * value.abs().max().item() + 1e-6, f"{name}: saved weights differ by {error}"
