"""Writes a real Megatron-LM checkpoint (tests/data/megatron_lm/moe) as megatron-core 0.19's
two pipeline stages would save it, each rank one stage (tests/test_convert_megatron_pp.py says
the layout and why). Apart from the test module so that the rank processes do not import
Transformers."""

from __future__ import annotations

import argparse
import io
import os
import shutil

import torch
import torch.distributed.checkpoint as dcp
from megatron_lm_entries import sharded_object
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard as DTensorShard

from megatron_fsdp.convert.inert_pickle import Opaque
from megatron_fsdp.convert.sources import TORCH_DIST_COMMON_ITEM, TORCH_DIST_MARKER, open_source

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "megatron_lm")
MOE = os.path.join(DATA, "moe")
STAGES = 2
RNG = os.path.join(DATA, "run_state", "ddp", "iter_0000003")


def _pp_args(source) -> argparse.Namespace:
    """The fixture's args at PP 2, without megatron-core's objects (plain pickle cannot name them)."""
    args = argparse.Namespace(**{key: value for key, value in vars(source.read_object("args")).items() if not isinstance(value, Opaque)})
    args.pipeline_model_parallel_size = STAGES
    return args


def raw_item(path: str, name: str) -> io.BytesIO:
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


def write_pp_checkpoints(rank: int, world: int, out: str) -> None:
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
    state[f"rng_state/shard_{rank}.0_{STAGES}.1"] = raw_item(RNG, "rng_state/shard_0.0_1.1")
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
