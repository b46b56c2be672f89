"""Hugging Face weights in and out of a sharded model without a full copy on any rank
(``megatron_fsdp.load_pretrained`` / ``save_pretrained``), against Transformers' own
``from_pretrained`` on the same files.

Loading: a tiny ``LlamaForCausalLM`` written by ``save_pretrained`` (fp32, split by
``max_shard_size`` into files with an index, or one ``model.safetensors``) loads into a model
built on the meta device and sharded by either door; its weights (gathered) and logits equal, bit
for bit, ``from_pretrained`` then the same ``fully_shard``: at world 1, at world 2 with every
strategy (whole-model door) and FSDP2's door, at world 4 with HSDP and HFSDP (2 x 2: replicated
or sharded outer dim) and with tensor parallelism (2 x 2). Rows of 40 elements put some pieces'
starts inside a row, so a rank holds several rectangles of one tensor. The same values, cast the
same way and read into the same pieces: any difference is a wrong byte range, so equality is the
only tolerance.

Memory: a model of 55 MB in fp32 (27 MB as bf16 files) loads at world 2 with each rank's host
memory growing by at most one tensor as bf16 (the peak resident set, reset before the load) and
each rank reading the bytes of its own pieces exactly (``/proc/self/io``), the two ranks' bytes
together the files' tensors once.

Saving: trained two steps at world 2, the model saves with every rank writing its pieces;
``from_pretrained`` of the directory gives the sharded model's logits exactly (fp32, the same
weights through the same kernels); loaded and saved untouched at world 4 with TP, the files
``from_pretrained`` reads hold the original weights exactly; and a save that fails midway (the first rank's join of the pieces raising, as on a full
disk) leaves the previous save byte for byte and no partial directory.
"""

from __future__ import annotations

import hashlib
import os
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import megatron_fsdp  # noqa: E402
from _dist import run_distributed  # noqa: E402
from megatron_fsdp.checkpoint import safetensors_storage  # noqa: E402
from megatron_fsdp.checkpoint.pretrained import file_indices, parse_size  # noqa: E402
from megatron_fsdp.checkpoint.safetensors_storage import contiguous_runs  # noqa: E402
from megatron_fsdp.fsdp2 import fully_shard as fsdp2_fully_shard  # noqa: E402

