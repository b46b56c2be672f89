"""The smallest transformer that exercises every path: units, a non-unit root (embeddings,
final norm, head), a head tied to the embedding, optional frozen parameters and a block called
twice. Sizes are odd on purpose so parameters straddle shard boundaries."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, HEADS, FFN, SEQ = 37, 20, 2, 52, 9


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN)
        # No qkv bias: softmax ignores a key bias, whose exact gradient is then zero and whose
        # rounding noise Adam would blow up into full-size updates.
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, HIDDEN // HEADS).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, HIDDEN))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 2, tie: bool = True, frozen: bool = False, reuse_last_block: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        if frozen:
            # A frozen piece inside a unit (one block's first norm) and at the root (final norm).
            self.blocks[0].norm1.requires_grad_(False)
            self.norm.bias.requires_grad_(False)
        self.reuse_last_block = reuse_last_block

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.reuse_last_block:
            x = self.blocks[-1](x)
        logits = self.head(self.norm(x))
        # The loss in fp32 at least (a bf16 model's in fp32, a float64 model's in float64).
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int, steps: range) -> None:
    """One optimizer step per ``steps`` entry, each rank on its rows of make_batch(step, 2 * world)."""
    for step in steps:
        tokens, targets = make_batch(step, 2 * world)
        model(tokens[rank::world], targets[rank::world]).backward()
        optimizer.step()
        optimizer.zero_grad()


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **options) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**options).to(dtype)
