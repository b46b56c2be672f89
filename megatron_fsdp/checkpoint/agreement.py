"""Agreeing across ranks on a problem that some rank found while reading a checkpoint.

A rank that raised alone would leave the others waiting in the next collective; instead each
rank passes what it found (or None) to :func:`first_problem_of_any_rank`, and every rank raises
the same error from its answer.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

Problem = TypeVar("Problem")


def first_problem_of_any_rank(problem: Problem | None) -> tuple[int, Problem] | None:
    """``(rank, problem)`` of the lowest rank that found one, the same on every rank, or None
    when none did; a collective. One small all-reduce in the common case (nothing found); the
    problems travel only when there are some."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    found_any = torch.tensor([problem is not None], dtype=torch.int32, device=device)
    dist.all_reduce(found_any, op=dist.ReduceOp.MAX)
    if not found_any.item():
        return None
    problems: list[Problem | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    rank = next(r for r, p in enumerate(problems) if p is not None)
    return rank, problems[rank]