LLAMA_UNIT = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _config(tie: bool = True, **sizes: int) -> LlamaConfig:
    # Rows of 40: at world 2 a rank's piece of gate_proj starts inside a row (several rectangles).
    shape = dict(vocab_size=128, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    return LlamaConfig(**{**shape, **sizes}, tie_word_embeddings=tie, max_position_embeddings=64)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def _write_pretrained(directory: str, config: LlamaConfig, max_shard_size: str, dtype: torch.dtype = torch.float32) -> None:
    """Random weights as Transformers saves them, written by the first rank."""
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(dtype).save_pretrained(directory, max_shard_size=max_shard_size)
    dist.barrier()


def _meta_llama(config: LlamaConfig, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Built as ``from_pretrained`` builds it for files of ``dtype``: under that default dtype
    (the rotary frequencies stay fp32), on the meta device."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_tokens()).logits


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def _differences(got: torch.nn.Module, want: torch.nn.Module) -> list[str]:
    """Names of tensors and logits that differ (no tolerance: see the module docstring)."""
    got_state, want_state = _full_state(got), _full_state(want)
    differ = [name for name, value in want_state.items() if not torch.equal(got_state[name], value)]
    return differ + ([] if torch.equal(_logits(got), _logits(want)) else ["logits"])


def _whole_model_door(directory: str | None, config: LlamaConfig, **arguments) -> megatron_fsdp.MegatronFSDP:
    """``from_pretrained`` then ``fully_shard`` (the reference; ``directory``), or built on the
    meta device, sharded, then ``load_pretrained`` (``directory=None``: the caller loads)."""
    if directory is not None:
        model, _ = megatron_fsdp.fully_shard(LlamaForCausalLM.from_pretrained(directory), fsdp_unit_modules=[LLAMA_UNIT], **arguments)
        return model
    model, _ = megatron_fsdp.fully_shard(_meta_llama(config), fsdp_unit_modules=[LLAMA_UNIT], init_model_with_meta_device=True, **arguments)
    return model


def _fsdp2_door(model: LlamaForCausalLM, mesh=None, tp_mesh=None) -> LlamaForCausalLM:
    """FSDP2's order: tensor parallelism, then each decoder layer and the root sharded in place."""
    for layer in model.model.layers:
        if tp_mesh is not None:
            parallelize_module(layer.self_attn, tp_mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                          "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
            parallelize_module(layer.mlp, tp_mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                    "down_proj": RowwiseParallel()})
        fsdp2_fully_shard(layer, mesh=mesh)
    return fsdp2_fully_shard(model, mesh=mesh)


def _loaded_by_fsdp2_door(directory: str, config: LlamaConfig, mesh=None, tp_mesh=None) -> LlamaForCausalLM:
    model = _fsdp2_door(_meta_llama(config), mesh, tp_mesh)
    model.to_empty(device="cpu")
    megatron_fsdp.load_pretrained(model, directory)
    return model


def _train_two_steps(model: torch.nn.Module) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    megatron_fsdp.fully_shard_optimizer(optimizer, model=model)
    for step in range(2):
        tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _tree_digest(directory: str) -> dict[str, str]:
    digests = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as handle:
            digests[name] = hashlib.sha256(handle.read()).hexdigest()
    return digests


def _failing_join(self, metadata, results):  # noqa: ANN001 - a writer's finish, as DCP calls it
    """The first rank's join of the pieces dies after writing part of a file (a full disk)."""
    with open(os.path.join(self.consolidated_output_path, "model-00001-of-00002.safetensors"), "wb") as handle:
        handle.write(b"\0" * 100)
    raise OSError(28, "No space left on device")


# -- world 1 -----------------------------------------------------------------------------------


def _world_1(rank: int, world: int, root: str) -> dict:
    config = _config(tie=False)
    single = os.path.join(root, "single")
    _write_pretrained(single, config, max_shard_size="50GB")  # one model.safetensors, no index
    loaded = _whole_model_door(None, config)
    megatron_fsdp.load_pretrained(loaded, single)
    results = {"files": sorted(os.listdir(single)), "differ": _differences(loaded, _whole_model_door(single, config))}
    errors = {}
    wrong = _config(tie=False, intermediate_size=80)
    for name, call in {
        "mis-shaped": lambda: megatron_fsdp.load_pretrained(_whole_model_door(None, wrong), single),
        "missing": lambda: megatron_fsdp.load_pretrained(_whole_model_door(None, _config(tie=False, num_hidden_layers=3)), single),
        "not a directory of safetensors": lambda: megatron_fsdp.load_pretrained(loaded, root),
    }.items():
        try:
            call()
            errors[name] = None
        except RuntimeError as error:
            errors[name] = str(error)
    results["errors"] = errors
    return results


@pytest.fixture(scope="module")
def world_1(tmp_path_factory) -> dict:
    return run_distributed(_world_1, 1, str(tmp_path_factory.mktemp("hf_pretrained_1")))[0]


def test_one_safetensors_file_loads_at_world_1_as_from_pretrained(world_1) -> None:
    assert "model.safetensors" in world_1["files"] and "model.safetensors.index.json" not in world_1["files"]
    assert world_1["differ"] == [], f"differ from from_pretrained then fully_shard: {world_1['differ']}"


def test_a_directory_that_does_not_fit_is_refused_naming_what_is_wrong(world_1) -> None:
    errors = world_1["errors"]
    assert "mis-shaped: model.layers.0.mlp.gate_proj.weight (files (72, 40), model (80, 40))" in errors["mis-shaped"]
    assert "missing from the files: model.layers.2.self_attn.q_proj.weight" in errors["missing"]
    assert "strict=False" in errors["missing"]
    assert "holds neither model.safetensors nor model.safetensors.index.json" in errors["not a directory of safetensors"]


# -- world 2 -----------------------------------------------------------------------------------


def _measured_load(model: torch.nn.Module, directory: str) -> dict:
    """Peak resident-set growth and bytes read (``/proc/self``) over one ``load_pretrained``."""

    def status(field: str) -> int:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field + ":"))

    def bytes_read() -> int:
        with open("/proc/self/io") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))

    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the peak resident set starts again from the current one
    before, read_before = status("VmRSS"), bytes_read()
    megatron_fsdp.load_pretrained(model, directory)
    return {"peak_growth": status("VmHWM") - before, "read": bytes_read() - read_before}


