"""Offline conversion of Megatron-LM GPT checkpoints (``megatron_fsdp.convert``), against real
ones: tests/data/megatron_lm holds a 2-layer Llama-style GPT (GQA 4 heads / 2 groups, SwiGLU,
RMSNorm, RoPE, untied) trained 4 iterations by Megatron-LM on an H200, saved once by
megatron-core's DDP as ``torch_dist`` and once through our door as ``fsdp_dtensor`` (same
weights, bit for bit), with Megatron-LM's own logits on fixed tokens (make_fixtures.py and
README.md there say how). Plus tiny Mixtral-style MoE and TP-fused layouts built from
megatron-core's documented layouts."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("transformers")

from megatron_lm_entries import logits_error, sharded_object  # noqa: E402
from safetensors_dir import read_safetensors_dir  # noqa: E402
from transformers import LlamaForCausalLM, MixtralConfig, MixtralForCausalLM  # noqa: E402

from megatron_fsdp.convert import ConversionError, convert  # noqa: E402
from megatron_fsdp.convert.inert_pickle import Opaque  # noqa: E402
from megatron_fsdp.convert.sources import open_source  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "megatron_lm")
FSDP_DTENSOR, TORCH_DIST = os.path.join(DATA, "fsdp_dtensor"), os.path.join(DATA, "torch_dist")
# fp32 on both sides, but cuBLAS on the H200 and the CPU's kernels sum in other orders: measured
# max |difference| 2.7e-7 on logits of size ~0.6 (a few ulps). 5e-6 leaves room for other CPUs;
# a mapping mistake (gate and up swapped, heads of another query group) moves logits by > 1e-2.
LOGITS_ATOL = 5e-6


def _fixture_args() -> argparse.Namespace:
    """The fixture's Megatron-LM args without the megatron-core objects among them (a test's own
    ``dcp.save`` pickles them with plain pickle, which cannot name their classes)."""
    args = open_source(FSDP_DTENSOR).read_object("args")
    return argparse.Namespace(**{key: value for key, value in vars(args).items() if not isinstance(value, Opaque)})


def _model_tensors(path: str, prefix: str = "") -> dict[str, torch.Tensor]:
    source = open_source(path)
    return {name: source.read(name) for name in source.tensors if name.startswith(prefix) and not name.startswith("optimizer.")}


@pytest.mark.parametrize("checkpoint", [FSDP_DTENSOR, TORCH_DIST], ids=["fsdp_dtensor", "torch_dist"])
def test_megatron_lm_checkpoint_converts_to_hf_with_megatrons_logits(checkpoint: str, tmp_path) -> None:
    output = str(tmp_path / "hf")
    convert(checkpoint, output, "huggingface")  # the config comes from the args Megatron-LM stored
    with open(os.path.join(output, "config.json")) as handle:
        config = json.load(handle)
    assert (config["model_type"], config["num_key_value_heads"], config["intermediate_size"], config["tie_word_embeddings"]) == ("llama", 2, 128, False)
    error = logits_error(LlamaForCausalLM, output, os.path.join(DATA, "megatron_logits.pt"))
    assert error <= LOGITS_ATOL, f"Hugging Face logits differ from Megatron-LM's by {error:.2e}"


def test_hf_to_fsdp_dtensor_gives_megatron_lms_own_names_and_tensors(tmp_path) -> None:
    """Hugging Face -> fsdp_dtensor (the local spec's names, as that run used) writes exactly the
    tensors, under exactly the names, Megatron-LM saved."""
    hf, back = str(tmp_path / "hf"), str(tmp_path / "megatron")
    convert(FSDP_DTENSOR, hf, "huggingface")
    convert(hf, back, "fsdp_dtensor", spec="local")
    original, converted = _model_tensors(FSDP_DTENSOR, "model."), _model_tensors(back, "model.")
    assert original.keys() == converted.keys()
    for name, value in original.items():
        assert torch.equal(converted[name], value), f"{name} differs after Megatron-LM -> HF -> Megatron-LM"
    assert open_source(back).read_object("args").num_query_groups == 2


@pytest.mark.parametrize("direction", ["fsdp_dtensor_to_torch_dist", "torch_dist_to_fsdp_dtensor"])
def test_megatron_formats_convert_into_each_others_files(direction: str, tmp_path) -> None:
    """Both checkpoints hold the same weights, so each converts into the other's tensors exactly
    (layers stacked or not, norms renamed, fc1 halves joined or split)."""
    source, target, to = (FSDP_DTENSOR, TORCH_DIST, "torch_dist") if direction.startswith("fsdp") else (TORCH_DIST, FSDP_DTENSOR, "fsdp_dtensor")
    output = str(tmp_path / "out")
    convert(source, output, to, optimizer=False)
    expected, got = _model_tensors(target), _model_tensors(output)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name} differs"
    converted = open_source(output)
    assert converted.read_object("iteration") == 4
    assert converted.read_object("opt_param_scheduler") == open_source(source).read_object("opt_param_scheduler")
    assert os.path.basename(converted.path) == "iter_0000004"



def test_fsdp_dtensor_written_where_a_gpu_is_present_reads_back(monkeypatch, tmp_path) -> None:
    """With a GPU present, DCP's FileSystemWriter loads tensors through its overlapping loader
    (sorted by size, resolved ahead of saving) unless per_thread_copy_ahead is 0; the converter's
    streaming planner drops a step's tensors when the next step starts, so that loader saved empty
    storages that torch.load cannot rebuild. Here DCP takes that code path on the CPU: it tests
    torch.cuda.is_available() and synchronizes the current stream of the device type it finds,
    which for CPU tensors is nothing to wait for."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dcp_filesystem, "_get_available_device_type", lambda: "cpu")
    monkeypatch.setattr(torch.cpu.Stream, "synchronize", lambda self: None, raising=False)
    output = str(tmp_path / "out")
    convert(TORCH_DIST, output, "fsdp_dtensor", optimizer=False)
    expected, got = _model_tensors(FSDP_DTENSOR), _model_tensors(output)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name} differs"

