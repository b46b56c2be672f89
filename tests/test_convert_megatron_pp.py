"""Offline conversion of Megatron-LM checkpoints saved with pipeline parallelism (PP 2).

Real PP checkpoints cannot be made here (PP needs two GPUs; one is lent), so two gloo processes
write the real MoE fixture (tests/data/megatron_lm/moe) the way megatron-core 0.19's two stages
would, each stage through DCP with its own shards, so ``.metadata`` and the data files are split
as a real PP save's are (one ``__<rank>_0.distcp`` per stage):

- ``torch_dist``: every layer tensor is one global ``[layers, ...]`` tensor (``[layers, experts,
  ...]`` for experts) of which each stage writes its layers' box at their global offset
  (megatron-core's TransformerBlock.sharded_state_dict: ``(0, global_layer_offset, num_layers)``),
  as a torch ShardedTensor (megatron-core's ``sharded_tensor_to_torch_sharded_tensor``); the
  embedding from the first stage, the final norm and output layer from the last; each stage's
  ``_extra_state`` items at their global layer and ``rng_state/shard_<pp>.0_2.1``; the common
  state from rank 0.
- ``fsdp_dtensor``: megatron-core saves ``model[0].state_dict_for_save_checkpoint()``, the module
  tree's names, where each stage's layers count from 0 (its ModuleList's index), as DTensors over
  the stage's data-parallel mesh. Both stages' layers then have the same names and boxes, and
  DCP's save plan keeps one copy of each (``dedup_save_plans``): the other stage's layers are
  not in the checkpoint, which the converter refuses.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("transformers")

from _dist import run_distributed  # noqa: E402
from megatron_lm_entries import sharded_object  # noqa: E402
from torch.distributed._shard.metadata import ShardMetadata  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata  # noqa: E402
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard as DTensorShard  # noqa: E402

from megatron_fsdp.convert import ConversionError, convert  # noqa: E402
from megatron_fsdp.convert.inert_pickle import Opaque  # noqa: E402
from megatron_fsdp.convert.sources import TORCH_DIST_COMMON_ITEM, TORCH_DIST_MARKER, open_source  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "megatron_lm")
MOE = os.path.join(DATA, "moe")
STAGES = 2
RNG = os.path.join(DATA, "run_state", "ddp", "iter_0000003")


def _pp_args(source) -> argparse.Namespace:
    """The fixture's args at PP 2, without megatron-core's objects (plain pickle cannot name them)."""
    args = argparse.Namespace(**{key: value for key, value in vars(source.read_object("args")).items() if not isinstance(value, Opaque)})
    args.pipeline_model_parallel_size = STAGES
    return args


def _raw_item(path: str, name: str) -> io.BytesIO:
    """A stored ShardedObject's bytes as Megatron-LM wrote them (a real run's RNG state)."""
    metadata = dcp.FileSystemReader(path).read_metadata()  # a fixture of ours: trusted
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == name)
    with open(os.path.join(path, info.relative_path), "rb") as handle:
        handle.seek(info.offset)
        return io.BytesIO(handle.read(info.length))


def _layer_box(full: torch.Tensor, stage: int) -> ShardedTensor:
    """Stage ``stage``'s layers of a stacked tensor (one layer a stage here) at their global
    offset, with the other stage's box in the global metadata, as megatron-core builds it."""
    local = full[stage : stage + 1].clone()
    boxes = [ShardMetadata([other, *[0] * (full.dim() - 1)], list(local.shape), f"rank:{other}/cpu") for other in range(STAGES)]
    metadata = ShardedTensorMetadata(boxes, full.shape, TensorProperties(dtype=full.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard.from_tensor_and_offsets(local, [stage, *[0] * (full.dim() - 1)], stage)], metadata
    )


def _stage_of_object(name: str) -> int:
    """Which stage saves a torch_dist ShardedObject: an extra state its layer's (``shard_<layer>_``
    or ``shard_<layer>.<expert>_``), the common state the first."""
    if "_extra_state/shard_" in name:
        return int(name.split("/shard_")[1].split("_")[0].split(".")[0])
    return 0


