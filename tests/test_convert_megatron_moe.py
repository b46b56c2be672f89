"""Offline conversion of real Megatron-LM MoE checkpoints, through the converter's command line:
tests/data/megatron_lm/moe holds the fixtures' tiny Llama-style GPT with four SequentialMLP
experts per layer, top-2 routing (``--num-experts 4 --moe-router-topk 2``), trained 4 iterations
by Megatron-LM on an H200 and saved once by megatron-core's DDP as ``torch_dist`` (experts stacked
``[layers, experts, ...]``) and once through our door as ``fsdp_dtensor`` (``local_experts.E``),
same weights bit for bit, with Megatron-LM's own logits on fixed tokens (make_fixtures.py and
README.md there say how)."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("transformers")

from megatron_lm_entries import logits_error  # noqa: E402
from megatron_lm_pp_save import raw_item  # noqa: E402
from safetensors_dir import read_safetensors_dir  # noqa: E402
from transformers import MixtralForCausalLM  # noqa: E402

from megatron_fsdp.convert import ConversionError, convert  # noqa: E402
from megatron_fsdp.convert.__main__ import main  # noqa: E402
from megatron_fsdp.convert.gpt_dims import dims_from_megatron_args  # noqa: E402
from megatron_fsdp.convert.sources import open_source  # noqa: E402

MOE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "megatron_lm", "moe")
FSDP_DTENSOR, TORCH_DIST = os.path.join(MOE, "fsdp_dtensor"), os.path.join(MOE, "torch_dist")
# fp32 on both sides; cuBLAS on the H200 and the CPU's kernels sum in other orders: measured max
# |difference| 2.1e-7 on logits of size ~0.7 (a few ulps), as the dense fixture's 2.7e-7. Routing
# cannot flip on that noise: the smallest gap between a token's 2nd and 3rd router logits is
# 2.0e-3 (layer 0) and 4.6e-3 (layer 1), measured, against router-logit differences of ~1e-7. A
# flipped expert, gate and up swapped or an unrenormalized router moves logits by > 1e-2.
LOGITS_ATOL = 5e-6


def _convert(source: str, output: str, to: str, *options: str) -> None:
    assert main([source, output, "--to", to, *options]) == 0


def _model_tensors(path: str) -> dict[str, torch.Tensor]:
    source = open_source(path)
    return {name: source.read(name) for name in source.tensors if not name.startswith("optimizer.")}


def _assert_equal_tensors(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(got)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), f"{name} differs"


@pytest.mark.parametrize("checkpoint", [FSDP_DTENSOR, TORCH_DIST], ids=["fsdp_dtensor", "torch_dist"])
def test_megatron_lm_moe_checkpoint_converts_to_mixtral_with_megatrons_logits(checkpoint: str, tmp_path) -> None:
    output = str(tmp_path / "hf")
    _convert(checkpoint, output, "huggingface")  # the config from the args Megatron-LM stored
    with open(os.path.join(output, "config.json")) as handle:
        config = json.load(handle)
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == ("mixtral", 4, 2, 128)
    error = logits_error(MixtralForCausalLM, output, os.path.join(MOE, "megatron_logits.pt"))
    assert error <= LOGITS_ATOL, f"Mixtral's logits differ from Megatron-LM's by {error:.2e}"


@pytest.mark.parametrize("direction", ["fsdp_dtensor_to_torch_dist", "torch_dist_to_fsdp_dtensor"])
def test_moe_checkpoints_convert_into_each_others_files(direction: str, tmp_path) -> None:
    """Each converts into the other's own tensors exactly (experts stacked [layers, experts, ...]
    or as local_experts.E, fc1 whole or as halves, the pre-MLP norm under the local spec's torch_dist
    name), with the experts' extra-state items megatron-core's loader asks for."""
    source, target, to = (FSDP_DTENSOR, TORCH_DIST, "torch_dist") if direction.startswith("fsdp") else (TORCH_DIST, FSDP_DTENSOR, "fsdp_dtensor")
    output = str(tmp_path / "out")
    _convert(source, output, to)
    _assert_equal_tensors(_model_tensors(target), _model_tensors(output))
    real, converted = open_source(target), open_source(output)
    extra_states = sorted(name for name in real.objects if "_extra_state" in name)
    assert extra_states == sorted(name for name in converted.objects if "_extra_state" in name)
    assert all(converted.read_item(name) == real.read_item(name) for name in extra_states)
    assert converted.read_object("iteration") == 4


def test_mixtral_to_fsdp_dtensor_and_back_is_byte_identical(tmp_path) -> None:
    """Megatron-LM's fsdp_dtensor -> Mixtral -> fsdp_dtensor (the local spec, as that run used)
    gives Megatron-LM's own tensors, and -> torch_dist its DDP's (the args written say the local
    spec, so the norms get that spec's torch_dist names); -> Mixtral again gives the same files,
    byte for byte."""
    hf, megatron, again = str(tmp_path / "hf"), str(tmp_path / "megatron"), str(tmp_path / "again")
    _convert(FSDP_DTENSOR, hf, "huggingface")
    _convert(hf, megatron, "fsdp_dtensor", "--spec", "local")
    _assert_equal_tensors(_model_tensors(FSDP_DTENSOR), _model_tensors(megatron))
    _convert(megatron, str(tmp_path / "torch_dist"), "torch_dist")
    _assert_equal_tensors(_model_tensors(TORCH_DIST), _model_tensors(str(tmp_path / "torch_dist")))
    _convert(megatron, again, "huggingface")
    first, second = read_safetensors_dir(hf), read_safetensors_dir(again)
    _assert_equal_tensors(first, second)
    for name in sorted(os.listdir(hf)):
        with open(os.path.join(hf, name), "rb") as one, open(os.path.join(again, name), "rb") as other:
            assert one.read() == other.read(), f"{name} differs after Mixtral -> fsdp_dtensor -> Mixtral"


@pytest.mark.parametrize(
    "setting",
    [("moe_router_pre_softmax", True), ("moe_router_score_function", "sigmoid"), ("moe_shared_expert_intermediate_size", 64), ("moe_layer_freq", [1, 0])],
)
def test_moe_routing_mixtral_cannot_express_is_refused_naming_the_argument(setting: tuple[str, object]) -> None:
    """Pre-softmax routing leaves the top-k probabilities unrenormalized, sigmoid scores are not
    Mixtral's softmax, a shared expert or dense layers have no Mixtral twin: refused by name."""
    args = argparse.Namespace(**vars(open_source(FSDP_DTENSOR).read_object("args")))
    assert dims_from_megatron_args(args, 128).experts == 4
    setattr(args, *setting)
    with pytest.raises(ConversionError, match=rf"{setting[0]}=.*cannot express"):
        dims_from_megatron_args(args, 128)


def test_moe_optimizer_state_in_flat_ddp_buffers_is_refused_with_the_fix(tmp_path) -> None:
    """megatron-core DDP's default optimizer state (``dp_reshardable`` flat buckets, as the real
    MoE run saved it: one bucket of every parameter's fp32 main weight) is placed per parameter
    only for dense GPTs; for an MoE model it is refused naming both ways out, nothing written."""
    iteration = os.path.join(TORCH_DIST, "iter_0000004")
    source = open_source(iteration)
    state: dict = {name: source.read(name) for name in source.tensors}
    state.update({name: raw_item(iteration, name) for name in source.objects})
    state["optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.param"] = torch.zeros(238400)
    checkpoint = str(tmp_path / "ddp")
    dcp.save(state, checkpoint_id=checkpoint, no_dist=True)
    shutil.copy(os.path.join(iteration, "metadata.json"), checkpoint)
    with pytest.raises(ConversionError, match=r"MoE model whose optimizer state is in megatron-core's flat DDP buffers.*--dist-ckpt-optim-fully-reshardable.*--no-optimizer"):
        convert(checkpoint, str(tmp_path / "out"), "fsdp_dtensor")
    assert not os.path.exists(tmp_path / "out")