# The two param groups megatron-core's default gives a GPT (as its DDP run of the fixture's model
# saved them at iteration 3): weight decay, and none for the 1-D norms.
PARAM_GROUPS = [
    {
        "is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": False,
        "max_lr": 3e-4, "min_lr": 3e-5, "lr": 0.0002604594154601839, "betas": (0.9, 0.999), "eps": 1e-8,
        "weight_decay": 0.1 * wd_mult, "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
        "differentiable": False, "fused": None, "decoupled_weight_decay": True,
    }
    for wd_mult in (1.0, 0.0)
]


def _with_optimizer_state(directory: str) -> dict[str, torch.Tensor]:
    """The fsdp_dtensor fixture plus Adam state under the names Megatron-LM writes for it
    (``optimizer.state.module.module.<fqn>.exp_avg``), and its args; returns every tensor."""
    source = open_source(FSDP_DTENSOR)
    generator = torch.Generator().manual_seed(0)
    state: dict = {"args": _fixture_args(), "iteration": 4}
    for name in source.tensors:
        if name.startswith("model.module."):
            fqn = name[len("model.module.") :]
            state[name] = source.read(name)
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"optimizer.state.module.module.{fqn}.{key}"] = torch.randn(source.tensors[name].shape, generator=generator)
            state[f"optimizer.state.module.module.{fqn}.step"] = torch.tensor(4.0)
            group = PARAM_GROUPS[len(source.tensors[name].shape) == 1]
            state.update({f"optimizer.param_to_group_meta.module.module.{fqn.removesuffix('_w').removesuffix('_v')}.{key}": value for key, value in group.items()})
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


def test_optimizer_state_goes_fsdp_dtensor_to_torch_dist_and_back(tmp_path) -> None:
    source = str(tmp_path / "fsdp")
    saved = _with_optimizer_state(source)
    torch_dist, back = str(tmp_path / "torch_dist"), str(tmp_path / "back")
    convert(source, torch_dist, "torch_dist")
    stacked = open_source(torch_dist)
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    for key in ("exp_avg", "exp_avg_sq"):
        # torch_dist keeps fc1 whole, [gate; up], layers stacked on a leading dimension.
        whole = torch.cat([saved[f"optimizer.state.module.module.{fc1}_{half}.{key}"] for half in "wv"])
        assert torch.equal(stacked.read(f"optimizer.state.{key}.decoder.layers.mlp.linear_fc1.weight", (1,)), whole)
    assert torch.equal(stacked.read("optimizer.state.fp32_param.output_layer.weight"), saved["model.module.output_layer.weight"])
    convert(torch_dist, back, "fsdp_dtensor")
    returned = open_source(back)
    assert set(returned.tensors) == set(saved)
    for name, value in saved.items():
        assert torch.equal(returned.read(name), value), f"{name} differs after fsdp_dtensor -> torch_dist -> fsdp_dtensor"


