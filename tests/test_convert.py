"""Offline conversion between our DCP checkpoints and Hugging Face directories
(``megatron_fsdp.convert``): a tiny Llama trained through our door and saved at world 2 converts
to a directory ``LlamaForCausalLM.from_pretrained`` loads into the sharded model's logits; HF ->
ours -> HF gives back every tensor byte for byte and ours loads into a sharded model; two ranks
split the work and write what one rank writes; bad input fails naming the tensor or file, with
nothing written."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import convert_cost  # noqa: E402
import hf_llama  # noqa: E402
from _dist import run_distributed  # noqa: E402
from safetensors_dir import read_safetensors_dir  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import megatron_fsdp  # noqa: E402
from megatron_fsdp.convert import ConversionError, convert  # noqa: E402

STEPS, ROWS, SEQ, LR, WORLD = 3, 2, 32, 3e-3, 2


def _probe_batch() -> torch.Tensor:
    return hf_llama.global_batch(hf_llama.corpus_tokens(), 100, 2, SEQ)


def _train_and_save(rank: int, world: int, out: str) -> dict:
    """A tied Llama (the head saved under both names) trained 3 steps at world 2 and saved with
    save_checkpoint; its logits on a probe batch."""
    config = hf_llama.tiny_llama_config(tie_word_embeddings=True)
    model, optimizer = hf_llama.apply_fsdp(hf_llama.build_model(config), "optim_grads_params", LR)
    hf_llama.train(model, optimizer, hf_llama.corpus_tokens(), STEPS, ROWS, SEQ, torch.device("cpu"))
    megatron_fsdp.save_checkpoint(os.path.join(out, "checkpoints"), STEPS, model, optimizer)
    if rank == 0:
        config.save_pretrained(os.path.join(out, "config"))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_probe_batch()).logits
    return {"logits": logits, "params": model.full_parameters()}


def _load_into_sharded(rank: int, world: int, checkpoint_dir: str, config_dir: str) -> dict:
    """A fresh sharded Llama (other weights) loads the converted checkpoint with load_checkpoint."""
    config = hf_llama.tiny_llama_config(tie_word_embeddings=True)
    model, _ = hf_llama.apply_fsdp(hf_llama.build_model(config, seed=1), "optim_grads", LR)
    step, _ = megatron_fsdp.load_checkpoint(checkpoint_dir, model)
    return {"step": step, "params": model.full_parameters()}


def _convert_on_ranks(rank: int, world: int, source: str, output: str, to: str, options: dict) -> dict:
    return convert(source, output, to, **options)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("convert"))
    result = run_distributed(_train_and_save, WORLD, out)[0]
    return {**result, "out": out, "checkpoints": os.path.join(out, "checkpoints"), "config": os.path.join(out, "config")}


@pytest.fixture(scope="module")
def exported(trained) -> str:
    path = os.path.join(trained["out"], "hf")
    convert(trained["checkpoints"], path, "huggingface", config=trained["config"])
    return path


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_world2_checkpoint_converts_to_hf_with_the_sharded_models_logits(trained, exported) -> None:
    loaded = LlamaForCausalLM.from_pretrained(exported).eval()
    assert loaded.dtype == torch.float32 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, value in trained["params"].items():
        assert torch.equal(dict(loaded.named_parameters())[name].detach(), value), f"{name} differs after conversion"
    assert "lm_head.weight" not in read_safetensors_dir(exported), "a tied head is written once, as save_pretrained does"
    with torch.no_grad():
        logits = loaded(input_ids=_probe_batch()).logits
    # The same fp32 weights, input and CPU kernels in one process: equal to the bit.
    assert torch.equal(logits, trained["logits"]), f"max logit difference {(logits - trained['logits']).abs().max():.2e}"


def test_hf_to_ours_to_hf_is_byte_identical_and_ours_loads_into_a_sharded_model(trained, exported) -> None:
    ours, back = os.path.join(trained["out"], "ours"), os.path.join(trained["out"], "hf_again")
    convert(exported, ours, "ours", step=7)
    assert sorted(os.listdir(ours)) == ["latest", "step_00000007"]
    assert "manifest.json" in os.listdir(os.path.join(ours, "step_00000007"))
    convert(ours, back, "huggingface", config=exported)
    original, again = read_safetensors_dir(exported), read_safetensors_dir(back)
    assert original.keys() == again.keys()
    for name in original:
        assert _same_bytes(original[name], again[name]), f"{name} changed on the way HF -> ours -> HF"
    loaded = run_distributed(_load_into_sharded, WORLD, ours, trained["config"])[0]
    assert loaded["step"] == 7
    for name, value in trained["params"].items():
        assert torch.equal(loaded["params"][name], value), f"{name}: the sharded model loaded other values"


def test_two_ranks_split_the_work_and_write_what_one_rank_writes(trained, exported) -> None:
    """Each rank writes its own files (steps balanced by bytes); the index and the tensors are
    those of the one-rank conversion."""
    one, two = os.path.join(trained["out"], "one_rank"), os.path.join(trained["out"], "two_ranks")
    options = {"config": trained["config"]}
    convert(trained["checkpoints"], one, "huggingface", max_file_bytes=100_000, **options)
    results = run_distributed(_convert_on_ranks, WORLD, trained["checkpoints"], two, "huggingface", {"max_file_bytes": 100_000, **options})
    assert all(result["bytes"] > 0 for result in results), f"a rank had nothing to do: {results}"
    assert sum(result["bytes"] for result in results) == sum(t.nbytes for t in read_safetensors_dir(one).values())
    first, second = read_safetensors_dir(one), read_safetensors_dir(two)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    dcp_two = os.path.join(trained["out"], "ours_two_ranks")
    run_distributed(_convert_on_ranks, WORLD, exported, dcp_two, "ours", {})
    files = os.listdir(os.path.join(dcp_two, "step_00000000"))
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(files), f"each rank writes its own data file: {files}"


def test_bad_input_names_the_problem_and_writes_nothing(trained, exported, tmp_path) -> None:
    output = str(tmp_path / "out")
    with pytest.raises(ConversionError, match="is not a torch.distributed.checkpoint directory"):
        convert(trained["config"], output, "huggingface")
    with pytest.raises(ConversionError, match="give it with --config"):
        convert(trained["checkpoints"], output, "huggingface")
    with pytest.raises(ConversionError, match="exists: choose another output directory"):
        convert(trained["checkpoints"], exported, "huggingface", config=trained["config"])
    # A damaged data file: the failure comes mid-write, and no output (nor its .partial) stays.
    damaged = str(tmp_path / "damaged")
    convert(exported, damaged, "ours")
    data = os.path.join(damaged, "step_00000000", "__0_0.distcp")
    with open(data, "r+b") as handle:
        handle.truncate(os.path.getsize(data) // 2)
    with pytest.raises(ConversionError, match=r"reading model\..* from \['__0_0.distcp'\] .* damaged or incomplete"):
        convert(damaged, output, "huggingface", config=exported)
    assert not os.path.exists(output) and not os.path.exists(output + ".partial")


def test_command_line_converts_and_reports_errors(trained, tmp_path) -> None:
    from megatron_fsdp.convert.__main__ import main

    output = str(tmp_path / "cli")
    assert main([trained["checkpoints"], output, "--to", "huggingface", "--config", trained["config"], "--dtype", "bf16"]) == 0
    assert all(t.dtype == torch.bfloat16 for t in read_safetensors_dir(output).values())
    assert main([str(tmp_path), str(tmp_path / "nothing"), "--to", "huggingface"]) == 2


def test_a_region_of_a_tensor_saved_in_pieces_reads_that_box(trained) -> None:
    """A box of a tensor that the world-2 save wrote as several chunks (each rank's rows) reads the
    values of that box, across the chunks it spans."""
    from megatron_fsdp.convert.sources import open_source

    source = open_source(trained["checkpoints"])
    name = "model.model.layers.0.mlp.gate_proj.weight"
    chunks = source.metadata.state_dict_metadata[name].chunks
    assert len(chunks) > 1, f"saved at world 2, {name} should be in pieces: {chunks}"
    full = trained["params"]["model.layers.0.mlp.gate_proj.weight"]
    assert torch.equal(source.read(name, (slice(10, 100),)), full[10:100])
    assert torch.equal(source.read(name, (77,)), full[77])
    assert torch.equal(source.read(name), full)


def test_conversion_holds_a_few_tensors_not_the_checkpoint(tmp_path) -> None:
    """Megatron-LM fsdp_dtensor -> Hugging Face streams: the peak resident memory during the
    conversion (the kernel's high-water mark, reset when it starts) stays within a few times the
    largest tensor, far below the checkpoint's size. Per tensor it holds the tensor, the stored
    chunk torch.load builds and the bytes it reads them from (measured: 3.4-3.6x a 32 MiB embedding,
    0.4x the 268 MiB checkpoint); holding the checkpoint would take more than 8x."""
    source, output = str(tmp_path / "megatron"), str(tmp_path / "hf")
    largest = convert_cost.write_checkpoint(source, convert_cost.SHAPES["test"])
    result = convert(source, output, "huggingface")
    used = result["peak_rss_above_start_bytes"]
    assert result["bytes"] > 8 * largest
    assert used <= 4.5 * largest, f"the conversion held {used / 2**20:.0f} MiB, {used / largest:.1f}x the largest tensor"
