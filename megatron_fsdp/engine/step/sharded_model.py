"""What optim/ and checkpoint/ read of a sharded model, as a protocol: they are handed the
whole-model wrapper (``MegatronFSDP``), which sits above them and calls into them, so they name
its shape here instead of importing it (the dependency runs one way)."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.config import FSDPSettings
from megatron_fsdp.engine.groups.mesh import DataParallelGroup
from megatron_fsdp.engine.step.units import FSDPUnit


class ShardedModel(Protocol):
    """A model sharded into units of buckets. ``module`` is the user's model (its parameters
    the compute weights); the model's own ``named_parameters`` give the DTensor faces."""

    module: nn.Module
    units: list[FSDPUnit]
    dp: DataParallelGroup
    settings: FSDPSettings
    # Where the gradient norm is summed; how many optimizer steps were taken.
    compute_device: torch.device
    optimizer_steps: int
    # Whether the checkpoint writer keys plain expert parameters by global expert index.
    expert_keys_made_global: bool

    # -- state dicts (checkpoint/) -----------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any: ...

    # -- the optimizer step (optim/) ---------------------------------------------------------

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]: ...

    def trainable_buckets(self) -> list[Bucket]: ...

    def optimizer_params(self) -> dict[nn.Parameter, nn.Parameter]: ...

    def face_of(self, param: nn.Parameter) -> nn.Parameter: ...

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None: ...

    def prepare_optimizer_step(self, sync_grads: bool = True) -> None: ...

    def install_optimizer_step(self, install_weights: bool = True) -> None: ...

    def install_optimized_model_weights(self) -> None: ...

    def zero_grad_buffer(self, set_to_none: bool = True, params: Collection[nn.Parameter] | None = None) -> None: ...
