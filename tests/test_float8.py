"""torchao float8 training under megatron_fsdp: ``Float8Linear`` weights that ask for float8
all-gathers (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``) are cast once per step
from the main params and gathered as float8 bytes, and train as torchao does on one process.

The reference runs torchao on one process over each rank's micro-batch separately, its loss
the mean of theirs: torchao scales each activation by its own amax, so a single full batch
would quantise the activations differently from two half batches. The weights' float8 casts
are then the same bits on both sides (same fp32 values, same amax, same scale), and what
differs is the order of float32 sums (gradients summed across ranks, Adam on pieces); one
such rounding difference can move a weight across a float8 rounding boundary, so losses are
compared within 1e-4 relative (measured: see LOSS_RTOL), not bit for bit.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("torchao.float8")

from _dist import run_distributed  # noqa: E402

import megatron_fsdp  # noqa: E402

WORLD = 2
STEPS = 20
ROWS_PER_RANK = 4
# Measured on this model: bit-equal losses over 20 and 100 steps for every strategy (sums of
# two gradients halved round alike); the bound leaves room for another summation order (more
# ranks, other kernels) moving a weight across a float8 rounding boundary.
LOSS_RTOL = 1e-4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    """Float8Linear in the blocks (units); the input and output layers stay nn.Linear."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _float8_model(recipe: str, all_gather: bool = True) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Model()
    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=True)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
        config = Float8LinearConfig(**{**config.__dict__, "emulate": True})
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: name.startswith("blocks"))
    return model


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of this step and rank; targets from a fixed random teacher, so the loss can fall."""
    teacher = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    x = torch.randn(ROWS_PER_RANK, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, torch.tanh(x @ teacher)


@functools.cache
def _reference_losses(recipe: str, world: int) -> list[float]:
    """torchao on one process, each rank's micro-batch on its own, the loss their mean."""
    model = _float8_model(recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in (_batch(step, r) for r in range(world))) / world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded_losses(rank: int, world: int, recipe: str, strategy: str) -> list[float]:
    model = _float8_model(recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = megatron_fsdp.fully_shard(
        model, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy
    )
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def _losses_of_every_strategy(rank: int, world: int, recipe: str) -> dict[str, list[float]]:
    return {strategy: _sharded_losses(rank, world, recipe, strategy) for strategy in STRATEGIES}


@functools.cache
def _sharded_results(recipe: str) -> dict[str, list[float]]:
    """One run of the rank processes for every strategy: torchao's import costs each rank seconds."""
    return run_distributed(_losses_of_every_strategy, WORLD, recipe)[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float8_all_gather_trains_like_torchao_on_one_process(strategy: str) -> None:
    got = _sharded_results("tensorwise")[strategy]
    expected = _reference_losses("tensorwise", WORLD)
    errors = [abs(g - e) / abs(e) for g, e in zip(got, expected)]
    assert max(errors) <= LOSS_RTOL, f"{strategy}: worst relative loss error {max(errors):.2e}\n{got}\n{expected}"
    assert expected[-1] < 0.7 * expected[0], f"the reference did not train: {expected}"


def _gathered_bytes(rank: int, world: int, all_gather: bool) -> dict[str, int]:
    """Bytes and dtypes of every all-gather output during one forward under optim_grads_params,
    seen where torch.distributed's functions are called."""
    model = megatron_fsdp.fully_shard_model(
        _float8_model("tensorwise", all_gather), fsdp_unit_modules=[Block], zero_dp_strategy="optim_grads_params"
    )
    seen: dict[str, int] = {}
    c10d_file = dist.distributed_c10d.__file__

    def profile(frame, event, arg) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename == c10d_file and code.co_name in ("all_gather_single", "all_gather_into_tensor"):
            output = frame.f_locals[code.co_varnames[0]]
            key = str(output.dtype)
            seen[key] = seen.get(key, 0) + output.numel() * output.element_size()

    x, _ = _batch(0, rank)
    sys.setprofile(profile)
    try:
        model(x)
    finally:
        sys.setprofile(None)
    return seen


def test_float8_all_gather_carries_one_byte_per_weight_element() -> None:
    float8 = run_distributed(_gathered_bytes, WORLD, True)[0]
    plain = run_distributed(_gathered_bytes, WORLD, False)[0]
    block_weights = 2 * (64 * 128 + 128 * 64)  # the Float8Linear weights of both blocks
    # The blocks' biases stay in fp32 buckets; the float8 buckets gather as uint8, one byte each
    # (bucket padding: up to one alignment per bucket and rank).
    assert block_weights <= float8.get("torch.uint8", 0) <= block_weights + 2 * 2 * 128, float8
    assert plain.get("torch.uint8", 0) == 0, plain
    fp32_weights_saved = plain["torch.float32"] - float8["torch.float32"]
    assert fp32_weights_saved >= 4 * block_weights, (float8, plain)


def test_rowwise_recipe_trains_with_ordinary_gathers_and_says_why() -> None:
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("megatron_fsdp.engine.float8_weights")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        from megatron_fsdp.engine.float8_weights import prepare_float8_weights

        replaced = prepare_float8_weights(_float8_model("rowwise"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert replaced == {}
    assert len(records) == 1 and "rowwise" in records[0].getMessage(), [r.getMessage() for r in records]


def test_without_torchao_float8_is_a_clear_error_and_nothing_else_needs_it() -> None:
    """A subprocess in which importing torchao fails: sharding a plain model works and never
    imports it; a model holding a Float8Linear (made before torchao was hidden) is refused."""
    script = textwrap.dedent(
        """
        import sys, torch, importlib.abc
        from torch import nn
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        model = nn.Sequential(nn.Linear(32, 32))
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))
        for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
            del sys.modules[name]

        class HideTorchao(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "torchao" or name.startswith("torchao."):
                    raise ImportError("torchao hidden by the test")

        sys.meta_path.insert(0, HideTorchao())
        import torch.distributed as dist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        import megatron_fsdp
        megatron_fsdp.fully_shard_model(nn.Sequential(nn.Linear(8, 8)), fsdp_unit_modules=[nn.Linear])
        assert not any(n.startswith("torchao") for n in sys.modules), "torchao was imported"
        try:
            megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[nn.Linear])
        except ImportError as error:
            print("REFUSED:", error)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED:" in done.stdout and "torchao cannot be imported" in done.stdout, done.stdout + done.stderr[-2000:]
