"""The state FSDP2's front door keeps for one ``fully_shard(module)`` call: the engine unit built
from the module's parameters, the hooks on the module, and (from the first forward on) the step
its root drives. It translates FSDP2's module-level events into the engine's; the mechanism
(gathers, reductions, the schedule) is the engine's (``engine/step/units.py``, ``engine/step/schedule.py``,
``engine/step/step_hooks.py``).

The root is found as FSDP2 finds it: the first module sharded in place whose forward runs
becomes the root, and every module sharded in place under it joins its step.
"""

from __future__ import annotations

import functools
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
from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.buckets.faces import FaceSource, bucket_face_sources, to_face_layout
from megatron_fsdp.engine.buckets.offload import OffloadTransfers
from megatron_fsdp.engine.config import FSDPSettings
from megatron_fsdp.engine.groups.mesh import DataParallelGroup
from megatron_fsdp.engine.params.registered_params import RegisteredParams, Registration, SwappedRegistration
from megatron_fsdp.engine.params.sharded_params import MeshCache
from megatron_fsdp.engine.step.schedule import StepScheduler, StepState
from megatron_fsdp.engine.step.step_hooks import StepHooks, tensors_requiring_grad
from megatron_fsdp.engine.step.units import FSDPUnit
from megatron_fsdp.fsdp2 import optimizer_state
from megatron_fsdp.fsdp2.unused_grads import UnusedGrads
from megatron_fsdp.optim.global_step_hooks import end_unfinished_steps

logger = logging.getLogger(__name__)

# The attribute of a module sharded in place that holds its ModuleShardingState.
STATE_ATTRIBUTE = "_megatron_fsdp2_state"


class SharedResources:
    """What every module sharded in place shares, as the units of one wrapper do: the bucket
    pool, so units take turns on the same memory (on CPU the pool caches blocks by size), and
    with CPU offloading the offload stream and staging buffers."""

    def __init__(self) -> None:
        self.pool = _ops.new_bucket_pool(False)
        self._transfers: dict[tuple[torch.device, bool], OffloadTransfers] = {}

    def transfers(self, device: torch.device, pin_memory: bool) -> OffloadTransfers:
        key = (device, pin_memory)
        if key not in self._transfers:
            self._transfers[key] = OffloadTransfers(device, pin_memory)
        return self._transfers[key]


# They go when the last state holding them goes.
_SHARED: weakref.WeakValueDictionary[str, SharedResources] = weakref.WeakValueDictionary()


def shared_resources() -> SharedResources:
    resources = _SHARED.get("resources")
    if resources is None:
        resources = _SHARED["resources"] = SharedResources()
    return resources


def state_of(module: nn.Module) -> ModuleShardingState | None:
    """The state of a module sharded in place by ``megatron_fsdp.fsdp2.fully_shard``, else None."""
    return module.__dict__.get(STATE_ATTRIBUTE)


@dataclass
class RootStep:
    """What the root shares with every module sharded in place under it."""

    scheduler: StepScheduler
    hooks: StepHooks
    states: list[ModuleShardingState]


