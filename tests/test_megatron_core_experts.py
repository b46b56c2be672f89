"""megatron-core's expert parallelism on megatron_fsdp, without megatron-core: each rank holds
its ``EXPERTS / ep`` local experts as plain modules ``mlp.experts.local_experts.<i>`` marked
``allreduce = False`` (megatron-core's SequentialMLP), wrapped by :class:`MegatronCoreFSDP` with
megatron-core's dense and expert meshes, and checkpointed as Megatron-LM writes fsdp_dtensor: its
local experts renamed to their global index (``handle_experts_in_state_dict``). Training against
one process holding every expert; the checkpoint resumed at EP2 x EDP2 and resharded to EP1 x DP4.

Experts see the tokens of their expert-parallel group: gathered along the sequence, every local
expert runs on the tokens routed to it, and the outputs are summed and scattered back.
Tolerances as in tests/test_megatron_core_tensor_parallel.py (fp32: 1e-5 against one process,
a resume bit-equal at the same sizes, 1e-6 resharded).
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from _dist import run_distributed
from mcore_flow import GatherSequence, ReduceScatterSequence, fsdp_dtensor_state, load_fsdp_dtensor, megatron_core_clip

import megatron_fsdp
from megatron_fsdp.integrations.mcore_fsdp import MegatronCoreFSDP
from megatron_fsdp.integrations.piece_steps import install_piece_steps

VOCAB, HIDDEN, FFN, SEQ, ROWS, EXPERTS = 37, 20, 14, 6, 4, 4
STEPS, SAVED_AT = 5, 3
LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.linear_fc2 = nn.Linear(FFN, HIDDEN, bias=False)
        for param in self.parameters():
            param.allreduce = False  # megatron-core's mark: reduced over the expert data-parallel group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Experts(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(Expert() for _ in range(count))


class MoELayer(nn.Module):
    """Top-1 routing over ``EXPERTS`` experts, this rank holding ``EXPERTS / ep`` of them."""

    def __init__(self, ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.ep_group = ep_group
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.first_expert = (dist.get_rank(ep_group) if ep_group is not None else 0) * EXPERTS // ep
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.mlp.experts = Experts(EXPERTS // ep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.ep_group is not None:
            h = GatherSequence.apply(h, self.ep_group)
        gate, chosen = F.softmax(self.mlp.router(h), dim=-1).max(dim=-1)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.mlp.experts.local_experts):
            routed = (chosen == self.first_expert + index).unsqueeze(-1)
            out = out + routed * expert(h)
        out = gate.unsqueeze(-1) * out
        if self.ep_group is not None:
            out = ReduceScatterSequence.apply(out, self.ep_group)
        return x + out


class MoEGPT(nn.Module):
    def __init__(self, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(MoELayer(ep_group) for _ in range(2))
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.first_expert = self.decoder.layers[0].first_expert
        self.load_local_experts_of(_full_initial_weights())

    def load_local_experts_of(self, full: dict[str, torch.Tensor]) -> None:
        """Every parameter from the full model's, local experts from their global index's."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(full[global_expert_name(name, self.first_expert)])

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.decoder.layers:
            x = layer(x)
        return F.cross_entropy(self.output(x).reshape(-1, VOCAB), targets.reshape(-1))


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
            shapes[prefix + f"mlp.experts.local_experts.{expert}.linear_fc1.weight"] = (FFN, HIDDEN)
            shapes[prefix + f"mlp.experts.local_experts.{expert}.linear_fc2.weight"] = (HIDDEN, FFN)
    shapes["embedding.weight"] = (VOCAB, HIDDEN)
    shapes["output.weight"] = (VOCAB, HIDDEN)
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) * 0.3 for name, shape in sorted(shapes.items())}


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2000 + step)
    data = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


