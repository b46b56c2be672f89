"""What FSDP2 programs do to a module sharded in place, compared with torch's own FSDP2 on the
same model, data and seed (gloo world 2):

- build on the meta device, shard, ``to_empty()``, then the module's own init writes the pieces;
- a chunked loss: the model's forward stops before the head (an attribute written on the
  returned module says so), and the loss calls the separately sharded head once per chunk,
  outside the model's forward; also with the head gathered by hand (``unshard``), kept through
  forward and backward (``set_reshard_after_forward/backward(False)``) and resharded by hand.

Tolerance 1e-6 relative, as tests/test_fsdp2_parity.py: both run the same fp32 math and sums
(measured: bit-identical); anything wrong in what the init wrote or in the head's gradients
(one chunk counted twice, or missed) is O(1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from _dist import run_distributed
from models import SEQ, VOCAB, TinyGPT, make_batch

STEPS, ROWS, CHUNKS, RTOL = 3, 2, 3, 1e-6


class ChunkedHeadGPT(TinyGPT):
    """torchtitan's shape: with ``skip_head`` set, forward returns the final hidden states."""

    skip_head = False

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if self.skip_head:
            return x
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))


def _chunked_loss(model: ChunkedHeadGPT, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    hidden = model(tokens).reshape(-1, model.norm.normalized_shape[0])
    flat_targets = targets.reshape(-1)
    total = sum(
        F.cross_entropy(model.head(h), t, reduction="sum")
        for h, t in zip(hidden.chunk(CHUNKS), flat_targets.chunk(CHUNKS))
    )
    return total / flat_targets.numel()


def _deterministic_init(model: nn.Module) -> None:
    """The modules' own init where it is deterministic (LayerNorm), distinct constants elsewhere."""
    for index, (name, param) in enumerate(model.named_parameters()):
        if "norm" not in name:
            nn.init.constant_(param, 0.02 * (1 + index % 7) * (-1) ** index)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()


def _train(fully_shard, rank: int, world: int, on_meta: bool, chunked: bool, explicit: bool = False) -> dict:
    """``explicit``: the head is gathered once by hand and kept through the chunks' forwards and
    backward, then resharded by hand (torchtitan-style loss wrappers do that)."""
    torch.manual_seed(0)
    with torch.device("meta" if on_meta else "cpu"):
        model = ChunkedHeadGPT(tie=False)
    for block in model.blocks:
        fully_shard(block)
    if chunked:
        fully_shard(model.head)
    fully_shard(model)
    if on_meta:
        model.to_empty(device="cpu")
        _deterministic_init(model)
    model.skip_head = chunked
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        tokens, targets = make_batch(step * world + rank, ROWS)
        if explicit:
            model.head.unshard()
            model.head.set_reshard_after_forward(False, recurse=False)
            model.head.set_reshard_after_backward(False, recurse=False)
        loss = _chunked_loss(model, tokens, targets) if chunked else model(tokens, targets)
        loss.backward()
        if explicit:
            model.head.set_reshard_after_forward(True, recurse=False)
            model.head.set_reshard_after_backward(True, recurse=False)
            model.head.reshard()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": {n: p.full_tensor() for n, p in model.named_parameters()}}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _against_fsdp2(rank: int, world: int) -> dict[str, float]:
    from megatron_fsdp.fsdp2 import fully_shard

    errors = {}
    cases = (
        ("meta init", {"on_meta": True, "chunked": False}),
        ("chunked head", {"on_meta": False, "chunked": True}),
        ("chunked head, gathered by hand", {"on_meta": False, "chunked": True, "explicit": True}),
    )
    for what, options in cases:
        ours = _train(fully_shard, rank, world, **options)
        theirs = _train(torch_fully_shard, rank, world, **options)
        errors[f"{what}: losses"] = _relative_error(ours["losses"], theirs["losses"])
        for name, value in theirs["params"].items():
            errors[f"{what}: {name}"] = _relative_error(ours["params"][name], value)
    return errors


def test_meta_init_after_sharding_and_a_head_called_per_chunk_match_fsdp2() -> None:
    for rank, errors in enumerate(run_distributed(_against_fsdp2, 2)):
        worst = {key: error for key, error in errors.items() if error > RTOL}
        assert not worst, f"rank {rank}: {worst}"
    assert SEQ * ROWS % CHUNKS == 0
