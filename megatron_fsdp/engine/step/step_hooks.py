"""The hooks that drive a :class:`~megatron_fsdp.engine.step.schedule.StepScheduler` from a model's
forward and backward: a forward pre-hook and hook on each unit's module, a pre-backward hook on
each unit's outputs, and a post-accumulate-grad hook on each trainable parameter.

Both front doors install these: the whole-model wrapper (``MegatronFSDP``) and FSDP2's in-place
``megatron_fsdp.fsdp2.fully_shard``. They gather, reshard and re-point parameters through the C++
pool and collectives: under ``torch.compile`` they run eagerly between graphs (a graph break at
each unit boundary) instead of being traced.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megatron_fsdp.engine.step.schedule import StepScheduler
from megatron_fsdp.engine.step.units import FSDPUnit

logger = logging.getLogger(__name__)


def tensors_requiring_grad(output: Any) -> list[torch.Tensor]:
    """The tensors inside a module output (tensors, tuples, lists, dicts, dataclass-like
    model outputs) that autograd will differentiate."""
    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dataclass_fields__"):
            stack.extend(getattr(item, field) for field in item.__dataclass_fields__)
    return found


def _deliver_grad(scheduler: weakref.ref, unit_index: int, bucket_index: int, index: int, param: nn.Parameter) -> None:
    live = scheduler()
    if live is not None:
        unit = live.units[unit_index]
        live.on_grad(unit, unit.trainable_buckets[bucket_index], index)


class StepHooks:
    """Installs and runs the hooks of one scheduler's units. ``on_failed_backward`` runs when
    the root's forward finds that the last backward raised (a retry without ``zero_grad``, as
    Accelerate's ``find_executable_batch_size`` does): it must drop that step's gradients."""

    def __init__(self, scheduler: StepScheduler, on_failed_backward: Callable[[], None]) -> None:
        self.scheduler = scheduler
        self.on_failed_backward = on_failed_backward

    def register_forward_hooks(self, module: nn.Module, unit: FSDPUnit) -> None:
        """A non-root unit's module: gather before its forward, reshard and arm backward after."""
        module.register_forward_pre_hook(functools.partial(self.pre_forward, unit))
        module.register_forward_hook(functools.partial(self.post_forward, unit))

    def register_grad_hooks(self) -> None:
        """Each trainable parameter tells the scheduler when its gradient arrives. The hooks live
        in C++ on the parameters, where Python's garbage collector cannot see them: they hold the
        scheduler weakly, so a model nobody uses is freed."""
        scheduler = weakref.ref(self.scheduler)
        for unit_index, unit in enumerate(self.scheduler.units):
            for bucket_index, bucket in enumerate(unit.trainable_buckets):
                for index, param in enumerate(bucket.params):
                    param.register_post_accumulate_grad_hook(
                        functools.partial(_deliver_grad, scheduler, unit_index, bucket_index, index)
                    )

    @torch.compiler.disable
    def pre_forward(self, unit: FSDPUnit, module: nn.Module, args: Any) -> None:
        if unit.is_root and self.scheduler.backward_failed():
            logger.warning("the last backward raised: its step's gradients are dropped and a new step starts")
            self.on_failed_backward()
        self.scheduler.before_unit_forward(unit)

    @torch.compiler.disable
    def post_forward(self, unit: FSDPUnit, module: nn.Module, args: Any, output: Any) -> None:
        if self.scheduler.after_unit_forward(unit):
            self.arm_pre_backward(unit, output)

    @torch.compiler.disable
    def after_root_forward(self, output: Any, root: FSDPUnit | None = None) -> None:
        """The root unit's forward ended: its outputs start backward, or nothing stays gathered.
        ``root``: a root unit told to reshard after forward (FSDP2's explicit
        ``reshard_after_forward=True`` on the root) gives its weights back now and gathers them
        again when backward reaches its outputs; otherwise it stays gathered into backward, and
        is gathered again there only if another micro-batch's backward resharded it meanwhile."""
        regathers = root is not None and root.reshards_after_forward
        if not self.arm_pre_backward(root if regathers else None, output, root):
            self.scheduler.end_forward_without_backward()
        elif regathers:
            root.reshard()

    def arm_pre_backward(self, unit: FSDPUnit | None, output: Any, root: FSDPUnit | None = None) -> bool:
        """Hooks ``output`` so that its backward starts in ``unit`` (None: no unit gathers); on the
        root's output, ``root`` is gathered again if an earlier backward resharded it."""
        tensors = tensors_requiring_grad(output) if torch.is_grad_enabled() else []
        if len(tensors) == 1:
            # The usual unit output: a plain tensor hook fires at the same point for a fraction
            # of a multi-grad hook's cost.
            tensors[0].register_hook(lambda grad: self.scheduler.before_unit_backward(unit, root))
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self.scheduler.before_unit_backward(unit, root), mode="any"
            )
        return bool(tensors)
