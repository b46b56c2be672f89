"""Transformer Engine modules are refused by every front door, from their classes alone: with
no process group at all, so the error comes before any collective (and alike on every rank).

Transformer Engine is not installed here: the stand-in below is a plain nn.Linear whose class
says it lives in TE's package, which is all the refusal looks at. It checks the refusal only;
nothing here trains TE.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

import megatron_fsdp
import megatron_fsdp.fsdp2


class StandInTELinear(nn.Linear):
    """Named as Transformer Engine's te.Linear is."""


StandInTELinear.__module__ = "transformer_engine.pytorch.module.linear"
StandInTELinear.__qualname__ = "Linear"


class WrapperOfTELinear(StandInTELinear):
    """As megatron-core's TELinear derives from TE's class, from a module outside TE's package."""


WrapperOfTELinear.__module__ = "megatron.core.extensions.transformer_engine"


def _model(linear_class: type) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Sequential(linear_class(8, 8)))


FRONT_DOORS = {
    "fully_shard_model": lambda model: megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[nn.Linear]),
    "fully_shard": lambda model: megatron_fsdp.fully_shard(model, fsdp_unit_modules=[nn.Linear]),
    "MegatronFSDP": lambda model: megatron_fsdp.MegatronFSDP(model, fsdp_unit_modules=[nn.Linear]),
    "fsdp2.fully_shard": lambda model: megatron_fsdp.fsdp2.fully_shard(model),
}


@pytest.mark.parametrize("linear_class", [StandInTELinear, WrapperOfTELinear])
@pytest.mark.parametrize("front_door", FRONT_DOORS)
def test_a_transformer_engine_module_is_refused_before_any_collective(front_door: str, linear_class: type) -> None:
    assert not dist.is_initialized()
    with pytest.raises(NotImplementedError) as raised:
        FRONT_DOORS[front_door](_model(linear_class))
    message = str(raised.value)
    assert "'1.0'" in message and f"{linear_class.__module__}.{linear_class.__qualname__}" in message, message
    assert "Transformer Engine's modules and its FP8" in message and "Float8LinearConfig(enable_fsdp_float8_all_gather=True)" in message, message