def _write_pp_checkpoints(rank: int, world: int, out: str) -> None:
    source = open_source(os.path.join(MOE, "torch_dist"))
    args, last = _pp_args(source), STAGES - 1
    state: dict = {}
    for name in source.tensors:
        value = source.read(name)
        if name.startswith("decoder.layers."):
            state[name] = _layer_box(value, rank)
        elif (name == "embedding.word_embeddings.weight") == (rank == 0) and (name != "embedding.word_embeddings.weight" or rank != last):
            state[name] = value
    for name in source.objects:
        if name == TORCH_DIST_COMMON_ITEM and rank == 0:
            kept = ("checkpoint_version", "iteration", "opt_param_scheduler", "num_floating_point_operations_so_far", "content_metadata")
            common = {key: value for key, value in source.read_item(name)[0].items() if key in kept}
            state[name] = sharded_object([{**common, "args": args}])
        elif "_extra_state" in name and _stage_of_object(name) == rank:
            state[name] = sharded_object(source.read_item(name))
    state[f"rng_state/shard_{rank}.0_{STAGES}.1"] = _raw_item(RNG, "rng_state/shard_0.0_1.1")
    torch_dist = os.path.join(out, "torch_dist")
    dcp.save(state, checkpoint_id=os.path.join(torch_dist, "iter_0000004"))

    # fsdp_dtensor: each stage's module names (layers from 0), DTensors over its data-parallel mesh.
    fsdp = open_source(os.path.join(MOE, "fsdp_dtensor"))
    data_parallel = init_device_mesh("cpu", (STAGES, 1), mesh_dim_names=("pp", "dp"))["dp"]
    prefix = f"model.module.decoder.layers.{rank}."
    state = {"args": args, "iteration": 4}
    for name in fsdp.tensors:
        if name.startswith(prefix):
            local_name = "model.module.decoder.layers.0." + name[len(prefix) :]
            state[local_name] = DTensor.from_local(fsdp.read(name), data_parallel, [DTensorShard(0)])
        elif not name.startswith("model.module.decoder.layers.") and ("embedding" in name) == (rank == 0):
            state[name] = DTensor.from_local(fsdp.read(name), data_parallel, [DTensorShard(0)])
    dcp.save(state, checkpoint_id=os.path.join(out, "fsdp_dtensor", "iter_0000004"))
    if rank == 0:
        shutil.copy(os.path.join(source.path, TORCH_DIST_MARKER), os.path.join(torch_dist, "iter_0000004"))
        for directory in ("torch_dist", "fsdp_dtensor"):
            with open(os.path.join(out, directory, "latest_checkpointed_iteration.txt"), "w") as handle:
                handle.write("4")


@pytest.fixture(scope="module")
def pipeline_saved(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("pp2"))
    run_distributed(_write_pp_checkpoints, STAGES, out)
    return out


def _tensors(path: str) -> dict[str, torch.Tensor]:
    source = open_source(path)
    return {name: source.read(name) for name in source.tensors}


def _assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == sorted(got)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), f"{name} differs"


def test_pp2_torch_dist_converts_as_the_same_model_saved_at_pp1(pipeline_saved: str, tmp_path) -> None:
    """Each stage's layer boxes come from its own file; converted, the PP 2 checkpoint gives the
    Mixtral files the PP 1 one gives, byte for byte (and so Megatron-LM's logits:
    test_convert_megatron_moe), and Megatron-LM's own fsdp_dtensor tensors, with both stages' RNG
    states."""
    source = os.path.join(pipeline_saved, "torch_dist")
    iteration = os.path.join(source, "iter_0000004")
    assert sorted(name for name in os.listdir(iteration) if name.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    metadata = dcp.FileSystemReader(iteration).read_metadata()
    fc1 = metadata.state_dict_metadata["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert [list(chunk.offsets) for chunk in fc1.chunks] == [[0, 0, 0, 0], [1, 0, 0, 0]] and list(fc1.size) == [2, 4, 256, 64]
    assert {info.relative_path for index, info in metadata.storage_data.items() if index.fqn == "output_layer.weight"} == {"__1_0.distcp"}

    pp_hf, hf = str(tmp_path / "pp_hf"), str(tmp_path / "hf")
    convert(source, pp_hf, "huggingface")
    convert(os.path.join(MOE, "torch_dist"), hf, "huggingface")
    for name in sorted(os.listdir(hf)):
        with open(os.path.join(hf, name), "rb") as one, open(os.path.join(pp_hf, name), "rb") as other:
            assert one.read() == other.read(), f"{name} differs between the PP 2 and PP 1 conversions"

    fsdp = str(tmp_path / "fsdp")
    convert(source, fsdp, "fsdp_dtensor")
    converted = _tensors(fsdp)
    _assert_same(_tensors(os.path.join(MOE, "fsdp_dtensor")), {name: value for name, value in converted.items() if name.startswith("model.")})
    rng = open_source(RNG).read_item("rng_state/shard_0.0_1.1")[0][0]
    for stage in range(STAGES):
        assert torch.equal(converted[f"rng_state.({stage}, 0).0.torch_rng_state"], rng["torch_rng_state"])


def test_pp2_fsdp_dtensor_lost_a_stage_and_is_refused(pipeline_saved: str, tmp_path) -> None:
    """Both stages' first layer is ``decoder.layers.0`` at the same box: DCP kept one copy, so the
    checkpoint holds one stage's layers of two, and converting it is refused, naming the cause."""
    iteration = os.path.join(pipeline_saved, "fsdp_dtensor", "iter_0000004")
    metadata = dcp.FileSystemReader(iteration).read_metadata()
    qkv = metadata.state_dict_metadata["model.module.decoder.layers.0.self_attention.linear_qkv.weight"]
    assert len(qkv.chunks) == 1 and not any("layers.1." in name for name in metadata.state_dict_metadata)
    for to in ("huggingface", "torch_dist"):
        with pytest.raises(ConversionError, match=r"pipeline_model_parallel_size=2: .*counts each stage.s layers from 0"):
            convert(os.path.join(pipeline_saved, "fsdp_dtensor"), str(tmp_path / to), to)
        assert not os.path.exists(tmp_path / to)
