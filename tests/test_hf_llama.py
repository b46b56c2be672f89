"""examples/hf_llama.py on 2 gloo ranks: a Transformers Llama sharded by its decoder-layer
import path trains like the unsharded model on the same global batches; its save (every rank
writing its pieces) loads with ``LlamaForCausalLM.from_pretrained`` into the same weights and
logits, and back into a model built on the meta device (``--pretrained``) into the same weights."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import hf_llama  # noqa: E402
from _dist import run_distributed  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

STEPS, ROWS, SEQ, LR, WORLD = 5, 2, 32, 3e-3, 2
# (tie_word_embeddings, zero_dp_strategy): a tied head lives in the root unit under two names.
CASES = {"tied-optim_grads_params": (True, "optim_grads_params"), "untied-optim_grads": (False, "optim_grads")}


def _probe_batch() -> torch.Tensor:
    return hf_llama.global_batch(hf_llama.corpus_tokens(), STEPS, 2, SEQ)


def _sharded(rank: int, world: int, out_dir: str) -> dict:
    torch.use_deterministic_algorithms(True)
    results = {}
    for name, (tie, strategy) in CASES.items():
        config = hf_llama.tiny_llama_config(tie_word_embeddings=tie)
        model, optimizer = hf_llama.apply_fsdp(hf_llama.build_model(config), strategy, LR)
        losses = hf_llama.train(model, optimizer, hf_llama.corpus_tokens(), STEPS, ROWS, SEQ, torch.device("cpu"))
        export_dir = os.path.join(out_dir, name)
        hf_llama.export_pretrained(model, export_dir)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=_probe_batch()).logits
        reloaded, _ = hf_llama.pretrained_model(export_dir, strategy, LR)
        results[name] = {
            "losses": losses, "params": model.full_parameters(), "logits": logits, "dir": export_dir,
            "reloaded": reloaded.full_parameters(),
        }
    return results


def _reference(tie: bool) -> dict:
    """The unsharded model on the whole global batch of every step, with the same AdamW."""
    torch.use_deterministic_algorithms(True)
    model = hf_llama.build_model(hf_llama.tiny_llama_config(tie_word_embeddings=tie))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tokens = hf_llama.corpus_tokens()
    losses = []
    for step in range(STEPS):
        batch = hf_llama.global_batch(tokens, step, ROWS * WORLD, SEQ)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict:
    return run_distributed(_sharded, WORLD, str(tmp_path_factory.mktemp("hf_llama")))[0]


# fp32 throughout. The sharded run sums each rank's gradient and halves it where the reference
# differentiates one batch twice the size: the same values rounded in another order, a few unit
# roundoffs (6e-8) per operation. Losses then agree to ~1e-7 relative over 5 AdamW steps
# (measured); 1e-5 leaves room for other CPUs' kernels, while a sharding bug (a gradient lost,
# doubled or applied to the wrong parameter) moves the loss by more than 1e-3 within a step.
LOSS_RTOL = 1e-5
# Parameters: AdamW moves every element by about lr per step whatever its gradient's size, so
# rounding noise in a nearly-zero gradient can change that element's update (measured up to
# 2.5e-5 = lr / 120), while a wrong or missing update is off by a whole lr. lr / 10 tells them apart.
PARAM_ATOL = LR / 10


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_llama_trains_like_the_unsharded_model(sharded, name: str) -> None:
    got, expected = sharded[name], _reference(CASES[name][0])
    for step, (a, b) in enumerate(zip(got["losses"], expected["losses"])):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"{name}: loss at step {step}: sharded {a} vs unsharded {b}"
    assert expected["losses"][-1] < expected["losses"][0] - 0.1, "the model should learn something in 5 steps"
    for param_name, value in expected["params"].items():
        err = (got["params"][param_name] - value).abs().max().item()
        assert err <= PARAM_ATOL, f"{name}: {param_name}: max error {err:.2e} > {PARAM_ATOL:.1e}"


@pytest.mark.parametrize("name", list(CASES))
def test_safetensors_export_loads_with_from_pretrained(sharded, name: str) -> None:
    got = sharded[name]
    loaded = LlamaForCausalLM.from_pretrained(got["dir"]).eval()
    # Transformers 5's from_pretrained defaults to dtype="auto": the exported weights' dtype.
    assert loaded.dtype == torch.float32, f"{name}: loaded as {loaded.dtype}, exported as float32"
    assert loaded.config.tie_word_embeddings == CASES[name][0]
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == CASES[name][0]
    loaded_params = dict(loaded.named_parameters())
    assert loaded_params.keys() == got["params"].keys()
    for param_name, value in got["params"].items():
        assert torch.equal(loaded_params[param_name].detach(), value), f"{name}: {param_name} differs after the round trip"
    with torch.no_grad():
        logits = loaded(input_ids=_probe_batch()).logits
    # Same weights, same input, same kernels on one process: the logits agree to the bit.
    assert torch.equal(logits, got["logits"]), f"{name}: max logit difference {(logits - got['logits']).abs().max():.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_the_saved_directory_loads_back_into_a_model_built_on_the_meta_device(sharded, name: str) -> None:
    got = sharded[name]
    assert got["reloaded"].keys() == got["params"].keys()
    for param_name, value in got["params"].items():
        assert torch.equal(got["reloaded"][param_name], value), f"{name}: {param_name} differs after save and load_pretrained"