def test_fc1_saved_whole_at_tp2_splits_into_the_tp_local_gate_and_up(tmp_path) -> None:
    """An fsdp_dtensor face that keeps fc1 whole at TP 2 stores the TP-local [gate_r; up_r] blocks
    one after the other; converted, gate and up are those of the same model saved as halves."""
    source = open_source(FSDP_DTENSOR)
    args = _fixture_args()
    args.tensor_model_parallel_size = 2
    state: dict = {"args": args}
    for name in source.tensors:
        if not name.startswith("model."):
            continue
        if name.endswith("linear_fc1.weight_v"):
            continue
        if name.endswith("linear_fc1.weight_w"):
            gate, up = source.read(name), source.read(name[:-1] + "v")
            state[name[:-2]] = torch.cat([gate[:64], up[:64], gate[64:], up[64:]])  # rank 0's halves, then rank 1's
        else:
            state[name] = source.read(name)
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves_hf")
    dcp.save(state, checkpoint_id=whole, no_dist=True)
    convert(whole, str(tmp_path / "whole_hf"), "huggingface")
    convert(FSDP_DTENSOR, halves, "huggingface")
    expected, got = read_safetensors_dir(halves), read_safetensors_dir(str(tmp_path / "whole_hf"))
    assert expected.keys() == got.keys() and all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> tuple[str, MixtralForCausalLM]:
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(config).eval()
    path = str(tmp_path_factory.mktemp("mixtral") / "hf")
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("experts", ["sequential", "grouped"])
def test_mixtral_experts_map_to_megatron_cores_moe_layers_and_back(mixtral, experts: str, tmp_path) -> None:
    path, model = mixtral
    megatron, back = str(tmp_path / "megatron"), str(tmp_path / "back")
    convert(path, megatron, "fsdp_dtensor", experts=experts, fc1="fused")
    original, converted = read_safetensors_dir(path), open_source(megatron)
    layer = "model.module.decoder.layers.1.mlp."
    fc1 = f"{layer}experts.local_experts.2.linear_fc1.weight" if experts == "sequential" else f"{layer}experts.linear_fc1.weight2"
    moe = "model.layers.1.block_sparse_moe."
    # megatron-core's SwiGLU fc1 is [gate; up]: Mixtral's w1 (gate) then w3 (up).
    assert torch.equal(converted.read(fc1), torch.cat([original[f"{moe}experts.2.w1.weight"], original[f"{moe}experts.2.w3.weight"]]))
    assert torch.equal(converted.read(f"{layer}router.weight"), original[f"{moe}gate.weight"])
    convert(megatron, back, "huggingface", config=path)
    again = read_safetensors_dir(back)
    assert again.keys() == original.keys() and all(torch.equal(again[name], original[name]) for name in original)
    loaded = MixtralForCausalLM.from_pretrained(back).eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)


def test_mixtral_experts_stack_in_torch_dist(mixtral, tmp_path) -> None:
    path, _ = mixtral
    megatron, torch_dist = str(tmp_path / "megatron"), str(tmp_path / "torch_dist")
    convert(path, megatron, "fsdp_dtensor")
    args_source = open_source(megatron)
    assert args_source.read_object("args").num_experts == 4
    convert(megatron, torch_dist, "torch_dist")
    stacked = open_source(torch_dist)
    assert stacked.tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"].shape == (2, 4, 32, 48)
    original = read_safetensors_dir(path)
    assert torch.equal(stacked.read("decoder.layers.mlp.experts.experts.linear_fc2.weight", (1, 3)), original["model.layers.1.block_sparse_moe.experts.3.w2.weight"])


def test_megatron_bad_input_names_the_tensor_and_the_fix(tmp_path) -> None:
    source = open_source(FSDP_DTENSOR)
    state = {name: source.read(name) for name in source.tensors if name.startswith("model.")}
    args = _fixture_args()

    def save(name: str, tensors: dict) -> str:
        path = str(tmp_path / name)
        dcp.save({**tensors, "args": args}, checkpoint_id=path, no_dist=True)
        return path

    unknown = save("unknown", {**state, "model.module.decoder.layers.0.self_attention.q_layernorm.weight": torch.ones(16)})
    with pytest.raises(ConversionError, match=r"does not know 1 tensor\(s\) of the checkpoint: model\.module\.decoder\.layers\.0\.self_attention\.q_layernorm\.weight"):
        convert(unknown, str(tmp_path / "out"), "huggingface")
    missing = save("missing", {k: v for k, v in state.items() if "layers.1.mlp.linear_fc2" not in k})
    with pytest.raises(ConversionError, match=r"lacks 1 tensor\(s\).*decoder\.layers\.1\.mlp\.linear_fc2\.weight"):
        convert(missing, str(tmp_path / "out"), "huggingface")
    config = str(tmp_path / "config.json")
    shutil.copy(os.path.join(_hf_of_fixture(tmp_path), "config.json"), config)
    with open(config) as handle:
        values = json.load(handle)
    values["intermediate_size"] = 96
    with open(config, "w") as handle:
        json.dump(values, handle)
    with pytest.raises(ConversionError, match=r"model\.module\.decoder\.layers\.0\.mlp\.linear_fc1\.weight_w has shape \[128, 64\], but"):
        convert(FSDP_DTENSOR, str(tmp_path / "out"), "huggingface", config=config)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.partial")


