"""megatron-core's tensor parallelism on megatron_fsdp, without megatron-core (CI has no Python
3.12): a model built as megatron-core's tensor-parallel layers build theirs (plain per-rank
blocks marked ``tensor_model_parallel`` / ``partition_dim``, the vocabulary and the MLP's first
layer split by rows (a SwiGLU layer, split strided as --swiglu splits it: ``partition_stride``
2), its second by columns, norms and biases after a reduction duplicated),
wrapped by :class:`MegatronCoreFSDP` over megatron-core's mesh ``(outer_fsdp_dp, dp_cp, tp)`` and
driven as megatron-core drives it (``finish_grad_sync``, its clip on local gradients with
tensor-parallel duplicates left out, the fsdp_dtensor checkpoint through DCP, its gated fc1 split
into Megatron-LM's ``_w``/``_v`` halves as with ``--swiglu``). Five layouts at world 4: TP2 x DP2;
the same under ZeRO-1 (``optim``); the same with sequence parallelism (norms, position embedding and
row-parallel bias on each rank's slice of the sequence, their partial gradients summed over the
tensor-parallel group by megatron-core's ``finalize_model_grads`` through the faces' local
gradients); TP2 under HFSDP (two distributed-optimizer instances, the outer sharding strategy
``optim``); and TP2 under HSDP with shard groups of one rank. Each is compared with one process training the unsplit model on the same data, and
its checkpoint resumed at the same layout and at TP1 x DP4.
tests/gpu/test_megatron_lm_pretrain.py runs Megatron-LM's ``pretrain_gpt.py`` with
``--tensor-model-parallel-size 2`` itself.

Tolerances: fp32 throughout. The sharded run sums the same products in another order (TP
all-reduces, DP reduce-scatters), so losses and norms agree to fp32 rounding (1e-5 relative);
Adam's update is about lr = 1e-2 an element whatever the gradient's size, so a rounding in a
near-zero gradient can move a parameter by a small fraction of that (1e-5 absolute). A resumed
run repeats the saved run's own arithmetic: bit-equal at the same sizes, and within 1e-6
relative when resharded to other tensor- and data-parallel sizes (the reductions regroup).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from _dist import run_distributed
from mcore_flow import (
    CopyToTensorParallel,
    assert_saved_as_gated_halves,
    fc1_at_save,
    GatherLastDim,
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
from moe_model import SumOverGroup

import megatron_fsdp
from megatron_fsdp.integrations.mcore_fsdp import MegatronCoreFSDP
from megatron_fsdp.integrations.mcore_optimizer_steps import install_piece_steps

VOCAB, HIDDEN, FFN, SEQ, ROWS = 38, 20, 52, 10, 4
STEPS, SAVED_AT = 5, 3


def _split(param: nn.Parameter, partition_dim: int, stride: int = 1) -> nn.Parameter:
    """megatron-core's marks on a weight its tensor-parallel ranks hold a block of (``stride``
    blocks: a gated linear_fc1, split strided)."""
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, partition_dim, stride
    return param


def _on_sequence_slices(*params: nn.Parameter) -> None:
    """megatron-core's mark on a duplicated parameter that sequence parallelism applies to one
    slice of the sequence per rank: its gradients are partial sums."""
    for param in params:
        param.sequence_parallel = True


class TensorParallelMLPBlock(nn.Module):
    """LayerNorm, a gated column-parallel layer (SwiGLU, as megatron-core's --swiglu: its rows
    split strided, each rank holding its slice of the gate and of the up projection), a
    row-parallel layer (columns split; its bias added after the reduction, duplicated)."""

    def __init__(self, tp: int, group: dist.ProcessGroup | None, sequence_parallel: bool) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.norm = nn.LayerNorm(HIDDEN)
        # Under megatron-core's names (mlp.linear_fc1), which Megatron-LM's --swiglu checkpointing splits.
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Module()
        self.mlp.linear_fc1.weight = _split(nn.Parameter(torch.empty(2 * FFN // tp, HIDDEN)), 0, stride=2)
        self.mlp.linear_fc1.bias = _split(nn.Parameter(torch.empty(2 * FFN // tp)), 0, stride=2)
        self.fc2_weight = _split(nn.Parameter(torch.empty(HIDDEN, FFN // tp)), 1)
        self.fc2_bias = nn.Parameter(torch.empty(HIDDEN))
        if sequence_parallel:
            _on_sequence_slices(self.norm.weight, self.norm.bias, self.fc2_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the whole sequence, or under sequence parallelism this rank's slice of it."""
        h = self.norm(x)
        if self.sequence_parallel:
            h = GatherSequence.apply(h, self.group)
        elif self.group is not None:
            h = CopyToTensorParallel.apply(h, self.group)
        gate, up = F.linear(h, self.mlp.linear_fc1.weight, self.mlp.linear_fc1.bias).chunk(2, dim=-1)
        partial = F.linear(F.silu(gate) * up, self.fc2_weight)
        if self.sequence_parallel:
            partial = ReduceScatterSequence.apply(partial, self.group)
        elif self.group is not None:
            partial = SumOverGroup.apply(partial, self.group)
        return x + partial + self.fc2_bias


