"""What ``torch.distributed.pipelining`` reads of FSDP2's private state, answered for a module
sharded by ``megatron_fsdp.fsdp2.fully_shard`` (docs/fsdp2.md, "Pipeline parallelism").

A pipeline stage runs each micro-batch's backward with gradient sync off, then, once per step
(``PipelineStage.perform_reduce_grad``, torch 2.13), turns sync on and reaches past
``FSDPModule``'s methods into FSDP2's state::

    state = fully_shard.state(stage_module)          # module.__dict__[STATE_KEY][fully_shard's function]
    for s in state._state_ctx.all_states:            # every state under the root
        for group in s._fsdp_param_groups:
            group.post_backward()                    # reshard, reduce-scatter what accumulated
    state._root_post_backward_final_callback()       # wait for the reductions, gradients ready

:func:`expose_to_pipelining` puts a :class:`PipelineFace` where that first line looks (torch's
``fully_shard`` is otherwise unused on the module: FSDP2 finds its own states through another
registry), so torch runs unpatched. Each ``post_backward`` starts its unit's held-back
reductions and reshards it if told to; the final callback waits for them and shows the reduced
gradients as ``.grad``, which the schedule then scales by the micro-batch count.

Refused: schedules that split backward into an input step (``torch.autograd.grad`` for the stage
inputs only) and a weight step that assigns ``param.grad`` itself. Neither goes through the
gradient-accumulation hooks the engine reduces from, so a stage of such a schedule reaches
``perform_reduce_grad`` with no gradient held: reading ``_state_ctx`` then raises, on every rank
of the stage and before any reduction (the first stage, whose weight step is a plain backward,
is not caught).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed._composable.contract import STATE_KEY
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from megatron_fsdp.fsdp2.state import ModuleShardingState, RootStep

SPLIT_BACKWARD_REFUSAL = (
    "Schedules that split backward into input and weight steps (ScheduleInterleavedZeroBubble, "
    "ScheduleZBVZeroBubble, ScheduleDualPipeV, or a custom schedule with I/W actions) set the weight "
    "gradients on the parameters directly, where megatron_fsdp.fsdp2 never sees them: use ScheduleGPipe, "
    "Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS, whose backward accumulates them"
)

# The key ``fully_shard.state(module)`` reads under: the function ``@contract`` wrapped.
_TORCH_FULLY_SHARD_KEY = torch_fully_shard.__wrapped__


class _ParamGroupFace:
    """One unit, as ``FSDPParamGroup.post_backward`` is called on it."""

    def __init__(self, state: ModuleShardingState) -> None:
        self._state = state

    def post_backward(self) -> None:
        unit = self._state.unit
        self._state.step.scheduler.start_grad_sync([unit])
        if unit.reshard_after_backward:
            unit.reshard()


@dataclass
class _StateContext:
    all_states: list[PipelineFace]


class PipelineFace:
    """A module's answer to ``fully_shard.state(module)`` for torch's pipelining (module docstring)."""

    def __init__(self, state: ModuleShardingState) -> None:
        self._state = state

    @property
    def _fsdp_param_groups(self) -> list[_ParamGroupFace]:
        return [_ParamGroupFace(self._state)]

    @property
    def _state_ctx(self) -> _StateContext:
        """Read first, before any reduction: where the step's backward passes gave no parameter
        a gradient, the schedule computed them outside autograd's accumulation (module docstring)."""
        states = self._step().states
        buckets = [bucket for state in states for bucket in state.unit.trainable_buckets]
        if buckets and all(bucket.grads.unreduced_grad is None for bucket in buckets):
            raise NotImplementedError(
                f"fully_shard({self._state.unit.name}): this pipeline stage's backward passes gave none of its "
                f"parameters a gradient. {SPLIT_BACKWARD_REFUSAL}"
            )
        return _StateContext([PipelineFace(state) for state in states])

    def _root_post_backward_final_callback(self) -> None:
        scheduler = self._step().scheduler
        scheduler.finish_grad_sync()
        for callback in scheduler.after_backward:
            callback()

    def _step(self) -> RootStep:
        step = self._state.step
        if step is None:
            raise RuntimeError(
                f"fully_shard({self._state.unit.name}): a pipeline stage reduced gradients before its "
                "forward ran; run the schedule's step() first"
            )
        return step


def expose_to_pipelining(module: nn.Module, state: ModuleShardingState) -> None:
    """Where ``torch.distributed.pipelining`` looks for FSDP2's state on ``module``."""
    module.__dict__.setdefault(STATE_KEY, {})[_TORCH_FULLY_SHARD_KEY] = PipelineFace(state)
