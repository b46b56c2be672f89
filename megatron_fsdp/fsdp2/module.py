"""The class a module sharded in place becomes: ``FSDP<Cls>(MegatronFSDPModule, Cls)``, an instance
of torch's ``FSDPModule``, whose public methods act on megatron_fsdp's engine as torch's act on
FSDP2's.

What each method does here (torch's names and signatures, torch 2.11 and 2.13):

- ``unshard(async_op)``, ``reshard()``: gather / give back this module's unit (not recursive);
  the handle's ``wait()`` waits for the gather and points the parameters at it.
- ``set_requires_gradient_sync``: off, gradients stay un-reduced and accumulate (no
  reduce-scatter) until a backward with it on; ``set_requires_all_reduce(False)`` under HSDP:
  gradients are reduce-scattered each backward and accumulate over the shard group, and their
  average over the replicas waits for a backward with it on (each bucket's is launched as soon
  as its reduce-scatter lands, under the rest of that backward); ``.grad`` is not written
  meanwhile, as FSDP2's. ``set_reshard_after_forward`` / ``_backward``: when the unit gives its
  gathered weights back.
- ``set_modules_to_forward_prefetch`` / ``_backward_prefetch``: those units' gathers start when
  this one's forward starts / its backward begins (on top of the engine's own prefetch of the
  next unit in the recorded order).
- ``set_gradient_divide_factor``: reduced gradients are divided by it instead of the group size.
- ``set_post_optim_event``: the next forward waits on the event before its first gather.
- ``reset_iter_state`` (root only): drops a failed step's gradients and reshards everything.
- Accepted with no change to what is computed: ``set_is_last_backward`` (every backward here
  finishes its reductions), ``set_force_sum_reduction_for_comms`` (reductions here always sum,
  then scale), ``set_requires_all_reduce`` over a 1-D mesh (which has no all-reduce),
  ``set_unshard_in_backward(True)``, and the performance knobs
  ``set_reduce_scatter_max_input_buffers``, ``set_separate_reduce_scatter_group``,
  ``set_allocate_memory_from_process_group_for_comm``, ``set_symm_mem_for_comm``,
  ``_set_unshard_async_op`` (logged).
- ``set_reduce_scatter_unused_params``: False (default, as FSDP2), an unused parameter's
  ``.grad`` stays None; True, it shows zeros.
- Raise ``NotImplementedError`` naming the call: ``set_custom_all_gather``,
  ``set_custom_reduce_scatter``, ``set_all_reduce_hook`` (the engine's collectives are its own),
  ``set_unshard_in_backward(False)``, and
  ``module.to(...)``/``to_empty``/``half()`` that would move or cast the sharded parameters (on
  their own device and dtype, these apply to the rest of the module).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle

from megatron_fsdp.fsdp2.state import ModuleShardingState, state_of
from megatron_fsdp.megatron_fsdp import DDP_WRAP_REFUSAL

logger = logging.getLogger(__name__)


class _UnitUnshardHandle(UnshardHandle):
    """``unshard(async_op=True)``'s handle: ``wait()`` finishes the gather."""

    def __init__(self, state: ModuleShardingState) -> None:
        self._state: ModuleShardingState | None = state

    def wait(self) -> None:
        if self._state is not None:
            self._state.unit.unshard()
            self._state = None


def _not_supported(call: str, why: str) -> NoReturn:
    raise NotImplementedError(f"{call} is not supported by megatron_fsdp.fsdp2: {why}")


