"""init_model_with_meta_device: a meta-built model is materialised and sharded unit by unit,
with the weights a normally built model gets from the same seed, and without ever holding more
than the root and one unit unsharded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import megatron_fsdp
from _dist import run_distributed
from models import VOCAB, Block


def _stack(layers: int) -> nn.Sequential:
    """Every parameter belongs to a module with reset_parameters(), built in registration order."""
    return nn.Sequential(nn.Embedding(VOCAB, 20), *[Block() for _ in range(layers)], nn.LayerNorm(20), nn.Linear(20, VOCAB))


def _meta_init(rank: int, world: int, layers: int, strategy: str) -> dict:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _stack(layers)
    model = megatron_fsdp.fully_shard_model(
        model, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, init_model_with_meta_device=True, device="cpu"
    )
    return {"params": model.full_parameters(), "peak": model.meta_init_peak_bytes}


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_meta_init_gives_the_weights_of_a_normal_build_with_the_same_seed(strategy: str) -> None:
    torch.manual_seed(0)
    expected = dict(_stack(3).named_parameters())
    for result in run_distributed(_meta_init, 2, 3, strategy):
        assert result["params"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(result["params"][name], value.detach()), name


def test_meta_init_peak_is_the_root_and_one_unit_whatever_the_depth() -> None:
    shallow = run_distributed(_meta_init, 2, 2, "optim_grads_params")[0]["peak"]
    deep = run_distributed(_meta_init, 2, 8, "optim_grads_params")[0]["peak"]
    block_bytes = sum(p.numel() * 4 for p in Block().parameters())
    root_bytes = sum(p.numel() * 4 for m in (nn.Embedding(VOCAB, 20), nn.LayerNorm(20), nn.Linear(20, VOCAB)) for p in m.parameters())
    assert deep == shallow, f"peak grew with depth: {shallow} -> {deep} bytes"
    assert deep <= root_bytes + block_bytes, f"peak {deep} B is more than the root ({root_bytes} B) and one block ({block_bytes} B)"
    total = root_bytes + 8 * block_bytes
    assert deep < total / 3, "the 8-block model was never whole"


class _RawParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_meta_init_refuses_modules_it_cannot_initialise(single_rank_group) -> None:
    with torch.device("meta"):
        model = nn.Sequential(Block(), _RawParameter())
    with pytest.raises(ValueError, match=r"module 1 \(_RawParameter\) holds meta tensors but has no reset_parameters"):
        megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Block], init_model_with_meta_device=True)
    with torch.device("meta"):
        model = nn.Sequential(Block())
    with pytest.raises(ValueError, match="pass init_model_with_meta_device=True"):
        megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Block])


class _AttentionBlock(nn.Module):
    """nn.MultiheadAttention initialises itself with _reset_parameters() after building its
    out_proj, whose bias it zeroes: meta init must call it, after out_proj's own init."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(20, 4, batch_first=True)
        self.mlp = nn.Linear(20, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.attention(x, x, x, need_weights=False)[0])


def _attention_stack() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(VOCAB, 20), _AttentionBlock(), _AttentionBlock(), nn.Linear(20, VOCAB))


def _meta_init_attention(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _attention_stack()
    model = megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[_AttentionBlock], init_model_with_meta_device=True, device="cpu")
    return model.full_parameters()


def test_meta_init_calls_reset_parameters_or_underscore_reset_parameters_children_first() -> None:
    torch.manual_seed(0)
    expected = dict(_attention_stack().named_parameters())
    assert torch.count_nonzero(expected["1.attention.out_proj.bias"]) == 0
    for params in run_distributed(_meta_init_attention, 2):
        assert params.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(params[name], value.detach()), name


def _meta_init_partly_real(rank: int, world: int) -> dict:
    """Megatron-LM may build some modules outside the meta context: those keep their values."""
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, 20)
    with torch.device("meta"):
        model = _stack(2)
    model[0] = embedding
    before = embedding.weight.detach().clone()
    model = megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Block], init_model_with_meta_device=True, device="cpu")
    return {"params": model.full_parameters(), "embedding": before}


def test_meta_init_keeps_parameters_already_on_a_device() -> None:
    for result in run_distributed(_meta_init_partly_real, 2):
        assert torch.equal(result["params"]["0.weight"], result["embedding"])
        assert all(torch.isfinite(value).all() for value in result["params"].values())


def _meta_init_torch_transformer(rank: int, world: int) -> list[float]:
    """Upstream's scenario: torch.nn.Transformer built on the meta device (its attention layers
    initialise through _reset_parameters()), sharded per encoder and decoder layer, trains."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64)
    units = [nn.TransformerEncoderLayer, nn.TransformerDecoderLayer]
    model = megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=units, init_model_with_meta_device=True, device="cpu")
    optimizer = megatron_fsdp.fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)
    generator = torch.Generator().manual_seed(rank)
    source, target = torch.randn(5, 2, 32, generator=generator), torch.randn(4, 2, 32, generator=generator)
    losses = []
    for _ in range(3):
        loss = model(source, target).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_meta_init_of_torch_transformer_trains() -> None:
    for losses in run_distributed(_meta_init_torch_transformer, 2):
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
