"""megatron-core's expert parallelism on megatron_fsdp, without megatron-core: each rank holds
its ``EXPERTS / ep`` local experts as plain modules ``mlp.experts.local_experts.<i>`` marked
``allreduce = False`` (megatron-core's SequentialMLP), wrapped by :class:`MegatronCoreFSDP` with
megatron-core's dense and expert meshes, and checkpointed as Megatron-LM writes fsdp_dtensor with
``--swiglu``: each gated ``linear_fc1`` split into its gate and up halves (``_w``, ``_v``: the
splitter ``install()`` puts in megatron-core), its local experts renamed to their global index
(``handle_experts_in_state_dict``). Training against one process holding every expert; the
checkpoint resumed at the same sizes and resharded. Six experts, so that at EP2 a rank's three
share a bucket whose halves start inside a row of a gated fc1.

With expert tensor parallelism (``--expert-tensor-parallel-size``) each expert's ``linear_fc1``
is column-parallel and its ``linear_fc2`` row-parallel over the expert mesh's ``tp`` dim, as
megatron-core's expert layers build them: plain per-rank blocks marked
``tensor_model_parallel`` / ``partition_dim`` (0 and 1). Their checkpoint shows the whole expert.

Experts see the tokens of their expert-model-parallel group (expert-parallel x expert-tensor-
parallel ranks, megatron-core's dispatcher): gathered along the sequence, every local expert
(or its tensor-parallel block) runs on the tokens routed to it, and the outputs, partial sums
under expert tensor parallelism, are summed and scattered back.

With dense tensor parallelism as well (``--tensor-model-parallel-size 2``, with the sequence
parallelism megatron-core requires of MoE under TP) the embedding and the output layer are
vocabulary-parallel over the dense mesh's ``tp`` dim, and each rank's layers see its slice of
the sequence: the norms and the router, duplicated, are marked ``sequence_parallel`` and their
partial gradients summed over the dense tensor-parallel group (``finalize_model_grads``).

Tolerances as in tests/test_megatron_core_tensor_parallel.py (fp32: 1e-5 against one process,
parameters also 1e-5 absolute for Adam's near-zero gradients, a resume bit-equal at the same
sizes, 1e-6 resharded); megatron_fsdp's own norm (``total_grad_norm``: fp32 per piece) within
1e-6 of megatron-core's clip (fp64 sums) over the same gradients.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from _dist import run_distributed
from mcore_flow import (
    GatherLastDim,
    assert_saved_as_gated_halves,
    fc1_at_save,
    GatherSequence,
    ReduceScatterSequence,
    finalize_model_grads,
    fsdp_dtensor_state,
    load_fsdp_dtensor,
    megatron_core_clip,
    one_process_run,
    strided_split_refusal,
    tensor_parallel_block,
)

import megatron_fsdp
from megatron_fsdp.integrations.mcore_fsdp import MegatronCoreFSDP
from megatron_fsdp.integrations.mcore_optimizer_steps import install_piece_steps

VOCAB, HIDDEN, FFN, SEQ, ROWS, EXPERTS = 38, 20, 14, 6, 4, 6
STEPS, SAVED_AT = 5, 3
LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")


class Layout(NamedTuple):
    """Expert-parallel and expert-tensor-parallel sizes at world 4; the experts are sharded over
    the remaining ``4 / (ep * etp)`` expert-data-parallel ranks, the dense layers over
    ``4 / tp`` data-parallel ranks."""

    ep: int
    etp: int
    outer: int = 1  # HSDP: megatron-core's distributed-optimizer instances, each replicating the shards
    tp: int = 1  # dense tensor-parallel size, sequence-parallel when above 1


class Expert(nn.Module):
    """megatron-core's expert MLP with --swiglu: ``linear_fc1`` column-parallel and gated, split
    strided (``partition_stride`` 2: each rank holds its slice of the gate and of the up
    projection), ``linear_fc2`` row-parallel, over ``etp`` ranks (whole at 1, marked all the same,
    as megatron-core's layers do)."""

    def __init__(self, etp: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(HIDDEN, 2 * FFN // etp, bias=False)
        self.linear_fc2 = nn.Linear(FFN // etp, HIDDEN, bias=False)
        for param, partition_dim, stride in ((self.linear_fc1.weight, 0, 2), (self.linear_fc2.weight, 1, 1)):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, partition_dim, stride
            param.allreduce = False  # megatron-core's mark: reduced over the expert data-parallel group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class Experts(nn.Module):
    def __init__(self, count: int, etp: int) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(Expert(etp) for _ in range(count))


class ExpertGroups(NamedTuple):
    """This rank's place among the experts: ``ep_rank`` of ``ep`` expert-parallel ranks,
    ``etp_rank`` of ``etp``, and the group of both whose tokens its experts see."""

    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    tokens: dist.ProcessGroup | None = None


class MoELayer(nn.Module):
    """Top-1 routing over ``EXPERTS`` experts, this rank holding ``EXPERTS / ep`` of them; under
    sequence parallelism on this rank's slice of the sequence."""

    def __init__(self, groups: ExpertGroups, sequence_parallel: bool) -> None:
        super().__init__()
        self.token_group = groups.tokens
        self.first_expert = groups.ep_rank * EXPERTS // groups.ep
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.mlp.experts = Experts(EXPERTS // groups.ep, groups.etp)
        for param in (self.norm.weight, self.norm.bias, self.mlp.router.weight):
            param.sequence_parallel = sequence_parallel  # megatron-core's mark: a partial gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.token_group is not None:
            h = GatherSequence.apply(h, self.token_group)
        gate, chosen = F.softmax(self.mlp.router(h), dim=-1).max(dim=-1)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.mlp.experts.local_experts):
            routed = (chosen == self.first_expert + index).unsqueeze(-1)
            out = out + routed * expert(h)
        out = gate.unsqueeze(-1) * out
        if self.token_group is not None:
            out = ReduceScatterSequence.apply(out, self.token_group)
        return x + out


class MoEGPT(nn.Module):
    """A vocabulary-parallel embedding and output layer (whole without ``tp_group``) around MoE
    layers; with ``tp_group`` sequence-parallel over it."""

    def __init__(self, groups: ExpertGroups = ExpertGroups(), tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.embedding = nn.Embedding(VOCAB // self.tp, HIDDEN)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(MoELayer(groups, tp_group is not None) for _ in range(2))
        self.output = nn.Linear(HIDDEN, VOCAB // self.tp, bias=False)
        for param in (self.embedding.weight, self.output.weight):  # split by vocabulary rows
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
        self.first_expert = self.decoder.layers[0].first_expert
        self.load_local_experts_of(_full_initial_weights(), groups)

    def load_local_experts_of(self, full: dict[str, torch.Tensor], groups: ExpertGroups) -> None:
        """Every parameter from the full model's, local experts from their global index's, each
        split expert weight its expert-tensor-parallel rank's block, each split dense weight its
        tensor-parallel rank's."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                value = full[global_expert_name(name, self.first_expert)]
                if getattr(param, "tensor_model_parallel", False):
                    expert = not getattr(param, "allreduce", True)
                    size, rank = (groups.etp, groups.etp_rank) if expert else (self.tp, self.tp_rank)
                    value = tensor_parallel_block(value, param, size, rank)
                param.copy_(value)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = VOCAB // self.tp
        local = tokens - self.tp_rank * rows
        outside = (local < 0) | (local >= rows)
        x = self.embedding(local.clamp(0, rows - 1)).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.tp_group is not None:
            x = ReduceScatterSequence.apply(x, self.tp_group)
        for layer in self.decoder.layers:
            x = layer(x)
        if self.tp_group is not None:
            x = GatherSequence.apply(x, self.tp_group)
        logits = self.output(x)
        if self.tp_group is not None:
            logits = GatherLastDim.apply(logits, self.tp_group)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def global_expert_name(name: str, first_expert: int) -> str:
    """Megatron-LM's renaming of a rank's local expert (handle_experts_in_state_dict)."""
    return LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + first_expert}.", name)


def _full_initial_weights() -> dict[str, torch.Tensor]:
    """The one-process model's parameters, every expert under its global index."""
    shapes = {}
    for layer in range(2):
        prefix = f"decoder.layers.{layer}."
        shapes[prefix + "norm.weight"] = shapes[prefix + "norm.bias"] = (HIDDEN,)
        shapes[prefix + "mlp.router.weight"] = (EXPERTS, HIDDEN)
        for expert in range(EXPERTS):
            shapes[prefix + f"mlp.experts.local_experts.{expert}.linear_fc1.weight"] = (2 * FFN, HIDDEN)
            shapes[prefix + f"mlp.experts.local_experts.{expert}.linear_fc2.weight"] = (HIDDEN, FFN)
    shapes["embedding.weight"] = (VOCAB, HIDDEN)
    shapes["output.weight"] = (VOCAB, HIDDEN)
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) * 0.3 for name, shape in sorted(shapes.items())}


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2000 + step)
    data = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def _meshes(layout: Layout) -> tuple[megatron_fsdp.FSDPDistributedIndex, ExpertGroups]:
    """megatron-core's meshes: the dense ``(dp_cp, tp)`` over every rank, ranks laid out
    ``(dp, tp)``, the expert ``(dp_cp, tp)`` over the ranks holding the same experts (its ``tp``
    the expert-tensor-parallel ranks), ranks laid out ``(expert dp, ep, etp)`` as megatron-core's."""
    world, outer = dist.get_world_size(), layout.outer
    dense = dist.init_device_mesh(
        "cpu", (outer, world // (outer * layout.tp), layout.tp), mesh_dim_names=("outer_fsdp_dp", "dp_cp", "tp")
    )
    expert = dist.init_device_mesh(
        "cpu", (outer, world // (outer * layout.ep * layout.etp), layout.ep, layout.etp),
        mesh_dim_names=("outer_fsdp_dp", "dp_cp", "ep", "tp"),
    )
    hsdp = (
        {"dp_outer_dim": "outer_fsdp_dp", "hybrid_fsdp_group": dense["outer_fsdp_dp", "dp_cp"]._flatten("hdp").get_group()}
        if outer > 1 else {}
    )
    index = megatron_fsdp.FSDPDistributedIndex(
        device_mesh=dense, dp_shard_dim="dp_cp", tp_dim="tp",
        expt_device_mesh=expert["outer_fsdp_dp", "dp_cp", "tp"] if outer > 1 else expert["dp_cp", "tp"], **hsdp,
    )
    split = layout.ep * layout.etp > 1
    groups = ExpertGroups(
        layout.ep, expert.get_local_rank("ep"), layout.etp, expert.get_local_rank("tp"),
        expert["ep", "tp"]._flatten("ep_tp").get_group() if split else None,
    )
    return index, groups


class _Adapter(nn.Module):
    """megatron-core's FullyShardedDataParallel over its meshes (:func:`_meshes`)."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        index, groups = _meshes(layout)
        self.tp_group = index.device_mesh["tp"].get_group()
        # megatron-core sums the norm's squares within one distributed-optimizer instance.
        self.instance_group = index.device_mesh["dp_cp", "tp"]._flatten("instance").get_group() if layout.outer > 1 else None
        # Tensor-parallel ranks see the same rows of the batch.
        self.dp_rank, self.dp = dist.get_rank() // layout.tp, dist.get_world_size() // layout.tp
        config = megatron_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True, overlap_param_gather=True,
            outer_dp_sharding_strategy="no_shard", num_distributed_optimizer_instances=layout.outer,
        )
        model = MoEGPT(groups, self.tp_group if layout.tp > 1 else None)
        self.first_expert = model.first_expert
        self.module = MegatronCoreFSDP(model, index, config, fsdp_unit_modules=[MoELayer])

    def key(self, name: str) -> str:
        return global_expert_name(name, self.first_expert)


def _optimizer(adapter: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(adapter.module.parameters(), lr=1e-2, weight_decay=0.1)


def _train_step(adapter: _Adapter, optimizer: torch.optim.Optimizer, step: int) -> tuple[float, float, float]:
    """The step's loss, megatron-core's gradient norm, and megatron_fsdp's own over its pieces."""
    tokens, targets = make_batch(step)
    rows = slice(adapter.dp_rank * ROWS // adapter.dp, (adapter.dp_rank + 1) * ROWS // adapter.dp)
    loss = adapter.module(tokens[rows], targets[rows])
    loss.backward()
    finalize_model_grads(adapter, adapter.tp_group)
    engine_norm = megatron_fsdp.total_grad_norm(adapter.module).item()
    norm = megatron_core_clip(optimizer, 0.5, adapter.tp_group, adapter.instance_group)
    optimizer.step()
    adapter.module.param_and_grad_buffer.copy_main_weights_to_model_weights()
    adapter.module.zero_grad_buffer()
    total = loss.detach().clone()
    dist.all_reduce(total)  # every tensor-parallel rank holds the same loss
    return total.item() / dist.get_world_size(), norm, engine_norm


def _resume(layout: Layout, checkpoint_dir: str) -> list[tuple[float, float, float]]:
    """As Megatron-LM loads fsdp_dtensor: DCP fills the renamed state's tensors in place, then the
    model loads its state dict under the local names."""
    adapter = _Adapter(layout)
    optimizer = _optimizer(adapter)
    load_fsdp_dtensor(adapter, optimizer, checkpoint_dir, adapter.key, gated=True)
    return [_train_step(adapter, optimizer, step) for step in range(SAVED_AT, STEPS)]


def _flow(rank: int, world_size: int, checkpoint_dir: str, layout: Layout, resharded: Layout) -> dict:
    handles = install_piece_steps()
    try:
        adapter = _Adapter(layout)
        optimizer = _optimizer(adapter)
        history = [_train_step(adapter, optimizer, step) for step in range(SAVED_AT)]
        dcp.save(fsdp_dtensor_state(adapter, optimizer, adapter.key, gated=True), checkpoint_id=checkpoint_dir)
        saved_fc1, fc1_piece_starts = fc1_at_save(adapter.module.state_dict(), adapter.key, HIDDEN)
        history += [_train_step(adapter, optimizer, step) for step in range(SAVED_AT, STEPS)]
        state = adapter.module.state_dict()
        full = {adapter.key(k.removeprefix("module.")): v.full_tensor() for k, v in state.items()}
        placements = {adapter.key(k.removeprefix("module.")): tuple(v.placements) for k, v in state.items()}
        return {
            "history": history,
            "full": full,
            "placements": placements,
            "saved_fc1": saved_fc1,
            "fc1_piece_starts": fc1_piece_starts,
            "same_sizes": _resume(layout, checkpoint_dir),
            "resharded": _resume(resharded, checkpoint_dir),
        }
    finally:
        for handle in handles:
            handle.remove()


def _reference() -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    model = MoEGPT()
    return one_process_run(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), make_batch, STEPS)


# (trained and saved, resumed from that checkpoint)
LAYOUTS = {
    "ep2-edp2-to-ep1": (Layout(ep=2, etp=1), Layout(ep=1, etp=1)),
    # Each expert split over 2 expert-tensor-parallel ranks and sharded over the other 2.
    "etp2-edp2-to-etp1": (Layout(ep=1, etp=2), Layout(ep=1, etp=1)),
    # Experts over 2 expert-parallel ranks and each split over 2 (expert-data-parallel size 1).
    "ep2-etp2-to-ep2": (Layout(ep=2, etp=2), Layout(ep=2, etp=1)),
    # HSDP: 2 replicas of DP2 (megatron-core's 2 distributed-optimizer instances), experts at
    # EP2 summed over the replicas too.
    "hsdp2-ep2-to-ep1": (Layout(ep=2, etp=1, outer=2), Layout(ep=1, etp=1)),
    # Dense TP2 x DP2 (sequence-parallel) with experts at EP2 x ETP2 (expert-data-parallel size 1):
    # --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2.
    # The expert-tensor-parallel pairs are the dense tensor-parallel pairs, the expert-parallel
    # pairs the dense data-parallel ones.
    "tp2-ep2-etp2-to-ep2": (Layout(ep=2, etp=2, tp=2), Layout(ep=2, etp=1)),
    # Dense TP2 x DP2 with experts at EP2 x EDP2 (ETP1): the expert-parallel pairs are the dense
    # tensor-parallel pairs, the expert-data-parallel pairs the dense data-parallel ones.
    "tp2-ep2-edp2-to-ep1": (Layout(ep=2, etp=1, tp=2), Layout(ep=1, etp=1)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_local_experts_train_checkpoint_under_global_names_and_reshard_like_one_process(name, tmp_path):
    layout, resharded = LAYOUTS[name]
    results = run_distributed(_flow, 4, str(tmp_path / "ckpt"), layout, resharded)
    reference, reference_params = _reference()
    ours = results[0]
    assert all(r["history"] == ours["history"] for r in results), "ranks disagree on the loss or the norm"
    for step, ((loss, norm, engine_norm), (ref_loss, ref_norm)) in enumerate(zip(ours["history"], reference)):
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), f"step {step}: loss {loss} vs one process {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=1e-5), f"step {step}: grad norm {norm} vs one process {ref_norm}"
        # The same gradients, summed in fp32 per piece instead of fp64: 1e-6.
        assert math.isclose(engine_norm, norm, rel_tol=1e-6), f"step {step}: megatron_fsdp's norm {engine_norm} vs {norm}"
    # State dicts (what fsdp_dtensor saves) hold every expert whole under its global name.
    full = {key: value for result in results for key, value in result["full"].items()}
    assert full.keys() == reference_params.keys()
    for key, expected in reference_params.items():
        torch.testing.assert_close(full[key], expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    if layout.etp > 1:
        fc1, fc2 = (ours["placements"][f"decoder.layers.0.mlp.experts.local_experts.0.linear_fc{i}.weight"] for i in (1, 2))
        assert fc1[-1] == Shard(0) and fc2[-1] == Shard(1), (fc1, fc2)
    if layout.tp > 1:
        embedding, router = (ours["placements"][k] for k in ("embedding.weight", "decoder.layers.0.mlp.router.weight"))
        assert embedding[-1] == Shard(0) and router[-1] == Replicate(), (embedding, router)
    # --swiglu: each expert's gated fc1 saved as Megatron-LM's gate and up halves.
    assert_saved_as_gated_halves(str(tmp_path / "ckpt"), {k: v for r in results for k, v in r["saved_fc1"].items()})
    if layout.ep == 2 and layout.etp == 1 and layout.outer == 1:
        # 3 local experts over 2 expert-data-parallel ranks: a piece starts inside a row of a gated fc1.
        assert any(start for r in results for start in r["fc1_piece_starts"]), [r["fc1_piece_starts"] for r in results]
    continued = ours["history"][SAVED_AT:]
    assert ours["same_sizes"] == continued, f"resumed {ours['same_sizes']} vs continued {continued}"
    for step, ((loss, norm, _), (ref_loss, ref_norm, _)) in enumerate(zip(ours["resharded"], continued), start=SAVED_AT):
        assert math.isclose(loss, ref_loss, rel_tol=1e-6), f"step {step} at {resharded}: loss {loss} vs {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=1e-6), f"step {step} at {resharded}: norm {norm} vs {ref_norm}"


def _wrap_with_strided_expert_split(rank: int, world_size: int) -> str:
    index, groups = _meshes(Layout(ep=1, etp=world_size))
    model = MoEGPT(groups)
    model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc2.weight.partition_stride = 2  # along dim 1
    return strided_split_refusal(model, index, MoELayer)


def test_a_strided_expert_split_along_another_dim_than_rows_is_refused_on_every_rank():
    for message in run_distributed(_wrap_with_strided_expert_split, 2):
        assert "partition_stride=2 along partition_dim 1" in message and "equal row blocks" in message, message
