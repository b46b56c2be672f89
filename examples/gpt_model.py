"""A GPT in the Llama style: RMSNorm, fused QKV, causal SDPA attention, SwiGLU MLP, untied head.

Shared by examples/train_gpt.py and benchmarks/, so every implementation trains the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    seq_len: int = 128
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    ffn: int = 352


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.attn_norm = nn.RMSNorm(config.hidden)
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=False)
        self.out = nn.Linear(config.hidden, config.hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(config.hidden)
        self.gate_up = nn.Linear(config.hidden, 2 * config.ffn, bias=False)
        self.down = nn.Linear(config.ffn, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(batch, seq, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, seq, hidden))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.pos = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def training_flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """Model FLOPs of one training token (forward + backward): 6 per matmul weight plus the
    causal attention scores and weighted sums."""
    per_layer = 4 * config.hidden * config.hidden + 3 * config.hidden * config.ffn
    weights = config.layers * per_layer + config.hidden * config.vocab_size
    attention = 12 * config.layers * config.hidden * seq_len // 2
    return 6 * weights + attention


def gpt(**sizes: int) -> GPT:
    """A GPT of the given :class:`GPTConfig` sizes: what ``python -m megatron_fsdp.plan_memory
    --model examples/gpt_model.py:gpt --model-kwargs '{"layers": 24, ...}'`` plans."""
    return GPT(GPTConfig(**sizes))
