"""What FSDP2 programs do to a module sharded in place, compared with torch's own FSDP2 on the
same model, data and seed (gloo world 2):

- build on the meta device, shard, ``to_empty()``, then the module's own init writes the pieces;
- a chunked loss: the model's forward stops before the head (an attribute written on the
  returned module says so), and the loss calls the separately sharded head once per chunk,
  outside the model's forward; also with the head gathered by hand (``unshard``), kept through
  forward and backward (``set_reshard_after_forward/backward(False)``) and resharded by hand; and
  with the final norm and the head sharded as one group (``fully_shard([norm, head])``);
- a module's own state-dict hooks (a fused QKV weight saved as three and fused back on load) see
  full-shape parameters: the same keys and values as FSDP2's, through a DCP save and load.

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


def _train(
    fully_shard, rank: int, world: int, on_meta: bool, chunked: bool, explicit: bool = False, grouped: bool = False
) -> dict:
    """``explicit``: the head is gathered once by hand and kept through the chunks' forwards and
    backward, then resharded by hand (torchtitan-style loss wrappers do that). ``grouped``: the
    final norm (run by the model's forward) and the head (run by the loss) are one unit,
    ``fully_shard([norm, head])``."""
    torch.manual_seed(0)
    with torch.device("meta" if on_meta else "cpu"):
        model = ChunkedHeadGPT(tie=False)
    for block in model.blocks:
        fully_shard(block)
    if grouped:
        assert fully_shard([model.norm, model.head]) == [model.norm, model.head]
    elif chunked:
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
        ("final norm and chunked head as one group", {"on_meta": False, "chunked": True, "grouped": True}),
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


class FusedQKV(nn.Module):
    """torchtitan's fused attention projection: one ``wqkv`` weight, saved and loaded as ``wq``,
    ``wk``, ``wv`` by the module's own state-dict hooks."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.wqkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden)
        self.register_state_dict_post_hook(_split_qkv)
        self.register_load_state_dict_pre_hook(_fuse_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        return x + self.out(torch.tanh(q * k) + v)


def _split_qkv(module: nn.Module, state_dict: dict, prefix: str, local_metadata: object) -> None:
    fused = state_dict.pop(prefix + "wqkv.weight")
    for name, part in zip("qkv", fused.chunk(3, dim=0)):
        state_dict[f"{prefix}w{name}.weight"] = part


def _fuse_qkv(module: nn.Module, state_dict: dict, prefix: str, *unused: object) -> None:
    keys = [f"{prefix}w{name}.weight" for name in "qkv"]
    if all(key in state_dict for key in keys):
        state_dict[prefix + "wqkv.weight"] = torch.cat([state_dict.pop(key) for key in keys], dim=0)


def _fused_qkv_state_dicts(fully_shard, rank: int) -> dict:
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    def full_state_dict() -> dict[str, torch.Tensor]:
        return {key: value.full_tensor() for key, value in model.state_dict().items()}

    torch.manual_seed(0)
    model = nn.Sequential(FusedQKV(10), FusedQKV(10), nn.Linear(10, 3))
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    # model.state_dict(), as torchtitan's checkpointer reads it: torch's get_model_state_dict
    # refuses keys that name no attribute (wq), under FSDP2 as here.
    full = full_state_dict()
    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory)
    dcp.save(model.state_dict(), checkpoint_id=directory[0])
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    loaded = model.state_dict()
    dcp.load(loaded, checkpoint_id=directory[0])
    model.load_state_dict(loaded)
    after = full_state_dict()
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(rank))
    return {"full": full, "after load": after, "output": model(x).detach()}


def _fused_qkv_against_fsdp2(rank: int, world: int) -> dict:
    from megatron_fsdp.fsdp2 import fully_shard

    return {"ours": _fused_qkv_state_dicts(fully_shard, rank), "fsdp2": _fused_qkv_state_dicts(torch_fully_shard, rank)}


def test_a_modules_own_state_dict_hooks_see_full_shape_parameters_as_under_fsdp2() -> None:
    for rank, found in enumerate(run_distributed(_fused_qkv_against_fsdp2, 2)):
        ours, fsdp2 = found["ours"], found["fsdp2"]
        assert sorted(ours["full"]) == sorted(fsdp2["full"]) and "0.wq.weight" in ours["full"], sorted(ours["full"])
        for key, value in fsdp2["full"].items():
            assert torch.equal(ours["full"][key], value), (rank, key)
            assert torch.equal(ours["after load"][key], value), (rank, key, "after a DCP save and load")
        assert torch.equal(ours["output"], fsdp2["output"]), rank
