"""Makes this folder's fixtures from the Megatron-LM checkpoints of issue 63 (README.txt says how
they were made): each keeps, byte for byte, the items Megatron-LM wrote for the model's weights and
its non-tensor state (args, iteration, torch_dist's common state), and leaves the optimizer state
and RNG states out (they do not fit the 1 MB a fixture may take). ``.metadata`` is Megatron-LM's,
less the entries left out and with the kept items' new offsets.

    python tests/data/megatron_lm/make_fixtures.py /work/wt/megatron_artifacts

``moe/`` (``--moe ARTIFACTS``): the same, from the runs of the same model with four
SequentialMLP experts, top-2 (``scripts/megatron_lm_llama_checkpoints.sh OUT --num-experts 4
--moe-router-topk 2``).

    python tests/data/megatron_lm/make_fixtures.py --moe /work/wt/moe_artifacts/moe

``run_state/`` (``--run-state RUN``, RUN a directory holding a real ``ddp/`` and ``ours/`` save of
the same model, data and seed, as tests/gpu/megatron_lm_convert_resume.sh makes): their
iteration-3 run state alone, byte for byte (the RNG states, the optimizer's param groups and
Adam steps, torch_dist's common state), which the converter must carry from one to the other.

    python tests/data/megatron_lm/make_fixtures.py --run-state /tmp/gpu3/x
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import sys

import torch
from torch.distributed.checkpoint import FileSystemReader

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKPOINTS = {"ours_fsdp_dtensor": "fsdp_dtensor", "ddp_torch_dist": "torch_dist"}


def keep(fqn: str) -> bool:
    return not fqn.startswith(("optimizer.", "rng_state", "rerun_state_machine"))


# Three parameters' group settings (each item is pickled apart, ~1.3 KB): a weight with decay, a
# 1-D norm without, and a SwiGLU fc1 (its settings under the whole name, its steps by halves).
GROUP_META_KEPT = tuple(
    f"optimizer.param_to_group_meta.module.module.{name}."
    for name in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "decoder.layers.0.mlp.linear_fc1.weight")
)


def run_state(fqn: str) -> bool:
    return fqn.startswith(("rng_state", "common_state/", "optimizer.distributed.dp_group_idx_0.optimizer/", *GROUP_META_KEPT)) or (
        fqn.startswith("optimizer.state.") and fqn.endswith(".step")
    )


def prune(source: str, target: str, keep=keep) -> None:
    metadata = FileSystemReader(source).read_metadata()  # our own artifact: trusted
    metadata.state_dict_metadata = {fqn: entry for fqn, entry in metadata.state_dict_metadata.items() if keep(fqn)}
    if isinstance(metadata.planner_data, dict):  # fsdp_dtensor's: each item's path in the state dict
        metadata.planner_data = {fqn: path for fqn, path in metadata.planner_data.items() if keep(fqn)}
    storage = {}
    os.makedirs(target)
    with open(os.path.join(target, "__0_0.distcp"), "wb") as out:
        for index, info in sorted(metadata.storage_data.items(), key=lambda pair: (pair[1].relative_path, pair[1].offset)):
            if not keep(index.fqn):
                continue
            with open(os.path.join(source, info.relative_path), "rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
            storage[index] = dataclasses.replace(info, relative_path="__0_0.distcp", offset=out.tell())
            out.write(data)
    metadata.storage_data = storage
    with open(os.path.join(target, ".metadata"), "wb") as handle:
        pickle.dump(metadata, handle)
    for extra in ("metadata.json",):
        if os.path.exists(os.path.join(source, extra)):
            shutil.copy(os.path.join(source, extra), target)


def main(artifacts: str, into: str = HERE) -> None:
    for name, fixture in CHECKPOINTS.items():
        target = os.path.join(into, fixture)
        shutil.rmtree(target, ignore_errors=True)
        os.makedirs(target)
        shutil.copy(os.path.join(artifacts, name, "latest_checkpointed_iteration.txt"), target)
        prune(os.path.join(artifacts, name, "iter_0000004"), os.path.join(target, "iter_0000004"))
    first, second = (torch.load(os.path.join(artifacts, f"logits_{name}.pt")) for name in CHECKPOINTS)
    assert torch.equal(first["logits"], second["logits"]), "both checkpoints' Megatron-LM logits should agree"
    torch.save(first, os.path.join(into, "megatron_logits.pt"))


def main_run_state(run: str) -> None:
    target = os.path.join(HERE, "run_state")
    shutil.rmtree(target, ignore_errors=True)
    for name in ("ddp", "ours"):
        prune(os.path.join(run, name, "iter_0000003"), os.path.join(target, name, "iter_0000003"), run_state)


if __name__ == "__main__":
    if sys.argv[1] == "--run-state":
        main_run_state(sys.argv[2])
    elif sys.argv[1] == "--moe":
        main(sys.argv[2], os.path.join(HERE, "moe"))
    else:
        main(sys.argv[1])