def _hf_of_fixture(tmp_path) -> str:
    path = str(tmp_path / "fixture_hf")
    convert(FSDP_DTENSOR, path, "huggingface")
    return path


def _dp_reshardable(directory: str, order: list[str]) -> dict[str, torch.Tensor]:
    """The torch_dist fixture plus megatron-core's default optimizer state: one flat bucket each
    of fp32 main weights and Adam state, parameters in ``order`` reversed, each starting on a
    multiple of 64 (the layout megatron-core's own DDP checkpoint of this model has, compared
    element by element on the full artifact); returns each parameter's exp_avg."""
    source = open_source(TORCH_DIST)
    state = {name: source.read(name) for name in source.tensors}
    te_names = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight", "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    weights, offset, offsets = {}, 0, {}
    for name in reversed(order):
        if name.startswith("decoder.layers."):
            layer, rest = int(name.split(".")[2]), name.split(".", 3)[3]
            weights[name] = state["decoder.layers." + te_names.get(rest, rest)][layer]
        else:
            weights[name] = state[name]
        offset = -(-offset // 64) * 64
        offsets[name] = offset
        offset += weights[name].numel()
    generator = torch.Generator().manual_seed(0)
    buckets = {key: torch.zeros(offset) for key in ("param", "exp_avg", "exp_avg_sq")}
    exp_avgs = {}
    for name, weight in weights.items():
        piece = slice(offsets[name], offsets[name] + weight.numel())
        buckets["param"][piece] = weight.reshape(-1)
        exp_avgs[name] = torch.randn(weight.shape, generator=generator)
        buckets["exp_avg"][piece] = exp_avgs[name].reshape(-1)
        buckets["exp_avg_sq"][piece] = exp_avgs[name].reshape(-1).square()
    prefix = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0."
    state.update({prefix + key: value for key, value in buckets.items()})
    # ShardedObjects, as megatron-core hands them to DCP: torch.save of a list, as bytes.
    common = {"args": _fixture_args(), "iteration": 4, "content_metadata": source.read_object("content_metadata")}
    state["common_state/shard_0_1"] = sharded_object([common])
    state["optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"] = sharded_object([{"param_groups": [{**group, "step": 4.0} for group in PARAM_GROUPS]}])
    state["optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded/shard_0_1"] = sharded_object([[{(torch.float32, torch.float32): [offset]}]])
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    shutil.copy(os.path.join(source.path, "metadata.json"), directory)
    return exp_avgs


MODULE_ORDER = ["embedding.word_embeddings.weight"] + [
    f"decoder.layers.{layer}.{name}"
    for layer in range(2)
    for name in ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
] + ["decoder.final_layernorm.weight", "output_layer.weight"]


def test_megatron_cores_default_ddp_optimizer_state_converts_to_fsdp_dtensor(tmp_path) -> None:
    """dp_reshardable flat buckets are placed per parameter: each parameter's Adam state lands
    under its fsdp_dtensor name, fc1's split into the _w / _v halves."""
    source, output = str(tmp_path / "ddp"), str(tmp_path / "fsdp")
    exp_avgs = _dp_reshardable(source, MODULE_ORDER)
    convert(source, output, "fsdp_dtensor")
    converted = open_source(output)
    prefix = "optimizer.state.module.module."
    for name, exp_avg in exp_avgs.items():
        if name.endswith("linear_fc1.weight"):
            assert torch.equal(converted.read(f"{prefix}{name}_w.exp_avg"), exp_avg[:128])
            assert torch.equal(converted.read(f"{prefix}{name}_v.exp_avg_sq"), exp_avg[128:].square())
        else:
            assert torch.equal(converted.read(f"{prefix}{name}.exp_avg"), exp_avg), name
    for name, value in _model_tensors(FSDP_DTENSOR, "model.").items():
        assert torch.equal(converted.read(name), value), f"{name}: the weights are the main weights, which are the model's"


def test_flat_buckets_laid_out_otherwise_fail_naming_the_parameter(tmp_path) -> None:
    """Buckets in another order: the main weights found for a parameter are not its weights, and
    the conversion stops naming it, with nothing written."""
    swapped = list(MODULE_ORDER)
    swapped[1], swapped[2] = swapped[2], swapped[1]
    source = str(tmp_path / "ddp")
    _dp_reshardable(source, swapped)
    with pytest.raises(ConversionError, match=r"the optimizer's main weights for decoder\.layers\..* are not"):
        convert(source, str(tmp_path / "fsdp"), "fsdp_dtensor")
    assert not os.path.exists(tmp_path / "fsdp")


def test_step_chooses_which_saved_iteration_is_converted(tmp_path) -> None:
    """``--step 4`` converts the save directory's iter_0000004 although ``latest`` names another,
    and the output is iteration 4."""
    save = tmp_path / "save"
    shutil.copytree(os.path.join(TORCH_DIST, "iter_0000004"), save / "iter_0000004")
    (save / "iter_0000009").mkdir()  # the latest: not a checkpoint, so converting it would fail
    (save / "latest_checkpointed_iteration.txt").write_text("9")
    convert(str(save), str(tmp_path / "out"), "fsdp_dtensor", step=4)
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert open_source(str(tmp_path / "out")).read_object("iteration") == 4
    with pytest.raises(ConversionError, match=r"no checkpoint of step 5 \(it holds \['iter_0000004', 'iter_0000009'\]\)"):
        convert(str(save), str(tmp_path / "out5"), "fsdp_dtensor", step=5)


def test_param_groups_and_step_reach_the_form_each_loader_reads(tmp_path) -> None:
    """fsdp_dtensor's per-parameter group settings and step become the distributed optimizer's
    param groups (with ``step``) in torch_dist's common state, and come back per parameter."""
    source, torch_dist, back = str(tmp_path / "fsdp"), str(tmp_path / "torch_dist"), str(tmp_path / "back")
    _with_optimizer_state(source)
    convert(source, torch_dist, "torch_dist")
    optimizer = open_source(torch_dist).read_object("optimizer")
    assert optimizer == {"optimizer": {"param_groups": [{**group, "step": 4.0} for group in PARAM_GROUPS]}, "param_state_sharding_type": "fully_reshardable"}
    convert(torch_dist, back, "fsdp_dtensor")
    original, returned = open_source(source), open_source(back)
    metas = [name for name in original.objects if name.startswith("optimizer.param_to_group_meta.")]
    assert metas and sorted(metas) == sorted(name for name in returned.objects if name.startswith("optimizer.param_to_group_meta."))
    for name in metas:
        assert returned.read_item(name) == original.read_item(name), name


# A real pair of runs (tests/gpu/megatron_lm_convert_resume.sh makes one): <run>/ddp and <run>/ours,
# megatron-core's DDP and ours, same model, data and seed, both saved at iteration 3.
REAL_RUN = os.environ.get("MEGATRON_LM_RUN")


@pytest.mark.skipif(not REAL_RUN, reason="set MEGATRON_LM_RUN to a directory holding real ddp/ and ours/ Megatron-LM saves")
def test_real_checkpoints_convert_into_the_other_packages_own(tmp_path) -> None:
    """ours/iter_3 converted to torch_dist holds ddp/iter_3's entries, and ddp/iter_3 converted to
    fsdp_dtensor holds ours/iter_3's: same names, shapes, dtypes and values (the two runs print the
    same losses, so their weights, Adam state and RNG state are the same bit for bit). Left out:
    each package's own args; torch_dist's optimizer state is compared per parameter, as it is
    written model-space (``fully_reshardable``) and megatron-core's DDP writes flat buckets."""
    from megatron_lm_entries import entries, torch_dist_optimizer_state

    ddp, ours = os.path.join(REAL_RUN, "ddp"), os.path.join(REAL_RUN, "ours")
    convert(ddp, str(tmp_path / "fsdp_dtensor"), "fsdp_dtensor", step=3)
    real, converted = entries(os.path.join(ours, "iter_0000003")), entries(str(tmp_path / "fsdp_dtensor" / "iter_0000003"))
    _assert_same_entries(real, converted, left_out=("args",))
    convert(ours, str(tmp_path / "torch_dist"), "torch_dist", step=3)
    real_path, converted_path = os.path.join(ddp, "iter_0000003"), str(tmp_path / "torch_dist" / "iter_0000003")
    real, converted = entries(real_path), entries(converted_path)
    groups = real.pop("optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1")[0]
    assert converted.pop("common.optimizer")["optimizer"] == groups
    assert converted.pop("common.content_metadata") == {**real.pop("common.content_metadata"), "distrib_optim_sharding_type": "fully_reshardable"}
    for name in ("common.optimizer", "common.rerun_state_machine", "rerun_state_machine_state/shard_0_1"):
        real.pop(name)  # megatron-core resets what it does not find (fsdp_dtensor saves no rerun state)
    converted = {name: value for name, value in converted.items() if not name.startswith("optimizer.state.")}
    _assert_same_entries(real, converted, left_out=("common.args",))
    real_state, converted_state = torch_dist_optimizer_state(real_path), torch_dist_optimizer_state(converted_path)
    assert sorted(real_state) == sorted(converted_state) and len(real_state) == 3 * 15
    for key, value in real_state.items():
        assert torch.equal(converted_state[key], value), key


def _assert_same_entries(real: dict, converted: dict, left_out: tuple[str, ...]) -> None:
    names = sorted(name for name in real if not name.startswith(left_out))
    assert names == sorted(name for name in converted if not name.startswith(left_out))
    for name in names:
        expected, found = real[name], converted[name]
        if isinstance(expected, torch.Tensor):
            assert found.dtype == expected.dtype and found.shape == expected.shape and torch.equal(found, expected), name
        else:
            assert found == expected, name


RUN_STATE = os.path.join(DATA, "run_state")


def test_real_run_state_is_carried_into_the_other_packages_form() -> None:
    """The run state of a real pair of runs at iteration 3 (make_fixtures.py --run-state): ours'
    param groups and Adam step become exactly the groups megatron-core's DDP saved, its RNG state
    exactly DDP's; and DDP's groups, step and RNG state become exactly ours' per-parameter items."""
    from megatron_lm_entries import plain

    from megatron_fsdp.convert import megatron_run_state as carried
    from megatron_fsdp.convert.plan import Plan
    from megatron_fsdp.convert.sources import TensorInfo

    ours, ddp = open_source(os.path.join(RUN_STATE, "ours", "iter_0000003")), open_source(os.path.join(RUN_STATE, "ddp", "iter_0000003"))
    prefix = "optimizer.state.module.module."
    to_torch_dist, plan = carried.read_fsdp_dtensor_state(ours, prefix), Plan()
    assert carried.torch_dist_optimizer_common(to_torch_dist)["optimizer"] == ddp.read_item("optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1")[0]
    carried.add_torch_dist_rng(plan, to_torch_dist)
    assert list(plan.objects) == ["rng_state/shard_0.0_1.1"]
    assert plain(plan.objects["rng_state/shard_0.0_1.1"]) == plain(ddp.read_item("rng_state/shard_0.0_1.1"))

    to_fsdp_dtensor, plan = carried.read_torch_dist_state(ddp, "dp_reshardable"), Plan()
    shapes = open_source(FSDP_DTENSOR).tensors  # the same model's weights: which are 1-D
    steps = [name for name in ours.tensors if name.endswith(".step")]
    for name in steps:
        plan.targets[name.removesuffix(".step") + ".exp_avg"] = shapes["model.module." + name[len(prefix) : -len(".step")]]
    carried.add_fsdp_dtensor_optimizer_state(plan, to_fsdp_dtensor, prefix)
    carried.add_fsdp_dtensor_rng(plan, to_fsdp_dtensor)
    metas = [name for name in ours.objects if name.startswith("optimizer.param_to_group_meta.")]
    assert len(metas) == 3 * 18
    for name in metas:
        assert plan.objects[name] == ours.read_item(name), name
    written = {write.name: step.build([])[0] for step in plan.steps for write in step.writes}
    for name in [*steps, *(name for name in ours.tensors if name.startswith("rng_state."))]:
        assert written[name].dtype == ours.tensors[name].dtype and torch.equal(written[name], ours.read(name)), name
    for name in (name for name in ours.objects if name.startswith("rng_state.")):
        assert plain(plan.objects[name]) == plain(ours.read_item(name)), name
    assert len(written) == len(steps) + sum(name.startswith("rng_state.") for name in ours.tensors)
