"""The models of upstream megatron-fsdp's fully_shard tests, small and deterministic: a CNN
sharded by its Conv2d and Linear modules, and ``torch.nn.Transformer`` as one unit (dropout off,
so a sharded run and a single process see the same function)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

CHANNELS, SIZE, CNN_LAYERS = 3, 5, 2
D_MODEL, HEADS, FFN, OUT, SEQ = 8, 2, 12, 3, 4


class ToyCNN(nn.Module):
    """Convolutions keeping (channels, height, width), then a per-pixel Linear to one value."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn_layers = nn.ModuleList(nn.Conv2d(CHANNELS, CHANNELS, 3, padding="same") for _ in range(CNN_LAYERS))
        self.dense = nn.Linear(CHANNELS, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.cnn_layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(self.dense(x.permute(0, 2, 3, 1)).squeeze(-1), target)


class ToyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():  # its advice on nested tensors concerns inference speed
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            self.transformer = self._transformer()
        self.fc_out = nn.Linear(D_MODEL, OUT)

    @staticmethod
    def _transformer() -> nn.Transformer:
        return nn.Transformer(
            d_model=D_MODEL, nhead=HEADS, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=FFN, dropout=0.0
        )

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # (sequence, batch, feature), torch.nn.Transformer's default layout
        return F.mse_loss(self.fc_out(self.transformer(x, x)), target)


def build(kind: str, seed: int = 0, meta: bool = False, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, list[type]]:
    """The model (built on the meta device with ``meta``) and its FSDP unit classes."""
    torch.manual_seed(seed)
    with torch.device("meta") if meta else torch.device("cpu"):
        model, units = (ToyCNN(), [nn.Conv2d, nn.Linear]) if kind == "cnn" else (ToyTransformer(), [nn.Transformer])
    return model.to(dtype), units


def batch(kind: str, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` samples of step ``step``: inputs and targets, the batch dim first for the CNN and
    second for the Transformer."""
    generator = torch.Generator().manual_seed(500 + step)
    if kind == "cnn":
        return torch.randn(rows, CHANNELS, SIZE, SIZE, generator=generator), torch.randn(rows, SIZE, SIZE, generator=generator)
    return torch.randn(SEQ, rows, D_MODEL, generator=generator), torch.randn(SEQ, rows, OUT, generator=generator)


def batch_in(kind: str, step: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`batch` in the model's dtype (the loss is computed in it too)."""
    return tuple(t.to(dtype) for t in batch(kind, step, rows))


def rows_of(kind: str, data: tuple[torch.Tensor, torch.Tensor], start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    dim = 0 if kind == "cnn" else 1
    return tuple(t.narrow(dim, start, count) for t in data)