class _Adapter(nn.Module):
    """megatron-core's FullyShardedDataParallel with its meshes: the dense ``(dp_cp, tp)`` over
    every rank, the expert ``(dp_cp, tp)`` over the ranks holding the same experts."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        world = dist.get_world_size()
        dense = dist.init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_cp", "tp"))
        expert = dist.init_device_mesh("cpu", (world // ep, ep, 1), mesh_dim_names=("dp_cp", "ep", "tp"))
        self.tp_group = dense["tp"].get_group()
        self.dp_rank = dist.get_rank()
        index = megatron_fsdp.FSDPDistributedIndex(
            device_mesh=dense, dp_shard_dim="dp_cp", tp_dim="tp", expt_device_mesh=expert["dp_cp", "tp"]
        )
        config = megatron_fsdp.DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True, overlap_param_gather=True
        )
        model = MoEGPT(expert["ep"].get_group() if ep > 1 else None)
        self.first_expert = model.first_expert
        self.module = MegatronCoreFSDP(model, index, config, fsdp_unit_modules=[MoELayer])

    def key(self, name: str) -> str:
        return global_expert_name(name, self.first_expert)


def _optimizer(adapter: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(adapter.module.parameters(), lr=1e-2, weight_decay=0.1)


def _train_step(adapter: _Adapter, optimizer: torch.optim.Optimizer, step: int) -> tuple[float, float]:
    tokens, targets = make_batch(step)
    rows = slice(adapter.dp_rank * ROWS // dist.get_world_size(), (adapter.dp_rank + 1) * ROWS // dist.get_world_size())
    loss = adapter.module(tokens[rows], targets[rows])
    loss.backward()
    adapter.module.finish_grad_sync()
    norm = megatron_core_clip(optimizer, 0.5, adapter.tp_group)
    optimizer.step()
    adapter.module.param_and_grad_buffer.copy_main_weights_to_model_weights()
    adapter.module.zero_grad_buffer()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size(), norm


def _resume(ep: int, checkpoint_dir: str) -> list[tuple[float, float]]:
    """As Megatron-LM loads fsdp_dtensor: DCP fills the renamed state's tensors in place, then the
    model loads its state dict under the local names."""
    adapter = _Adapter(ep)
    optimizer = _optimizer(adapter)
    load_fsdp_dtensor(adapter, optimizer, checkpoint_dir, adapter.key)
    return [_train_step(adapter, optimizer, step) for step in range(SAVED_AT, STEPS)]


def _flow(rank: int, world_size: int, checkpoint_dir: str) -> dict:
    handles = install_piece_steps()
    try:
        adapter = _Adapter(ep=2)
        optimizer = _optimizer(adapter)
        history = [_train_step(adapter, optimizer, step) for step in range(SAVED_AT)]
        dcp.save(fsdp_dtensor_state(adapter, optimizer, adapter.key), checkpoint_id=checkpoint_dir)
        history += [_train_step(adapter, optimizer, step) for step in range(SAVED_AT, STEPS)]
        return {"history": history, "same_sizes": _resume(2, checkpoint_dir), "ep1": _resume(1, checkpoint_dir)}
    finally:
        for handle in handles:
            handle.remove()


def _reference() -> list[tuple[float, float]]:
    model = MoEGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    history = []
    for step in range(STEPS):
        loss = model(*make_batch(step))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item()
        optimizer.step()
        optimizer.zero_grad()
        history.append((loss.item(), norm))
    return history


def test_local_experts_train_checkpoint_under_global_names_and_reshard_like_one_process(tmp_path):
    results = run_distributed(_flow, 4, str(tmp_path / "ckpt"))
    ours = results[0]
    assert all(r["history"] == ours["history"] for r in results), "ranks disagree on the loss or the norm"
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours["history"], _reference())):
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), f"step {step}: loss {loss} vs one process {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=1e-5), f"step {step}: grad norm {norm} vs one process {ref_norm}"
    continued = ours["history"][SAVED_AT:]
    assert ours["same_sizes"] == continued, f"resumed {ours['same_sizes']} vs continued {continued}"
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours["ep1"], continued), start=SAVED_AT):
        assert math.isclose(loss, ref_loss, rel_tol=1e-6), f"step {step} at EP1 x DP4: loss {loss} vs {ref_loss}"
        assert math.isclose(norm, ref_norm, rel_tol=1e-6), f"step {step} at EP1 x DP4: norm {norm} vs {ref_norm}"
