"""The state FSDP2's front door keeps for one ``fully_shard(module)`` call: the engine unit built
from the module's parameters, the hooks on the module, and (from the first forward on) the step
its root drives. It translates FSDP2's module-level events into the engine's; the mechanism
(gathers, reductions, the schedule) is the engine's (``engine/units.py``, ``engine/schedule.py``,
``engine/step_hooks.py``).

The root is found as FSDP2 finds it: the first module sharded in place whose forward runs
becomes the root, and every module sharded in place under it joins its step.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from megatron_fsdp import _ops
from megatron_fsdp.checkpoint.state_dicts import FaceSource, to_face_layout
from megatron_fsdp.engine.config import FSDPSettings
from megatron_fsdp.engine.mesh import DataParallelGroup
from megatron_fsdp.engine.plan import check_timeout
from megatron_fsdp.engine.registered_params import ParamSlot, RegisteredParams
from megatron_fsdp.engine.schedule import StepScheduler, StepState
from megatron_fsdp.engine.sharded_params import MeshCache
from megatron_fsdp.engine.step_hooks import StepHooks, tensors_requiring_grad
from megatron_fsdp.engine.units import FSDPUnit

logger = logging.getLogger(__name__)

# The attribute of a module sharded in place that holds its ModuleShardingState.
STATE_ATTRIBUTE = "_megatron_fsdp2_state"


class _PoolHolder:
    """Keeps the shared bucket pool alive while any module sharded in place uses it."""

    def __init__(self) -> None:
        self.pool = _ops.new_bucket_pool(False)


# One bucket pool for every module sharded in place, so units take turns on the same memory
# (on CPU the pool caches blocks by size); it goes when the last state holding it goes.
_POOLS: weakref.WeakValueDictionary[str, _PoolHolder] = weakref.WeakValueDictionary()


def shared_pool() -> _PoolHolder:
    holder = _POOLS.get("pool")
    if holder is None:
        holder = _POOLS["pool"] = _PoolHolder()
    return holder


def state_of(module: nn.Module) -> ModuleShardingState | None:
    """The state of a module sharded in place by ``megatron_fsdp.fsdp2.fully_shard``, else None."""
    return module.__dict__.get(STATE_ATTRIBUTE)


@dataclass
class RootStep:
    """What the root shares with every module sharded in place under it."""

    scheduler: StepScheduler
    hooks: StepHooks
    states: list[ModuleShardingState]
    # set_post_optim_event(): waited on by the next forward before its first all-gather.
    post_optim_event: torch.Event | None = None


class ModuleShardingState:
    """One ``fully_shard`` call's unit and the hooks that drive it (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        unit: FSDPUnit,
        dp: DataParallelGroup,
        settings: FSDPSettings,
        mp_policy: TorchMixedPrecisionPolicy,
        slots: list[tuple[str, ParamSlot]],
        pool: _PoolHolder,
    ) -> None:
        """``slots``: each registration of a unit parameter with its key relative to ``module``."""
        self.module_ref = weakref.ref(module)
        self.unit = unit
        self.dp = dp
        self.settings = settings
        self.mp_policy = mp_policy
        self.keyed_slots = slots
        self._pool = pool
        self.step: RootStep | None = None
        # set_modules_to_forward_prefetch / _backward_prefetch: units gathered early.
        self.forward_prefetch: list[ModuleShardingState] = []
        self.backward_prefetch: list[ModuleShardingState] = []
        check_timeout(settings.collective_timeout)
        meshes = MeshCache()
        for bucket in unit.buckets:
            bucket.add_faces(meshes)
        self.faces = {p: f for b in unit.buckets for p, f in zip(b.params, b.faces)}
        unit.registration = RegisteredParams(
            [ParamSlot(s.module, s.name, s.compute, self.faces[s.compute].param) for _, s in slots]
        )
        unit.registration.show_sharded()

    # -- forward ------------------------------------------------------------------------------

    @property
    def is_root(self) -> bool:
        return self.unit.is_root

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.step is None:
            self._become_root(module)
        step = self.step
        if self.is_root and step.scheduler.state is StepState.IDLE:
            self._before_step(step)
        step.hooks.pre_forward(self.unit, module, args)
        if step.scheduler.state is StepState.FORWARD:
            for other in self.forward_prefetch:
                other.unit.start_unshard()
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            output = _cast_floats(output, self.mp_policy.output_dtype)
        if self.is_root:
            self.step.hooks.after_root_forward(output)
        else:
            self.step.hooks.post_forward(self.unit, module, args, output)
        if self.backward_prefetch and torch.is_grad_enabled():
            self._arm_backward_prefetch(output)
        return output

    def _arm_backward_prefetch(self, output: Any) -> None:
        tensors = tensors_requiring_grad(output)
        if tensors:
            targets = [other.unit for other in self.backward_prefetch]
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: [unit.start_unshard() for unit in targets], mode="any"
            )

    def _become_root(self, module: nn.Module) -> None:
        """FSDP2's lazy init: this module runs forward first, so it is the root of every module
        sharded in place under it, which now share one step."""
        states = [self] + [s for m in module.modules() if m is not module and (s := state_of(m)) is not None]
        owned = [s for s in states if s.step is not None]
        if owned:
            raise RuntimeError(
                f"a module sharded in place under {type(module).__name__} already ran forward as (part of) "
                "another root's step: run the outermost module sharded with fully_shard first, or shard "
                "the outer module only after the inner ones stopped running on their own"
            )
        self.unit.is_root = True
        scheduler = StepScheduler([s.unit for s in states], self.settings, self.dp)
        hooks = StepHooks(scheduler, self.reset_step)
        hooks.register_grad_hooks()
        step = RootStep(scheduler, hooks, states)
        for state in states:
            state.step = step
        logger.info("megatron_fsdp.fsdp2: %s is the root of %d modules sharded in place", type(module).__name__, len(states))

    def _before_step(self, step: RootStep) -> None:
        """At the root's forward between steps: what FSDP2 takes from the parameters' ``.grad``
        (which ``optimizer.zero_grad()`` cleared) and from ``set_post_optim_event``."""
        if step.post_optim_event is not None:
            step.post_optim_event.wait()
            step.post_optim_event = None
        for state in step.states:
            state.adopt_cleared_grads()

    def adopt_cleared_grads(self) -> None:
        """The reduced gradients accumulate into what the faces' ``.grad`` show, as FSDP2's
        sharded gradients do: where the optimizer (or the user) set every face's ``.grad`` of a
        bucket to None, the bucket's main gradient is released; where only some, their pieces
        are zeroed."""
        for bucket in self.unit.trainable_buckets:
            if bucket.optimizer_grad_source() is None:
                continue
            cleared = [face for face in bucket.faces if face.param.grad is None]
            if len(cleared) == len(bucket.faces):
                bucket.zero_main_grad(set_to_none=True)
                continue
            for face in cleared:
                if face.shown_grad is not None:
                    face.shown_grad.to_local().zero_()
                    face.param.grad = face.shown_grad

    def reset_step(self) -> None:
        """After a forward or backward that raised (FSDP2's ``reset_iter_state``): the step's
        gradients are dropped and every unit resharded."""
        scheduler = self.step.scheduler
        if scheduler.state is StepState.FORWARD:
            scheduler.end_forward_without_backward()
        elif scheduler.backward_failed():
            scheduler.abandon_failed_step()
        for state in self.step.states:
            for bucket in state.unit.trainable_buckets:
                bucket.zero_main_grad(set_to_none=True)

    def managed_tensors(self) -> list[torch.Tensor]:
        """The unit's parameters, as faces and as compute parameters."""
        return [t for param, face in self.faces.items() for t in (param, face.param)]

    # -- state dicts ---------------------------------------------------------------------------

    def load_state_dict_pre_hook(self, module: nn.Module, state_dict: dict, prefix: str, *unused: Any) -> None:
        """Entries for this unit's faces become DTensors laid out like them (their own storage
        when they already are, as after ``dcp.load``; else gathered and cut), so
        ``nn.Module``'s copy into each face writes this rank's flat piece."""
        for bucket in self.unit.buckets:
            pieces = bucket.checkpoint_pieces()
            for index, (param, face) in enumerate(zip(bucket.params, bucket.faces)):
                for key in self._keys_of(param, prefix):
                    value = state_dict.get(key)
                    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(face.spec.global_shape):
                        continue  # nn.Module reports it as missing or mis-shaped
                    piece, start = pieces[index]
                    source = FaceSource(piece, start, bucket.extents[index], face.spec)
                    state_dict[key] = to_face_layout(value, source, key)

    def _keys_of(self, param: nn.Parameter, prefix: str) -> list[str]:
        return [prefix + key for key, slot in self.keyed_slots if slot.compute is param]

    def load_state_dict_post_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        """The loaded main weights reach the compute weights."""
        for bucket in self.unit.buckets:
            bucket.sync_after_load()


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors of ``tree`` cast to ``dtype`` (FSDP2's ``cast_forward_inputs`` and
    ``output_dtype``); DTensors and other values as they are."""

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    return pytree.tree_map(cast, tree)
