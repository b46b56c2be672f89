"""Accelerate over a model sharded in place by ``megatron_fsdp.fsdp2`` (issue 38 with issue 37's
front door), the way an FSDP2 user writes it: ``FullyShardedDataParallelPlugin(fsdp_version=2)``,
``fully_shard`` per decoder layer and on the root, the optimizer after, then ``prepare``.

On GPU, Accelerate's FSDP2 path takes an ``FSDPModule`` as it is. On CPU it runs its
``MULTI_CPU`` path, which would wrap the model in DistributedDataParallel: the module says it is
prepared, so it trains as sharded, and the same steps equal Accelerate's DDP over the unsharded
model (gloo, world 2; fp32 sums in another order: 1e-6 relative measured, 1e-5 allowed, as
tests/test_parity.py). Wrapping it in DDP by hand is refused before any collective.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import hf_llama  # noqa: E402
from _dist import run_distributed  # noqa: E402

STEPS, ROWS, SEQ = 3, 2, 16


def _train(rank: int, world: int, shard_in_place: bool, device_type: str = "cpu") -> dict:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["OMP_NUM_THREADS"] = "1"  # else Accelerate gives each rank every core
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from megatron_fsdp.fsdp2 import fully_shard

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    try:
        model = hf_llama.build_model(hf_llama.tiny_llama_config()).to(device_type)
        # A model already sharded in place (by torch's fully_shard too) asks for no wrapping: its
        # layers are FSDP<Cls> now, and Accelerate's FSDP2 path (on GPU) looks the class up by name.
        wrapping = {"auto_wrap_policy": "NO_WRAP"} if shard_in_place else {
            "auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"]
        }
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **wrapping)
        accelerator = Accelerator(fsdp_plugin=plugin, cpu=device_type == "cpu")
        if shard_in_place:
            for module in model.modules():
                if isinstance(module, LlamaDecoderLayer):
                    fully_shard(module)
            fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        result = {"type": type(model).__name__, "losses": [], "norms": []}
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(step * world + rank)
            ids = torch.randint(0, hf_llama.VOCAB, (ROWS, SEQ), generator=generator).to(device_type)
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            result["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
            result["losses"].append(loss.item())
        if shard_in_place:
            with pytest.raises(TypeError, match="do not wrap it in DistributedDataParallel"):
                torch.nn.parallel.DistributedDataParallel(model)
        return result
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()


def compare_runs(reference_runs: list[dict], our_runs: list[dict], reference_type: str) -> None:
    """Each rank's losses and clip norms against the reference's (fp32, 1e-5 relative)."""
    for rank, (reference, got) in enumerate(zip(reference_runs, our_runs)):
        assert reference["type"] == reference_type and got["type"] == "FSDPLlamaForCausalLM", (reference, got)
        for key in ("losses", "norms"):
            for a, b in zip(got[key], reference[key]):
                assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} {key}: {got[key]} against {reference_type}'s {reference[key]}"


def test_accelerate_trains_an_fsdp2_sharded_model_as_its_ddp_trains_the_plain_one() -> None:
    compare_runs(run_distributed(_train, 2, False), run_distributed(_train, 2, True), "DistributedDataParallel")
