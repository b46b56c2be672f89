"""What a model chunk does between the micro-batches of a step under megatron-core's pipeline
parallelism.

megatron-core's schedules run every micro-batch of a step but each chunk's last under the chunk's
``no_sync()``, then reduce once (``finalize_model_grads``). Resharding each unit after every
micro-batch's forward and backward, and reduce-scattering every micro-batch's gradients, would
gather each unit's weights twice and reduce its gradients once per micro-batch: with pipeline
parallelism, as FSDP2 under torchtitan's pipeline schedules, the chunk's weights stay gathered and
its gradients accumulate unreduced from one micro-batch to the next, so a step gathers each unit
once and reduces each bucket once, after the chunk's last backward. That holds a stage's whole
weights (compute dtype) and gradients (main-gradient dtype) during the step: 1/PP of the model's.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from megatron_fsdp.engine.step.units import FSDPUnit


def pipeline_parallel_size() -> int:
    """megatron-core's pipeline-parallel size, 1 where megatron-core is not running (not imported,
    or its model parallelism not initialised)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def megatron_lm_args() -> Any | None:
    """Megatron-LM's parsed arguments where a Megatron-LM script has set them, else None."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def refuse_pipeline_checkpoints(pipeline_size: int, args: Any | None) -> None:
    """Raises when Megatron-LM would save or load an ``fsdp_dtensor`` checkpoint under pipeline
    parallelism. It keys a stage's tensors by the stage module's own names, whose layers count
    from 0 on every stage (torch_dist alone offsets them globally): a save would keep one stage's
    ``decoder.layers.0`` and lose the others', a load would give every stage the same layers. Each
    rank raises in the wrapper's constructor, before any collective, not at the first save."""
    if pipeline_size <= 1 or args is None or getattr(args, "ckpt_format", None) != "fsdp_dtensor":
        return
    uses = [flag for flag, value in (("--save", getattr(args, "save", None)), ("--load", getattr(args, "load", None))) if value]
    if uses:
        raise ValueError(
            f"megatron_fsdp: {' and '.join(uses)} with --ckpt-format fsdp_dtensor at --pipeline-model-parallel-size "
            f"{pipeline_size}: Megatron-LM names each pipeline stage's layers from 0 in that format, so stages would "
            "overwrite each other's layers in the checkpoint (and a load would give every stage the same ones). "
            "Checkpoint at pipeline-parallel size 1 (FSDP already shards the layers over the data-parallel ranks), or "
            "train without --save/--load at this pipeline size"
        )


@contextlib.contextmanager
def held_between_micro_batches(units: list[FSDPUnit], hold: bool) -> Iterator[None]:
    """With ``hold``: inside, ``units`` keep their weights gathered after forward and backward and
    their gradients unreduced; on leaving, each unit's own settings come back, so the next
    backward (the chunk's last micro-batch) reduces everything held and reshards."""
    if not hold:
        yield
        return
    saved = [(unit.reshard_after_forward, unit.reshard_after_backward, unit.requires_gradient_sync) for unit in units]
    for unit in units:
        unit.reshard_after_forward = unit.reshard_after_backward = unit.requires_gradient_sync = False
    try:
        yield
    finally:
        for unit, (after_forward, after_backward, sync) in zip(units, saved):
            unit.reshard_after_forward, unit.reshard_after_backward, unit.requires_gradient_sync = after_forward, after_backward, sync


def release_held_weights(units: list[FSDPUnit]) -> None:
    """Reshards every unit still gathered that its own settings reshard after backward (after a
    step's gradient sync, before the optimizer changes the weights)."""
    for unit in units:
        if unit.reshard_after_backward:
            unit.reshard()