def _world_2(rank: int, world: int, root: str) -> dict:
    torch.use_deterministic_algorithms(True)
    results: dict = {"differ": {}}
    config = _config(tie=True)
    sharded_dir = os.path.join(root, "sharded")
    _write_pretrained(sharded_dir, config, max_shard_size="40KB")
    for strategy in STRATEGIES:
        loaded = _whole_model_door(None, config, zero_dp_strategy=strategy)
        megatron_fsdp.load_pretrained(loaded, sharded_dir)
        results["differ"][strategy] = _differences(loaded, _whole_model_door(sharded_dir, config, zero_dp_strategy=strategy))
    by_fsdp2 = _loaded_by_fsdp2_door(sharded_dir, config)
    results["differ"]["fsdp2"] = _differences(by_fsdp2, _fsdp2_door(LlamaForCausalLM.from_pretrained(sharded_dir)))
    results["files"] = sorted(os.listdir(sharded_dir))

    # Saving: trained, saved by every rank, loaded by Transformers; then a save that fails.
    _train_two_steps(loaded)
    saved = megatron_fsdp.save_pretrained(loaded, os.path.join(root, "saved"), max_shard_size="60KB")
    results["saved_logits"] = _logits(loaded)
    results["saved_files"] = sorted(os.listdir(saved))
    digest = _tree_digest(saved) if rank == 0 else None
    with mock.patch.object(safetensors_storage.HuggingFaceStorageWriter, "finish", _failing_join):
        try:
            megatron_fsdp.save_pretrained(by_fsdp2, saved, max_shard_size="60KB")
            results["failed_save"] = None
        except RuntimeError as error:  # on every rank
            results["failed_save"] = str(error)
    dist.barrier()
    if rank == 0:
        results["previous_save_kept"] = _tree_digest(saved) == digest
        results["left_behind"] = sorted(name for name in os.listdir(root) if name.startswith("saved."))
    results["saved_dir"] = saved

    # Memory: a model whose full copy would show, in bf16 files read into fp32 main weights.
    big = _config(tie=False, vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4)
    big_dir = os.path.join(root, "big")
    _write_pretrained(big_dir, big, max_shard_size="10MB", dtype=torch.bfloat16)
    # Built in bf16 as from_pretrained builds it for bf16 files; main weights in fp32 (the default).
    model, _ = megatron_fsdp.fully_shard(_meta_llama(big, torch.bfloat16), fsdp_unit_modules=[LLAMA_UNIT], init_model_with_meta_device=True)
    results["memory"] = _measured_load(model, big_dir)
    results["own_bytes"] = sum(v._local_tensor.numel() * 2 for v in model.state_dict().values())
    results["file_bytes"] = sum(p.numel() * 2 for p in _meta_llama(big).parameters())
    results["largest_tensor_bytes"] = max(p.numel() * 2 for p in _meta_llama(big).parameters())
    results["big_differ"] = _differences(model, _whole_model_door(big_dir, big))
    return results


@pytest.fixture(scope="module")
def world_2(tmp_path_factory) -> list[dict]:
    return run_distributed(_world_2, 2, str(tmp_path_factory.mktemp("hf_pretrained_2")))


def test_every_strategy_and_fsdp2_load_at_world_2_as_from_pretrained(world_2) -> None:
    assert "model.safetensors.index.json" in world_2[0]["files"], "the checkpoint should be split into several files"
    for rank, results in enumerate(world_2):
        for case, differ in results["differ"].items():
            assert differ == [], f"rank {rank}, {case}: differ from from_pretrained then fully_shard: {differ}"


def test_each_rank_reads_only_its_pieces_and_holds_no_full_copy(world_2) -> None:
    file_bytes, largest = world_2[0]["file_bytes"], world_2[0]["largest_tensor_bytes"]
    for rank, results in enumerate(world_2):
        assert results["big_differ"] == [], f"rank {rank}: differ from from_pretrained then fully_shard: {results['big_differ']}"
        read, own = results["memory"]["read"], results["own_bytes"]
        # The tensors' bytes, plus the files' headers and the load's few small messages.
        assert own <= read <= own + 2**20, f"rank {rank} read {read} bytes, its pieces hold {own}"
        # A full copy would add the whole 27 MB; one tensor's buffer (4 MB, cast to the fp32
        # pieces) plus 4 MB for the allocator and the interpreter is the bound.
        growth = results["memory"]["peak_growth"]
        assert growth <= largest + 4 * 2**20, f"rank {rank}: host memory grew by {growth / 2**20:.1f} MiB in the load"
    assert sum(results["own_bytes"] for results in world_2) == file_bytes, "every byte should be read by one rank"


def test_a_sharded_save_loads_with_from_pretrained_as_the_sharded_model(world_2) -> None:
    results = world_2[0]
    assert "model.safetensors.index.json" in results["saved_files"] and "config.json" in results["saved_files"]
    assert not any(name.startswith("shard") or name == "sharded" for name in results["saved_files"])
    loaded = LlamaForCausalLM.from_pretrained(results["saved_dir"])
    assert loaded.dtype == torch.float32 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        logits = loaded(input_ids=_tokens()).logits
    # The saved fp32 weights are the sharded model's main weights, run by the same kernels.
    assert torch.equal(logits, results["saved_logits"]), f"max logit difference {(logits - results['saved_logits']).abs().max():.2e}"


