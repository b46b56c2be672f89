"""The float8 tests' model, batches and single-process torchao reference (tests/test_float8.py,
tests/test_float8_fsdp2.py): two blocks of torchao ``Float8Linear`` layers (emulated, so the
float8 matmuls run in fp32 on CPU) between an input and an output ``nn.Linear``.

The reference runs torchao on one process over each rank's micro-batch separately, its loss
the mean of theirs: torchao scales each activation by its own amax, so a single full batch
would quantise the activations differently from two half batches.
"""

from __future__ import annotations

import contextlib
import functools
from types import FrameType

import torch
from parity import watching_collectives
from torch import nn

STEPS = 20
ROWS_PER_RANK = 4


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


# The Float8Linear weights of both blocks, in elements.
BLOCK_WEIGHTS = 2 * (64 * 128 + 128 * 64)


def float8_model(recipe: str, all_gather: bool = True) -> nn.Module:
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


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of this step and rank; targets from a fixed random teacher, so the loss can fall."""
    teacher = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    x = torch.randn(ROWS_PER_RANK, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, torch.tanh(x @ teacher)


# AdamW, and an optimizer that megatron_fsdp's host ops do not implement, so that torch's own
# step runs over offloaded pieces too (the ops' Adam rounds differently in the last bit).
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3),
}


@functools.cache
def reference_losses(recipe: str, world: int, optimizer_name: str = "adamw") -> list[float]:
    """torchao on one process, each rank's micro-batch on its own, the loss their mean."""
    model = float8_model(recipe)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    losses = []
    for step in range(STEPS):
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in (batch(step, r) for r in range(world))) / world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def worst_relative_error(got: list[float], expected: list[float]) -> float:
    return max(abs(g - e) / abs(e) for g, e in zip(got, expected, strict=True))


class CountedCollectives:
    """While open: torch.distributed's collective calls on this thread (counted as tests/parity.py
    counts them) and the bytes of every all-gather output by dtype."""

    def __init__(self) -> None:
        self.calls = 0
        self.gathered: dict[str, int] = {}
        self._watching: contextlib.AbstractContextManager | None = None

    def _count(self, name: str, frame: FrameType) -> None:
        self.calls += 1
        if name in ("all_gather_single", "all_gather_into_tensor"):
            output = frame.f_locals[frame.f_code.co_varnames[0]]
            key = str(output.dtype)
            self.gathered[key] = self.gathered.get(key, 0) + output.numel() * output.element_size()

    def __enter__(self) -> CountedCollectives:
        self._watching = watching_collectives(self._count)
        self._watching.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._watching.__exit__(*exc)


def reset_dynamo() -> None:
    """Forget compiled code and dynamo's counters, so a run counts only its own graphs."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def dynamo_counts() -> dict[str, int]:
    """The graphs dynamo made and the graph breaks it met since :func:`reset_dynamo`."""
    import torch._dynamo

    counters = torch._dynamo.utils.counters
    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