class ModuleShardingState:
    """One ``fully_shard`` call's unit and the hooks that drive it (see the module docstring)."""

    def __init__(
        self,
        modules: list[nn.Module],
        unit: FSDPUnit,
        dp: DataParallelGroup,
        settings: FSDPSettings,
        mp_policy: TorchMixedPrecisionPolicy,
        registrations: list[Registration],
        resources: SharedResources,
    ) -> None:
        """``modules``: the module sharded in place, or FSDP2's group of them; ``registrations``:
        each registration of a unit parameter under them (a tied weight has several)."""
        self.module_ref = weakref.ref(modules[0])
        self.unit = unit
        self.dp = dp
        self.settings = settings
        self.mp_policy = mp_policy
        self._resources = resources
        self.step: RootStep | None = None
        # set_modules_to_forward_prefetch / _backward_prefetch: units gathered early.
        self.forward_prefetch: list[ModuleShardingState] = []
        self.backward_prefetch: list[ModuleShardingState] = []
        # set_post_optim_event() on the root: waited on by the next forward before its first gather.
        self.post_optim_event: torch.Event | None = None
        # Registrations showing row-sharded copies inside a state_dict() call (state_dict_pre_hook).
        self._shown_as_rows: list[SwappedRegistration] = []
        meshes = MeshCache()
        for bucket in unit.buckets:
            bucket.add_faces(meshes)
        self.faces = {p: f for b in unit.buckets for p, f in zip(b.params, b.faces)}
        self.slots = [
            SwappedRegistration(r.owner, r.attribute, r.param, self.faces[r.param].param) for r in registrations
        ]
        for face in self.faces.values():
            optimizer_state.track(face.param, self)
        unit.registration = RegisteredParams(self.slots)
        unit.registration.show_sharded()
        self.unused_grads = UnusedGrads(unit)

    # -- forward ------------------------------------------------------------------------------

    @property
    def is_root(self) -> bool:
        return self.unit.is_root

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.step is None:
            self._become_root(module)
        step = self.step
        if step.scheduler.state is StepState.IDLE:
            # Any module's forward may start a step: a non-root's alone, after the root's step.
            _before_step(step)
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
            self.step.hooks.after_root_forward(output, self.unit)
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
        # A group of modules shares one state: each appears once.
        states = list(dict.fromkeys([self] + [s for m in module.modules() if (s := state_of(m)) is not None]))
        owned = [s for s in states if s.step is not None]
        if owned:
            raise RuntimeError(
                f"a module sharded in place under {type(module).__name__} already ran forward as (part of) "
                "another root's step: run the outermost module sharded with fully_shard first, or shard "
                "the outer module only after the inner ones stopped running on their own"
            )
        _refuse_params_in_two_units(states)
        _refuse_meta_tensors(module)
        self.unit.is_root = True
        scheduler = StepScheduler([s.unit for s in states], self.settings, self.dp)
        hooks = StepHooks(scheduler, self.reset_step)
        hooks.register_grad_hooks()
        scheduler.after_backward.extend(s.unused_grads.hide for s in states)
        step = RootStep(scheduler, hooks, states)
        for state in states:
            state.step = step
            # Float8 weights are cast from the main params at each step; what was written into
            # them since fully_shard (an init after sharding on the meta device) is cast now.
            for bucket in state.unit.trainable_buckets:
                if bucket.float8_weights:
                    bucket.weights.install()
        logger.info("megatron_fsdp.fsdp2: %s is the root of %d modules sharded in place", type(module).__name__, len(states))

    def piece_buckets(self) -> list[Bucket]:
        """The buckets whose faces an optimizer steps as the pieces under them (optimizer_state.py)."""
        return self.unit.buckets

    def after_piece_step(self) -> None:
        """After an optimizer stepped this unit's pieces: offloaded buckets send the stepped main
        parameters (on the host) to the device weights the next gather reads. The whole-model
        wrapper does this in its optimizer's step; a plain optimizer's step is seen by torch's
        global step post-hook (``optim/global_step_hooks.py``). Float8 buckets cast them to their
        float8 weights (engine/buckets/float8_bucket.py). Elsewhere the gathers read the main parameters."""
        for bucket in self.unit.trainable_buckets:
            if bucket.host is not None or bucket.float8_weights:
                bucket.weights.install()

    def adopt_cleared_grads(self) -> None:
        """The reduced gradients accumulate into what the faces' ``.grad`` show, as FSDP2's
        sharded gradients do: where the optimizer (or the user) set every face's ``.grad`` of a
        bucket to None, the bucket's main gradient is released; where only some, their ranges of
        it (and of the optimizer's cast copy) are zeroed and shown again."""
        for bucket in self.unit.trainable_buckets:
            # The reduced gradients and what the faces show of them (a cast copy, or offloaded,
            # the host's, the device ones being released once sent).
            held = {id(t): t for t in (bucket.grads.optimizer_source(), bucket.grads.optimizer_grads) if t is not None}
            if not held or (bucket.grads.main_grad is not None and bucket.grads.main_grad is bucket.grads.unreduced_grad):
                # Reduced in place (a shard group of one), a main gradient that is also the
                # un-reduced buffer holds micro-batches accumulating without sync: not shown yet,
                # so its faces' None is no zero_grad.
                continue
            if bucket.grads.state.outer_sync_due:
                # Micro-batches reduced with the replicas' all-reduce held back
                # (set_requires_all_reduce(False)): not shown yet either.
                continue
            cleared = [index for index, face in enumerate(bucket.faces) if face.param.grad is None]
            if len(cleared) == len(bucket.faces):
                bucket.grads.zero(set_to_none=True)
                continue
            for index in cleared:
                lo, hi = bucket.optim_ranges[index]
                for grads in held.values():
                    grads[lo:hi].zero_()
                face = bucket.faces[index]
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
                bucket.grads.zero(set_to_none=True)

    def managed_tensors(self) -> list[torch.Tensor]:
        """The unit's parameters, as faces and as compute parameters."""
        return [t for param, face in self.faces.items() for t in (param, face.param)]

    # -- state dicts ---------------------------------------------------------------------------

    def register_state_dict_hooks(self, modules: list[nn.Module]) -> None:
        """Loading: each module owning a parameter of the unit converts its own entries right
        before it copies them (after any hook of its parents rewrote them, a fused-QKV hook say);
        the module sharded in place then installs what was loaded. Saving: see
        :meth:`state_dict_pre_hook`."""
        owners: dict[nn.Module, list[SwappedRegistration]] = {}
        for slot in self.slots:
            owners.setdefault(slot.module, []).append(slot)
        for owner, slots in owners.items():
            owner.register_load_state_dict_pre_hook(functools.partial(self._load_pre_hook, slots))
        for module in modules:
            module.register_load_state_dict_post_hook(self._load_post_hook)
            module.register_state_dict_pre_hook(functools.partial(self.state_dict_pre_hook))
            # A partial: torch marks a post-hook with an attribute, which a bound method cannot take.
            module.register_state_dict_post_hook(functools.partial(self.state_dict_post_hook))

    def _load_pre_hook(
        self, slots: list[SwappedRegistration], owner: nn.Module, state_dict: dict, prefix: str, *unused: Any
    ) -> None:
        """Entries for these faces become DTensors laid out like them (their own storage when
        they already are, as after ``dcp.load``; else gathered and cut), so ``nn.Module``'s copy
        into each face writes this rank's flat piece."""
        sources = self._face_sources()
        for slot in slots:
            key = prefix + slot.name
            value = state_dict.get(key)
            source = sources[slot.compute]
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(source.spec.global_shape):
                state_dict[key] = to_face_layout(value, source, key)
            # otherwise nn.Module reports it as missing or mis-shaped

    def _face_sources(self) -> dict[nn.Parameter, FaceSource]:
        return {
            param: source
            for bucket in self.unit.buckets
            for param, source in zip(bucket.params, bucket_face_sources(bucket))
        }

    def _load_post_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        """The loaded main weights reach the compute weights."""
        for bucket in self.unit.buckets:
            bucket.sync_after_load()

    def state_dict_pre_hook(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """Where the model has state-dict hooks of its own (which may split, slice or reshape a
        parameter, as torchtitan's fused QKV does), they see what FSDP2's see: row-sharded
        DTensors of the full shapes (one gather per parameter, for this call only). Without such
        hooks the flat pieces go into the state dict as they are, sharing their storage."""
        root = self.step.states[0].module_ref() if self.step is not None else module
        if not _has_state_dict_hooks_of_its_own(root):
            return
        rows: dict[nn.Parameter, DTensor] = {}
        with torch.no_grad():
            for slot in self.slots:
                if slot.module._parameters.get(slot.name) is slot.face:
                    if slot.face not in rows:
                        rows[slot.face] = slot.face.redistribute(placements=slot.face.placements)
                    slot.module._parameters[slot.name] = rows[slot.face]
                    self._shown_as_rows.append(slot)

    def state_dict_post_hook(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for slot in self._shown_as_rows:
            slot.module._parameters[slot.name] = slot.face
        self._shown_as_rows = []



def _refuse_params_in_two_units(states: list[ModuleShardingState]) -> None:
    """FSDP2's check at lazy init (every rank, before any collective of the step): a parameter
    shared by modules sharded in separate calls would be gathered and reduced twice."""
    owners: dict[nn.Parameter, ModuleShardingState] = {}
    for state in states:
        for bucket in state.unit.buckets:
            for name, param in zip(bucket.names, bucket.params):
                other = owners.setdefault(param, state)
                if other is not state:
                    raise ValueError(
                        f"fully_shard({state.unit.name}): its parameter {name!r} is already managed by another "
                        f"fully_shard call, fully_shard({other.unit.name}): a parameter shared by modules sharded in "
                        "separate calls is not supported (nor by torch's FSDP2); shard the modules that share it in one "
                        "call, fully_shard([a, b]), or leave them to their common parent's fully_shard"
                    )


def _refuse_meta_tensors(root: nn.Module) -> None:
    """FSDP2's check at lazy init (once per root, before any collective): a model sharded on the
    meta device and never materialised would fail deep inside its forward. fully_shard gives meta
    parameters memory, so what is left on meta here is buffers (or parameters it does not manage)."""
    on_meta = [name for name, tensor in (*root.named_parameters(), *root.named_buffers()) if tensor.is_meta]
    if on_meta:
        raise RuntimeError(
            "FSDP parameters should be materialized from meta device before training, but the following were "
            f"still on meta device: {on_meta}. Call module.to_empty(device=...) on the model, then initialise "
            "them (reset_parameters() on each module, or load a state dict)"
        )


def _before_step(step: RootStep) -> None:
    """At the first forward of a step (the root's, or a non-root's run on its own): what FSDP2
    takes from the parameters' ``.grad`` (which ``optimizer.zero_grad()`` cleared) and from
    ``set_post_optim_event``. An optimizer step that raised first gives its optimizer the faces
    back (optim/global_step_hooks.py)."""
    end_unfinished_steps()
    for state in step.states:
        if state.post_optim_event is not None:
            state.post_optim_event.wait()
            state.post_optim_event = None
    for state in step.states:
        state.unused_grads.note_cleared()
        state.adopt_cleared_grads()


def _has_state_dict_hooks_of_its_own(root: nn.Module) -> bool:
    """Whether a module under ``root`` has state-dict hooks other than megatron_fsdp's."""
    for module in root.modules():
        for hook in (*module._state_dict_hooks.values(), *module._state_dict_pre_hooks.values()):
            if not isinstance(getattr(getattr(hook, "func", hook), "__self__", None), ModuleShardingState):
                return True
    return False


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors of ``tree`` cast to ``dtype`` (FSDP2's ``cast_forward_inputs`` and
    ``output_dtype``); DTensors and other values as they are."""

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.is_floating_point():
            return value.to(dtype)
        return value

    return pytree.tree_map(cast, tree)
