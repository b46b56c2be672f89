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

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("transformers")

from _dist import run_distributed  # noqa: E402
from megatron_lm_pp_save import MOE, RNG, STAGES, write_pp_checkpoints  # noqa: E402

from megatron_fsdp.convert import ConversionError, convert  # noqa: E402
from megatron_fsdp.convert.sources import open_source  # noqa: E402


@pytest.fixture(scope="module")
def pipeline_saved(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("pp2"))
    run_distributed(write_pp_checkpoints, STAGES, out)
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
