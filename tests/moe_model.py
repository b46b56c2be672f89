"""A small mixture-of-experts transformer whose experts can be split over an expert-parallel
group, as Megatron-Core and torch-native MoE models do: each rank holds ``EXPERTS / ep`` experts
as a DTensor ``Shard(0)`` slice of grouped expert weights (marked ``allreduce = False``), and
tokens travel to their expert's rank and back by all-to-all. With a 2-D ("ep", "etp") expert
mesh the experts are also tensor-parallel: their hidden dim is split over "etp" (column- then
row-parallel, Megatron's expert tensor parallelism), whose ranks see the same tokens and sum
their partial outputs. Without a mesh, every expert is local: the single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from models import HIDDEN, SEQ, VOCAB

EXPERTS, EXPERT_FFN = 4, 12


class SumOverGroup(torch.autograd.Function):
    """Forward: the sum of every rank's partial output; backward: the gradient as it is (each
    rank's partial output contributed to the sum once)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SharedInput(torch.autograd.Function):
    """Forward: the input as it is; backward: the sum of every rank's gradient (each rank used
    the same input with its own slice of the weights)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class ExpertParallelMoE(nn.Module):
    """Top-1 routing; the output is the chosen expert's output scaled by its router weight."""

    def __init__(self, expert_mesh: DeviceMesh | None) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        w_in = torch.randn(EXPERTS, HIDDEN, EXPERT_FFN) * 0.3
        w_out = torch.randn(EXPERTS, EXPERT_FFN, HIDDEN) * 0.3
        self.expert_mesh = expert_mesh
        tensor_parallel = expert_mesh is not None and expert_mesh.ndim == 2
        self.ep_mesh = expert_mesh["ep"] if tensor_parallel else expert_mesh
        self.etp_group = expert_mesh["etp"].get_group() if tensor_parallel else None
        self.w_in = self._expert_param(w_in, ffn_dim=2)
        self.w_out = self._expert_param(w_out, ffn_dim=1)

    def _expert_param(self, grouped: torch.Tensor, ffn_dim: int) -> nn.Parameter:
        if self.expert_mesh is None:
            return nn.Parameter(grouped)
        local = grouped.chunk(self.ep_mesh.size())[self.ep_mesh.get_local_rank()]
        placements: list[Placement] = [Shard(0)]
        if self.etp_group is not None:
            etp = self.expert_mesh["etp"]
            local = local.chunk(etp.size(), dim=ffn_dim)[etp.get_local_rank()]
            placements.append(Shard(ffn_dim))
        param = nn.Parameter(DTensor.from_local(local.clone(), self.expert_mesh, placements, run_check=False))
        param.allreduce = False
        return param

    def _local_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.expert_mesh is None:
            return self.w_in, self.w_out
        return self.w_in.to_local(), self.w_out.to_local()

    def _experts(self, tokens: torch.Tensor, expert: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
        # Every local expert on every token, then each token's own: tiny sizes, simple autograd.
        if self.etp_group is not None:
            tokens = _SharedInput.apply(tokens, self.etp_group)
        hidden = F.gelu(torch.einsum("nh,ehf->nef", tokens, w_in))
        every = torch.einsum("nef,efh->neh", hidden, w_out)
        chosen = every[torch.arange(tokens.shape[0]), expert]
        return chosen if self.etp_group is None else SumOverGroup.apply(chosen, self.etp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, HIDDEN)
        gate, expert = F.softmax(self.router(tokens), dim=-1).max(dim=-1)
        w_in, w_out = self._local_experts()
        if self.ep_mesh is None:
            out = self._experts(tokens, expert, w_in, w_out)
        else:
            out = self._dispatch_and_combine(tokens, expert, w_in, w_out)
        return (gate.unsqueeze(-1) * out).reshape(x.shape)

    def _dispatch_and_combine(self, tokens, expert, w_in, w_out) -> torch.Tensor:
        group = self.ep_mesh.get_group()
        per_rank = w_in.shape[0]
        order = torch.argsort(expert, stable=True)
        send_counts = torch.bincount(expert // per_rank, minlength=self.ep_mesh.size())
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        arrived_ids = torch.empty(sum(recv), dtype=expert.dtype)
        dist.all_to_all_single(arrived_ids, expert[order].contiguous(), recv, send, group=group)
        arrived = dist_fn.all_to_all_single(
            tokens.new_empty(sum(recv), HIDDEN), tokens[order].contiguous(), recv, send, group=group
        )
        computed = self._experts(arrived, arrived_ids % per_rank, w_in, w_out)
        returned = dist_fn.all_to_all_single(tokens.new_empty(tokens.shape[0], HIDDEN), computed, send, recv, group=group)
        return torch.empty_like(returned).index_copy(0, order, returned)


class MoEBlock(nn.Module):
    def __init__(self, expert_mesh: DeviceMesh | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.moe = ExpertParallelMoE(expert_mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm(x))
        return x + self.moe(x)


class TinyMoE(nn.Module):
    def __init__(self, expert_mesh: DeviceMesh | None = None, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.blocks = nn.ModuleList(MoEBlock(expert_mesh) for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_moe(expert_mesh: DeviceMesh | None = None, seed: int = 0) -> TinyMoE:
    """``expert_mesh``: None (every expert local), a 1-D expert-parallel mesh, or a 2-D
    ("ep", "etp") mesh for expert- and expert-tensor-parallelism."""
    torch.manual_seed(seed)
    return TinyMoE(expert_mesh)
