"""A small mixture-of-experts transformer whose experts can be split over an expert-parallel
group, as Megatron-Core and torch-native MoE models do: each rank holds ``EXPERTS / ep`` experts
as a DTensor ``Shard(0)`` slice of grouped expert weights (marked ``allreduce = False``), and
tokens travel to their expert's rank and back by all-to-all. Without a group, every expert is
local: the single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from models import HIDDEN, SEQ, VOCAB

EXPERTS, EXPERT_FFN = 4, 12


class ExpertParallelMoE(nn.Module):
    """Top-1 routing; the output is the chosen expert's output scaled by its router weight."""

    def __init__(self, ep_mesh: DeviceMesh | None) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        w_in = torch.randn(EXPERTS, HIDDEN, EXPERT_FFN) * 0.3
        w_out = torch.randn(EXPERTS, EXPERT_FFN, HIDDEN) * 0.3
        self.ep_mesh = ep_mesh
        self.w_in = self._expert_param(w_in)
        self.w_out = self._expert_param(w_out)

    def _expert_param(self, grouped: torch.Tensor) -> nn.Parameter:
        if self.ep_mesh is None:
            return nn.Parameter(grouped)
        local = grouped.chunk(self.ep_mesh.size())[self.ep_mesh.get_local_rank()].clone()
        param = nn.Parameter(DTensor.from_local(local, self.ep_mesh, [Shard(0)], run_check=False))
        param.allreduce = False
        return param

    def _local_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ep_mesh is None:
            return self.w_in, self.w_out
        return self.w_in.to_local(), self.w_out.to_local()

    @staticmethod
    def _experts(tokens: torch.Tensor, expert: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
        # Every local expert on every token, then each token's own: tiny sizes, simple autograd.
        hidden = F.gelu(torch.einsum("nh,ehf->nef", tokens, w_in))
        every = torch.einsum("nef,efh->neh", hidden, w_out)
        return every[torch.arange(tokens.shape[0]), expert]

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
    def __init__(self, ep_mesh: DeviceMesh | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.moe = ExpertParallelMoE(ep_mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm(x))
        return x + self.moe(x)


class TinyMoE(nn.Module):
    def __init__(self, ep_mesh: DeviceMesh | None = None, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.blocks = nn.ModuleList(MoEBlock(ep_mesh) for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_moe(ep_mesh: DeviceMesh | None = None, seed: int = 0) -> TinyMoE:
    torch.manual_seed(seed)
    return TinyMoE(ep_mesh)