class MegatronFSDPModule(FSDPModule):
    """See the module docstring. Not instantiated: ``fully_shard`` makes a module's class
    ``FSDP<Cls>(MegatronFSDPModule, Cls)``."""

    # Where the module's own class sits in the MRO: [FSDP<Cls>, MegatronFSDPModule, FSDPModule, Cls].
    _orig_cls_mro_index: int = 3
    # Accelerate wraps a model in DistributedDataParallel unless it says it is prepared (on GPU
    # its FSDP2 plugin takes an FSDPModule as it is; without the plugin, and on CPU, it would wrap).
    _is_accelerate_prepared = True

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """DistributedDataParallel reads this before any collective: a module sharded in place
        refuses to be wrapped, on every rank, naming the fix."""
        raise TypeError(DDP_WRAP_REFUSAL)

    def _get_fsdp_state(self) -> ModuleShardingState:
        state = state_of(self)
        if state is None:
            raise AssertionError(f"no megatron_fsdp.fsdp2 state on {type(self).__name__}")
        return state

    def _fsdp_modules(self, recurse: bool) -> list[MegatronFSDPModule]:
        return [m for m in self.modules() if isinstance(m, MegatronFSDPModule)] if recurse else [self]

    # -- gathering ------------------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gathers this module's parameters (not its submodules' sharded separately) and registers
        the unsharded ones; ``async_op=True`` returns a handle (the forward waits on it too)."""
        state = self._get_fsdp_state()
        state.unit.start_unshard()
        handle = _UnitUnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Frees the unsharded parameters and registers the sharded ones (not recursive)."""
        self._get_fsdp_state().unit.reshard()

    def reset_iter_state(self) -> None:
        """On the root, after a forward or backward raised: drops that step's gradients and
        reshards every unit, so the next iteration starts clean."""
        state = self._get_fsdp_state()
        if state.step is None:
            return
        if not state.is_root:
            raise RuntimeError("reset_iter_state() must be called on the root module (the one whose forward ran first)")
        state.reset_step()

    # -- per-module switches ----------------------------------------------------------------------

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted: every backward here finishes its reductions and shows the gradients."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: this module's gradients are held un-reduced and accumulate, with no reduce-scatter,
        until a backward with it on reduces everything held (FSDP1's ``no_sync``). Sets
        :meth:`set_requires_all_reduce` to the same, as torch's does."""
        for module in self._fsdp_modules(recurse):
            unit = module._get_fsdp_state().unit
            unit.requires_gradient_sync = unit.requires_all_reduce = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP's gradient accumulation with reduce-scatters only: off, each backward
        reduce-scatters this module's gradients over the shard group and adds them to what it
        holds, without the replicas' all-reduce and without writing ``.grad``; the next backward
        with it on averages everything held over the replicas. Over a 1-D mesh (no all-reduce)
        it changes nothing."""
        for module in self._fsdp_modules(recurse):
            module._get_fsdp_state().unit.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for module in self._fsdp_modules(recurse):
            module._get_fsdp_state().unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for module in self._fsdp_modules(recurse):
            module._get_fsdp_state().unit.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._get_fsdp_state().forward_prefetch = _states(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._get_fsdp_state().backward_prefetch = _states(modules, "set_modules_to_backward_prefetch")

    def set_post_optim_event(self, event: torch.Event) -> None:
        """On the root: its next forward makes the current stream wait on ``event`` before
        gathering (instead of on everything before it), then drops it."""
        self._get_fsdp_state().post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated by torch: :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This module's reduced gradients are divided by ``factor`` instead of the group size
        (1.0: a sum)."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor!r}")
        for bucket in self._get_fsdp_state().unit.trainable_buckets:
            bucket.grad_divisor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: reductions here are always sums, scaled afterwards."""

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """False (FSDP2's default): a parameter that got no gradient since its ``.grad`` was
        cleared keeps ``.grad`` None; True: it shows zeros (the bucket reduces them either way)."""
        for module in self._fsdp_modules(recurse):
            module._get_fsdp_state().unused_grads.show_zeros = bool(reduce_scatter_unused_params)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        if not unshard_in_backward:
            _not_supported("set_unshard_in_backward(False)", "backward always gathers the unit it computes")

    def set_custom_all_gather(self, comm: Any) -> None:
        _not_supported("set_custom_all_gather()", "the engine gathers flat buckets with its own collectives")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        _not_supported("set_custom_reduce_scatter()", "the engine reduces flat buckets with its own collectives")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        _not_supported("set_all_reduce_hook()", "no hook runs on the engine's reduced gradient buckets")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers!r}")
        _performance_only("set_reduce_scatter_max_input_buffers")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        _performance_only("set_separate_reduce_scatter_group")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        _performance_only("set_allocate_memory_from_process_group_for_comm")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        _performance_only("set_symm_mem_for_comm")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        _performance_only("_set_unshard_async_op")

    # -- moving the module ------------------------------------------------------------------------

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``module.to(...)``, ``float()``, ``to_empty()``: applied to everything but the sharded
        parameters, which must already have the device and dtype ``fn`` gives (``to_empty`` on
        the device ``fully_shard`` materialised a meta model on: the buffers are allocated, the
        pieces already are); otherwise raises before changing anything."""
        state = self._get_fsdp_state()
        for dtype, device in {(t.dtype, t.device) for t in state.managed_tensors()}:
            probe = torch.empty(0, dtype=dtype, device=device)
            applied = fn(probe)
            if applied.dtype != dtype or applied.device != device:
                _not_supported(
                    f"{type(self).__name__}._apply (module.to / cuda / float / half / to_empty) after fully_shard",
                    "it would move or cast the sharded parameters: move or cast the module before fully_shard",
                )
        with _registrations_hidden(state):
            # Past torch's FSDPModule._apply, which reaches into FSDP2's own state.
            return super(FSDPModule, self)._apply(fn, recurse)


def _performance_only(call: str) -> None:
    logger.info("megatron_fsdp.fsdp2: %s() tunes FSDP2's own collectives; it has no effect here", call)


def _states(modules: list[FSDPModule], call: str) -> list[ModuleShardingState]:
    states = []
    for module in modules:
        state = state_of(module) if isinstance(module, nn.Module) else None
        if state is None:
            raise ValueError(f"{call}: {type(module).__name__} was not sharded by megatron_fsdp.fsdp2.fully_shard")
        states.append(state)
    return states


@contextlib.contextmanager
def _registrations_hidden(state: ModuleShardingState) -> Iterator[None]:
    """The unit's parameter registrations set to None inside (``nn.Module._apply`` skips them)."""
    slots = state.slots
    held = [slot.module._parameters[slot.name] for slot in slots]
    for slot in slots:
        slot.module._parameters[slot.name] = None
    try:
        yield
    finally:
        for slot, param in zip(slots, held):
            slot.module._parameters[slot.name] = param
