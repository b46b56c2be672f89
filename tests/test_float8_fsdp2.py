"""torchao float8 training through FSDP2's front door, ``megatron_fsdp.fsdp2.fully_shard``, as
torchtitan and FSDP2 users write it: ``convert_to_float8_training(model, config=
Float8LinearConfig(enable_fsdp_float8_all_gather=True))``, ``fully_shard`` on each block and
then the root, and torchao's ``precompute_float8_dynamic_scale_for_fsdp(model)`` after each
optimizer step. The same engine float8 buckets as the whole-model API (tests/test_float8.py)
gather the weights as float8 bytes; compared with torch's own ``fully_shard`` over the same
converted model (torchao's FSDP2 extension gathers float8 there) and with torchao on one
process (tests/_float8_models.py says how that reference batches).

Both sharded runs cast the same fp32 weights with the same whole-tensor amax and scale, so
the float8 weights are the same bits; what may differ is the order of float32 gradient sums,
and one such rounding difference can move a weight across a float8 rounding boundary: losses
are compared within 1e-4 relative (measured: bit-equal, all three, over 20 steps).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchao.float8")

from _dist import run_distributed  # noqa: E402
from _float8_models import (  # noqa: E402
    BLOCK_WEIGHTS,
    STEPS,
    CountedCollectives,
    batch,
    dynamo_counts,
    float8_model,
    reference_losses,
    reset_dynamo,
    worst_relative_error,
)

WORLD = 2
LOSS_RTOL = 1e-4


def _train_per_block(
    rank: int, world: int, implementation: str, precompute: bool = True, bf16: bool = False, compiled: bool = False
) -> dict:
    """20 AdamW steps of a float8-converted model sharded per block, then at the root, by
    ``implementation``'s fully_shard ("ours" or "torch"), calling torchao's precompute after
    each step or not, computing in bf16 over fp32 parameters (torchtitan's mp_policy) or not,
    each block compiled after sharding (aot_eager: eager's kernels, so eager's losses) or not:
    the mean losses, what the forwards gathered, how many weights hold a scale torchao's
    precompute made, and the graphs and graph breaks dynamo made."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    if implementation == "ours":
        from megatron_fsdp.fsdp2 import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    model = float8_model("tensorwise")
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    reset_dynamo()
    if compiled:
        for block in model.blocks:
            block.compile(backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, forwards = [], CountedCollectives()
    for step in range(STEPS):
        x, y = batch(step, rank)
        with forwards:
            output = model(x)
        loss = nn.functional.mse_loss(output.float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    precomputed = sum(
        getattr(getattr(m.weight, "_local_tensor", None), "_precomputed_scale", None) is not None
        for m in model.blocks.modules()
        if type(m).__name__.endswith("Float8Linear")
    )
    return {"losses": losses, "gathered": forwards.gathered, "precomputed_scales": precomputed, **dynamo_counts()}


def _loss_after_writing_the_sharded_weights(rank: int, world: int) -> float:
    """The first loss of a model whose sharded parameters were halved in place after
    fully_shard (as an init after sharding on the meta device writes them)."""
    from megatron_fsdp.fsdp2 import fully_shard

    model = float8_model("tensorwise")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5)
    x, y = batch(0, rank)
    loss = nn.functional.mse_loss(model(x), y).detach()
    dist.all_reduce(loss)
    return loss.item() / world


def _both(rank: int, world: int) -> dict[str, dict]:
    return {
        "ours": _train_per_block(rank, world, "ours"),
        "ours without precompute": _train_per_block(rank, world, "ours", precompute=False),
        "torch": _train_per_block(rank, world, "torch"),
        "ours bf16": _train_per_block(rank, world, "ours", bf16=True),
        "torch bf16": _train_per_block(rank, world, "torch", bf16=True),
        "ours compiled": _train_per_block(rank, world, "ours", bf16=True, compiled=True),
        "halved after fully_shard": _loss_after_writing_the_sharded_weights(rank, world),
    }


@functools.cache
def _results() -> dict[str, dict]:
    """One run of the rank processes for both implementations: torchao's import costs each rank seconds."""
    return run_distributed(_both, WORLD)[0]


def test_per_block_fully_shard_trains_like_torch_fsdp2_and_torchao_on_one_process() -> None:
    ours, torchs = _results()["ours"]["losses"], _results()["torch"]["losses"]
    expected = reference_losses("tensorwise", WORLD)
    for name, got in (("megatron_fsdp.fsdp2", ours), ("torch's fully_shard", torchs)):
        error = worst_relative_error(got, expected)
        assert error <= LOSS_RTOL, f"{name} vs torchao on one process: {error:.2e}\n{got}\n{expected}"
    error = worst_relative_error(ours, torchs)
    assert error <= LOSS_RTOL, f"megatron_fsdp.fsdp2 vs torch's fully_shard: {error:.2e}\n{ours}\n{torchs}"
    assert expected[-1] < 0.7 * expected[0], f"the reference did not train: {expected}"


def test_bf16_compute_over_fp32_parameters_trains_like_torch_fsdp2() -> None:
    """torchtitan's mp_policy (param_dtype bf16, reduce_dtype fp32): both cast the fp32 sharded
    weights to float8 the same way, and compute the rest in bf16 alike (measured: bit-equal;
    the bound as above). Each forward still gathers the blocks' weights as one byte each."""
    ours, torchs = _results()["ours bf16"]["losses"], _results()["torch bf16"]["losses"]
    error = worst_relative_error(ours, torchs)
    assert error <= LOSS_RTOL, f"megatron_fsdp.fsdp2 vs torch's fully_shard, bf16: {error:.2e}\n{ours}\n{torchs}"
    assert ours[-1] < 0.7 * ours[0], ours
    gathered = _results()["ours bf16"]["gathered"]
    assert STEPS * BLOCK_WEIGHTS <= gathered.get("torch.uint8", 0) <= STEPS * (BLOCK_WEIGHTS + 2 * 2 * 128), gathered


def test_per_block_fully_shard_gathers_float8_weights_as_one_byte_each() -> None:
    """Each forward gathers both blocks' Float8Linear weights as uint8 (padding: up to one
    128-byte alignment per bucket and rank); the fp32 gathers hold only the biases, the input
    layer and the head."""
    gathered = _results()["ours"]["gathered"]
    assert STEPS * BLOCK_WEIGHTS <= gathered.get("torch.uint8", 0) <= STEPS * (BLOCK_WEIGHTS + 2 * 2 * 128), gathered
    others = 16 * 64 + 64 + 2 * (128 + 64) + 64 * 8 + 8  # embed, block biases, head (elements)
    assert gathered["torch.float32"] <= STEPS * 4 * (others + 3 * 2 * 32), gathered


def test_torchaos_precompute_after_the_step_is_a_no_op_over_our_float8_weights() -> None:
    """Our scales are made from the main params where the step installs them; torchao's
    precompute finds no weight of its own wrapper type under our DTensor faces and returns, so
    nothing is scaled twice: the losses with it called are those without, bit for bit (and
    equal torchao's above). Over torch's fully_shard the same call gives each of the four
    block weights a precomputed scale, so the call is a real one here."""
    results = _results()
    assert results["ours"]["losses"] == results["ours without precompute"]["losses"]
    assert results["ours"]["precomputed_scales"] == 0
    assert results["torch"]["precomputed_scales"] == 4


def test_weights_written_after_fully_shard_reach_the_float8_weights() -> None:
    """The root's first forward casts the float8 weights again from the main params, so values
    written between fully_shard and then count: equal torchao on one process over the halved
    weights (the same float8 bits: halving is exact, so each amax and scale halve too)."""
    model = float8_model("tensorwise")
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5)
    expected = sum(nn.functional.mse_loss(model(x), y).item() for x, y in (batch(0, r) for r in range(WORLD))) / WORLD
    got = _results()["halved after fully_shard"]
    assert abs(got - expected) <= LOSS_RTOL * expected, (got, expected)


def test_compiled_blocks_train_float8_like_eager_in_one_graph() -> None:
    """Each block compiled after sharding (torchtitan's float8 + compile recipe): one graph
    serves every block (no recompile per block, no graph break at the float8 weight), and the
    losses are eager's, as aot_eager runs eager's kernels."""
    compiled, eager = _results()["ours compiled"], _results()["ours bf16"]
    assert compiled["graph_breaks"] == 0, compiled
    assert compiled["graphs"] == 1, compiled
    assert compiled["losses"] == eager["losses"]
