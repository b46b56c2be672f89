"""MegatronFSDP as megatron-core's ``FullyShardedDataParallel`` adapter uses it.

megatron-core wraps ``MegatronFSDP(module, dist_index, ddp_config, ...)`` in its own
``FullyShardedDataParallel`` and then walks that wrapper as any ``nn.Module``: its optimizer is
built from the wrapper's ``named_parameters()``, which read every submodule's registered
parameters directly (not :meth:`MegatronFSDP.named_parameters`). Upstream megatron-fsdp answers
this by registering its DTensor parameters in the model between steps and the compute weights
during forward and backward. :class:`MegatronCoreFSDP` does the same with megatron_fsdp's DTensor
faces (docs/architecture.md, "The parameter contract"):

- registered between steps: after construction, after each ``finish_grad_sync()`` (which
  megatron-core's ``finalize_model_grads`` calls before the optimizer step), after a forward
  without backward and after ``synchronize_param_gather()`` (megatron-core's evaluation);
- the compute weights from the start of each forward until that sync, and around
  megatron_fsdp's own walks of the model (state dicts, ``named_parameters``).

The faces carry what megatron-core reads off upstream's DTensor parameters, as every
MegatronFSDP's do (megatron_fsdp/engine/params/upstream_param_attributes.py): ``__fsdp_param__`` (its
gradient clipping then takes ``.grad``'s local tensor), the Megatron-Core attributes of the
parameter they stand for, ``megatron_fsdp_dist_index`` and ``megatron_fsdp_slice`` (this rank's
range of the flattened local parameter). The ``param_and_grad_buffer`` megatron-core's optimizer
calls is MegatronFSDP's own (megatron_fsdp/param_and_grad_buffer.py).

State-dict keys are upstream's: the wrapped model sits under ``module.``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

from torch import nn

from megatron_fsdp.engine.step.schedule import StepState
from megatron_fsdp.integrations.mcore_pipeline import (
    held_between_micro_batches,
    megatron_lm_args,
    pipeline_parallel_size,
    refuse_pipeline_checkpoints,
    release_held_weights,
)
from megatron_fsdp.megatron_fsdp import MegatronFSDP

_PREFIX = "module."


class MegatronCoreFSDP(MegatronFSDP):
    """:class:`~megatron_fsdp.MegatronFSDP` (same constructor) for megatron-core's adapter;
    see the module docstring."""

    # Read by named_parameters() while the base class is still being built: nothing swapped yet.
    _faces_registered = False
    # megatron-core's optimizer steps the faces; it installs the weights and zeroes the buffers.
    refuses_unsharded_optimizers = False
    # Megatron-LM's fsdp_dtensor checkpointing renames each rank's local experts to their global
    # index (handle_experts_in_state_dict), so its plain expert weights are checkpointable.
    expert_keys_made_global = True
    #: Under no_sync, keep the weights gathered and the gradients unreduced between micro-batches
    #: (integrations/mcore_pipeline.py). None: when megatron-core runs pipeline parallelism.
    hold_between_micro_batches: bool | None = None

    def __init__(self, module: nn.Module, dist_index: Any = None, ddp_config: Any = None, *args: Any, **kwargs: Any) -> None:
        refuse_pipeline_checkpoints(pipeline_parallel_size(), megatron_lm_args())
        super().__init__(module, dist_index, ddp_config, *args, **kwargs)
        # Every place the model registers a parameter (tied weights: each place).
        self._registrations = [
            (owner, name, param)
            for owner in self.module.modules()
            for name, param in owner._parameters.items()
            if param is not None
        ]
        self._register_faces(True)

    # -- which tensors the model registers ------------------------------------------------------

    def _register_faces(self, faces: bool) -> None:
        if self._faces_registered == faces:
            return
        for owner, name, param in self._registrations:
            owner._parameters[name] = self.face_of(param) if faces else param
        self._faces_registered = faces

    @contextlib.contextmanager
    def _compute_weights_registered(self) -> Iterator[None]:
        previous = self._faces_registered
        self._register_faces(False)
        try:
            yield
        finally:
            self._register_faces(previous)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._register_faces(False)
        try:
            output = super().forward(*args, **kwargs)
        except BaseException:
            self._register_faces(True)  # a forward that raised leaves the model as between steps
            raise
        if self.scheduler.state is StepState.IDLE:  # no backward follows (e.g. evaluation)
            self._register_faces(True)
        return output

    def _abandon_failed_step(self) -> None:
        super()._abandon_failed_step()
        self._register_faces(True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """megatron-core's schedules run every micro-batch of a step but the chunk's last inside it;
        under pipeline parallelism the chunk's weights stay gathered and its gradients unreduced
        meanwhile (integrations/mcore_pipeline.py)."""
        hold = self.hold_between_micro_batches
        if hold is None:
            hold = pipeline_parallel_size() > 1
        with super().no_sync(), held_between_micro_batches(self.units, hold):
            yield

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """As :meth:`MegatronFSDP.finish_grad_sync`, then (megatron-core steps right after)
        checks the gradients when ``check_for_nan_in_grad`` is set, and registers the DTensor
        faces for the optimizer."""
        super().finish_grad_sync(force_all_reduce)
        # A chunk whose last backward ran under no_sync (megatron-core's interleaved schedule
        # enables grad sync for all chunks only at the end) still holds its weights gathered: the
        # step changes them, so they go back now and the next forward gathers the new ones.
        release_held_weights(self.units)
        if self.settings.check_for_nan_in_grad:
            self.scheduler.check_reduced_grads_finite(self.optimizer_steps)
        self._register_faces(True)
        self._show_main_grads()

    def zero_grad_buffer(self, set_to_none: bool = True, params: Collection[nn.Parameter] | None = None) -> None:
        """As :meth:`MegatronFSDP.zero_grad_buffer`; each face's ``main_grad`` follows its ``.grad``."""
        super().zero_grad_buffer(set_to_none, params)
        self._show_main_grads()

    def _show_main_grads(self) -> None:
        """Each trainable face's ``main_grad`` is its ``.grad``. megatron-core's
        ``finalize_model_grads`` reduces the tied embedding and output weights over the embedding
        group through ``main_grad._local_tensor`` when a parameter has ``main_grad`` (else through
        ``.grad``, whose ``setattr`` after would refuse the local tensor's shape): in place, into
        the gradient buffer the optimizer reads. The local tensor it then sets as ``main_grad`` is
        replaced here at the next sync, so it keeps no released buffer alive past the step."""
        for sharded in self._faces.values():
            if sharded.param.requires_grad:
                sharded.param.main_grad = sharded.param.grad

    def synchronize_param_gather(self) -> None:
        """As :meth:`MegatronFSDP.synchronize_param_gather` (megatron-core calls it after
        evaluation), then registers the DTensor faces."""
        super().synchronize_param_gather()
        self._register_faces(True)

    # -- names as upstream's: the model under "module." ------------------------------------------

    def _fqn_modifiers(self) -> dict[str, str]:
        return {}

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """``module.<FQN>`` with each parameter's DTensor face, as upstream's between steps."""
        with self._compute_weights_registered():
            named = list(super().named_parameters(recurse=recurse, remove_duplicate=remove_duplicate))
        lead = f"{prefix}.{_PREFIX}" if prefix else _PREFIX
        for name, face in named:
            yield lead + name, face

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """``module.<FQN>`` -> DTensor, as upstream's (see :meth:`MegatronFSDP.state_dict`)."""
        with self._compute_weights_registered():
            inner = super().state_dict()
        result = destination if destination is not None else {}
        result.update({prefix + _PREFIX + key: value for key, value in inner.items()})
        return result

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Takes :meth:`state_dict`'s keys, or those keys prefixed once more with ``module.`` as
        megatron-core's ``FullyShardedDataParallel.load_state_dict`` passes them."""
        for lead in (_PREFIX + _PREFIX, _PREFIX):
            if state_dict and all(key.startswith(lead) for key in state_dict):
                state_dict = {key[len(lead) :]: value for key, value in state_dict.items()}
                break
        with self._compute_weights_registered():
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