class TensorParallelGPT(nn.Module):
    """A vocabulary-parallel embedding and output layer around tensor-parallel MLP blocks; with
    ``tp == 1`` (no group) the plain model that the one-process reference trains."""

    def __init__(self, tp: int = 1, group: dist.ProcessGroup | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp, self.group, self.sequence_parallel = tp, group, sequence_parallel
        self.rank = dist.get_rank(group) if group is not None else 0
        self.embedding = _split(nn.Parameter(torch.empty(VOCAB // tp, HIDDEN)), 0)
        self.position = nn.Parameter(torch.empty(SEQ, HIDDEN))
        self.blocks = nn.ModuleList(TensorParallelMLPBlock(tp, group, sequence_parallel) for _ in range(2))
        self.final_norm = nn.LayerNorm(HIDDEN)
        self.output = _split(nn.Parameter(torch.empty(VOCAB // tp, HIDDEN)), 0)
        if sequence_parallel:
            _on_sequence_slices(self.position, self.final_norm.weight, self.final_norm.bias)
        self.load_blocks_of(full_initial_weights())

    def load_blocks_of(self, full: dict[str, torch.Tensor]) -> None:
        """Each parameter gets its tensor-parallel rank's part of the full tensor."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                value = full[name]
                if getattr(param, "tensor_model_parallel", False):
                    value = tensor_parallel_block(value, param, self.tp, self.rank)
                param.copy_(value)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = VOCAB // self.tp
        local = tokens - self.rank * rows
        outside = (local < 0) | (local >= rows)
        x = F.embedding(local.clamp(0, rows - 1), self.embedding).masked_fill(outside.unsqueeze(-1), 0.0)
        position = self.position[: tokens.shape[1]]
        if self.sequence_parallel:
            x = ReduceScatterSequence.apply(x, self.group)
            position = position.chunk(self.tp)[self.rank]
        elif self.group is not None:
            x = SumOverGroup.apply(x, self.group)
        x = x + position
        for block in self.blocks:
            x = block(x)
        h = self.final_norm(x)
        if self.sequence_parallel:
            h = GatherSequence.apply(h, self.group)
        elif self.group is not None:
            h = CopyToTensorParallel.apply(h, self.group)
        logits = F.linear(h, self.output)
        if self.group is not None:
            logits = GatherLastDim.apply(logits, self.group)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def full_initial_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {name: param.shape for name, param in _plain_shapes().items()}
    return {name: torch.randn(shape, generator=generator) * 0.2 for name, shape in shapes.items()}


def _plain_shapes() -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = nn.Module()
        model.embedding = nn.Parameter(torch.empty(VOCAB, HIDDEN))
        model.position = nn.Parameter(torch.empty(SEQ, HIDDEN))
        model.blocks = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.norm = nn.LayerNorm(HIDDEN)
            block.mlp = nn.Module()
            block.mlp.linear_fc1 = nn.Linear(HIDDEN, 2 * FFN)
            block.fc2_weight = nn.Parameter(torch.empty(HIDDEN, FFN))
            block.fc2_bias = nn.Parameter(torch.empty(HIDDEN))
            model.blocks.append(block)
        model.final_norm = nn.LayerNorm(HIDDEN)
        model.output = nn.Parameter(torch.empty(VOCAB, HIDDEN))
    return dict(model.named_parameters())


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


# -- megatron-core's flow ---------------------------------------------------------------------


class Layout(NamedTuple):
    """megatron-core's mesh: ``outer`` distributed-optimizer instances (HSDP's outer dim; with
    ``hfsdp`` the optimizer state is sharded across them too), ``dp`` ranks in each shard group
    (dp_cp), ``tp`` tensor-parallel ranks, tensor-parallel ranks adjacent as megatron-core lays them."""

    outer: int
    dp: int
    tp: int
    sequence_parallel: bool = False
    hfsdp: bool = False
    strategy: str = "optim_grads_params"


class _Adapter(nn.Module):
    """Stands for megatron-core's FullyShardedDataParallel over its ``(outer_fsdp_dp, dp_cp, tp)`` mesh."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        mesh = dist.init_device_mesh(
            "cpu", (layout.outer, layout.dp, layout.tp), mesh_dim_names=("outer_fsdp_dp", "dp_cp", "tp")
        )
        self.tp_group = mesh["tp"].get_group()
        # megatron-core's clip sums within one distributed-optimizer instance; HFSDP's instances
        # hold different pieces, so there every rank counts.
        self.instance_group = None if layout.hfsdp else _instance_group(mesh)
        self.dp_rank = mesh.get_local_rank("outer_fsdp_dp") * layout.dp + mesh.get_local_rank("dp_cp")
        self.dp = layout.outer * layout.dp
        outer = dict(dp_outer_dim="outer_fsdp_dp", hsdp_outer_dp_shard=layout.hfsdp) if layout.outer > 1 else {}
        index = megatron_fsdp.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp_cp", tp_dim="tp", **outer)
        config = megatron_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy=layout.strategy, overlap_grad_reduce=True, overlap_param_gather=True,
            outer_dp_sharding_strategy="optim" if layout.hfsdp else "no_shard",
            num_distributed_optimizer_instances=layout.outer,
        )
        model = TensorParallelGPT(layout.tp, self.tp_group if layout.tp > 1 else None, layout.sequence_parallel)
        self.module = MegatronCoreFSDP(model, index, config, fsdp_unit_modules=[TensorParallelMLPBlock])


def _instance_group(mesh: dist.DeviceMesh) -> dist.ProcessGroup | None:
    """This rank's distributed-optimizer instance (its slice of the outer dim), every rank
    creating every instance's group; None with one instance."""
    if mesh.size(0) == 1:
        return None
    mine = None
    for ranks in mesh.mesh.reshape(mesh.size(0), -1).tolist():
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def _optimizer(adapter: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(adapter.parameters(), lr=1e-2, weight_decay=0.1)


def _train_step(adapter: _Adapter, optimizer: torch.optim.Optimizer, step: int) -> tuple[float, float]:
    tokens, targets = make_batch(step)
    rows = slice(adapter.dp_rank * ROWS // adapter.dp, (adapter.dp_rank + 1) * ROWS // adapter.dp)
    loss = adapter.module(tokens[rows], targets[rows])
    loss.backward()
    finalize_model_grads(adapter, adapter.tp_group)
    norm = megatron_core_clip(optimizer, 0.5, adapter.tp_group, adapter.instance_group)
    optimizer.step()
    adapter.module.param_and_grad_buffer.copy_main_weights_to_model_weights()
    adapter.module.zero_grad_buffer()
    total = loss.detach().clone()
    dist.all_reduce(total)  # every tensor-parallel rank holds the same loss
    return total.item() / dist.get_world_size(), norm


def _resume(layout: Layout, checkpoint_dir: str) -> list[tuple[float, float]]:
    """Fresh objects loading the checkpoint as megatron-core does, then the steps after the save."""
    adapter = _Adapter(layout)
    optimizer = _optimizer(adapter)
    load_fsdp_dtensor(adapter, optimizer, checkpoint_dir, gated=True)
    return [_train_step(adapter, optimizer, step) for step in range(SAVED_AT, STEPS)]


def _same_name(name: str) -> str:
    return name


def _flow(rank: int, world_size: int, checkpoint_dir: str, layout: Layout) -> dict:
    handles = install_piece_steps()  # what install() puts: the optimizer steps the plain pieces
    try:
        adapter = _Adapter(layout)
        optimizer = _optimizer(adapter)
        history = [_train_step(adapter, optimizer, step) for step in range(SAVED_AT)]
        dcp.save(fsdp_dtensor_state(adapter, optimizer, gated=True), checkpoint_id=checkpoint_dir)
        saved_fc1, fc1_piece_starts = fc1_at_save(adapter.module.state_dict(), _same_name, HIDDEN)
        history += [_train_step(adapter, optimizer, step) for step in range(SAVED_AT, STEPS)]
        state = adapter.module.state_dict()
        full = {k.removeprefix("module."): v.full_tensor() for k, v in state.items()}
        placements = {k.removeprefix("module."): tuple(v.placements) for k, v in state.items()}
        return {
            "history": history,
            "full": full,
            "placements": placements,
            "saved_fc1": saved_fc1,
            "fc1_piece_starts": fc1_piece_starts,
            "same_sizes": _resume(layout, checkpoint_dir),
            "dp4": _resume(Layout(outer=1, dp=4, tp=1), checkpoint_dir),
        }
    finally:
        for handle in handles:
            handle.remove()


def _reference() -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    model = TensorParallelGPT()
    return one_process_run(model, _optimizer(model), make_batch, STEPS)


LAYOUTS = {
    "tp2-dp2": Layout(outer=1, dp=2, tp=2),
    "tp2-dp2-sequence-parallel": Layout(outer=1, dp=2, tp=2, sequence_parallel=True),
    # ZeRO-1: whole weights, the optimizer's main weights and state in flat pieces.
    "tp2-dp2-optim": Layout(outer=1, dp=2, tp=2, strategy="optim"),
    # --num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim with TP2.
    "hfsdp2-tp2": Layout(outer=2, dp=1, tp=2, hfsdp=True),
    # HSDP with one rank a shard group: every rank holds whole buckets (the strided fc1's face is
    # then not flat-sharded, yet keeps its rows' layout).
    "hsdp2-tp2": Layout(outer=2, dp=1, tp=2),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_parallel_blocks_train_checkpoint_and_reshard_like_one_process(name, tmp_path):
    layout = LAYOUTS[name]
    results = run_distributed(_flow, 4, str(tmp_path / "ckpt"), layout)
    reference, reference_params = _reference()
    ours = results[0]
    assert all(r["history"] == ours["history"] for r in results), "ranks disagree on the loss or the norm"
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours["history"], reference)):
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), f"step {step}: loss {loss} vs one process {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=1e-5), f"step {step}: grad norm {norm} vs one process {ref_norm}"
    # Checkpoints and state dicts hold the global tensors, split as megatron-core splits them.
    assert ours["full"].keys() == reference_params.keys()
    for name, expected in reference_params.items():
        torch.testing.assert_close(ours["full"][name], expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert ours["placements"]["blocks.0.mlp.linear_fc1.weight"][-1] == torch.distributed.tensor.Shard(0)
    assert ours["placements"]["blocks.0.fc2_weight"][-1] == torch.distributed.tensor.Shard(1)
    assert ours["placements"]["blocks.0.fc2_bias"][-1] == torch.distributed.tensor.Replicate()
    # --swiglu: the strided fc1 saved as Megatron-LM's gate and up halves.
    assert_saved_as_gated_halves(str(tmp_path / "ckpt"), ours["saved_fc1"])
    if layout.dp > 1 or layout.hfsdp:
        # Flat-sharded over data-parallel ranks: a piece starts inside a row of the gated fc1.
        assert any(start for r in results for start in r["fc1_piece_starts"]), [r["fc1_piece_starts"] for r in results]
    continued = ours["history"][SAVED_AT:]
    assert ours["same_sizes"] == continued, f"resumed {ours['same_sizes']} vs continued {continued}"
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours["dp4"], continued), start=SAVED_AT):
        assert math.isclose(loss, ref_loss, rel_tol=1e-6), f"step {step} at TP1 x DP4: loss {loss} vs {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=1e-6), f"step {step} at TP1 x DP4: norm {norm} vs {ref_norm}"


def _wrap_with_strided_split(rank: int, world_size: int) -> str:
    model = TensorParallelGPT()
    model.blocks[0].fc2_weight.partition_stride = 2  # along its partition_dim 1
    mesh = dist.init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp_cp", "tp"))
    index = megatron_fsdp.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp_cp", tp_dim="tp")
    return strided_split_refusal(model, index, TensorParallelMLPBlock)


def test_a_strided_split_along_another_dim_than_rows_is_refused_on_every_rank():
    for message in run_distributed(_wrap_with_strided_split, 2):
        assert "partition_stride=2 along partition_dim 1" in message and "equal row blocks" in message, message