def test_a_save_that_fails_midway_leaves_the_previous_one_whole(world_2) -> None:
    for rank, results in enumerate(world_2):
        assert results["failed_save"] is not None and "No space left on device" in results["failed_save"], f"rank {rank}: {results['failed_save']}"
    assert world_2[0]["previous_save_kept"], "the previous save's files changed"
    assert world_2[0]["left_behind"] == [], f"a failed save left {world_2[0]['left_behind']}"


# -- world 4 -----------------------------------------------------------------------------------


def _world_4(rank: int, world: int, root: str) -> dict:
    torch.use_deterministic_algorithms(True)
    config = _config(tie=False)
    directory = os.path.join(root, "pretrained")
    _write_pretrained(directory, config, max_shard_size="40KB")
    results = {}
    outer_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    for outer in ("no_shard", "optim"):  # HSDP (replicas of the shards), HFSDP (the outer dim shards too)
        hybrid = dict(device_mesh=outer_mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                      outer_dp_sharding_strategy=outer, zero_dp_strategy="optim_grads_params")
        loaded = _whole_model_door(None, config, **hybrid)
        megatron_fsdp.load_pretrained(loaded, directory)
        results[f"outer {outer}"] = _differences(loaded, _whole_model_door(directory, config, **hybrid))

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    by_tp = _loaded_by_fsdp2_door(directory, config, mesh["dp"], mesh["tp"])
    results["tp"] = _differences(by_tp, _fsdp2_door(LlamaForCausalLM.from_pretrained(directory), mesh["dp"], mesh["tp"]))
    results["saved_dir"] = megatron_fsdp.save_pretrained(by_tp, os.path.join(root, "saved_tp"))
    results["pretrained_dir"] = directory
    return results


@pytest.fixture(scope="module")
def world_4(tmp_path_factory) -> list[dict]:
    return run_distributed(_world_4, 4, str(tmp_path_factory.mktemp("hf_pretrained_4")))


def test_hsdp_hfsdp_and_tensor_parallel_load_at_world_4_as_from_pretrained(world_4) -> None:
    for rank, results in enumerate(world_4):
        for case in ("outer no_shard", "outer optim", "tp"):
            assert results[case] == [], f"rank {rank}, {case}: differ from from_pretrained then the same sharding: {results[case]}"


def test_a_tensor_parallel_model_saves_the_weights_it_loaded(world_4) -> None:
    # Loaded and saved untouched: Hugging Face -> sharded (TP 2 x DP 2) -> Hugging Face is exact.
    # (The TP model's own logits differ from one process's in the last bits: its row-parallel
    # projections sum partial products across ranks.)
    saved = LlamaForCausalLM.from_pretrained(world_4[0]["saved_dir"]).state_dict()
    original = LlamaForCausalLM.from_pretrained(world_4[0]["pretrained_dir"]).state_dict()
    assert saved.keys() == original.keys()
    differ = [name for name, value in original.items() if not torch.equal(saved[name], value)]
    assert differ == [], f"saved weights differ from the loaded ones: {differ}"


# -- pure functions ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5), (2, 3, 2, 4)])
def test_contiguous_runs_cover_exactly_the_rectangle(shape: tuple[int, ...]) -> None:
    flat = torch.arange(torch.Size(shape).numel()).view(shape)
    generator = torch.Generator().manual_seed(len(shape))
    for _ in range(50):
        offsets = [int(torch.randint(0, size, (), generator=generator)) for size in shape]
        lengths = [int(torch.randint(1, size - o + 1, (), generator=generator)) for o, size in zip(offsets, shape)]
        want = flat[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].reshape(-1)
        got = torch.cat([torch.arange(first, first + count) for first, count in contiguous_runs(shape, tuple(offsets), tuple(lengths))])
        assert torch.equal(got, want), f"{shape} at {offsets} of {lengths}"


def test_files_split_as_transformers_splits_them() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("40KiB") == 40 * 2**10 and parse_size(123) == 123
    with pytest.raises(ValueError, match="digits and a unit"):
        parse_size("5 gigs")
    tensors = {"a": torch.zeros(10), "b": torch.zeros(20), "c": torch.zeros(100), "d": torch.zeros(5)}  # 40, 80, 400, 20 bytes
    assert file_indices(tensors, 130) == {"a": 1, "b": 1, "c": 2, "d": 3}
