"""torchao's float8 training under megatron_fsdp: which ``Float8Linear`` weights are gathered in
float8, and how a module's forward receives the gathered float8 weight.

A user asks as under FSDP2: ``convert_to_float8_training(model, config=Float8LinearConfig(
enable_fsdp_float8_all_gather=True))`` before sharding. Such a weight comes as torchao's
wrapper tensor; :func:`prepare_float8_linears` puts a plain parameter of the same values in its
place and marks it with a :class:`Float8WeightSpec`, so that the units group it into a float8
bucket (``float8_bucket.py``), which makes the weights' float8 scales after each step, casts
the main params to float8 with them and gathers float8 bytes. Such a module becomes a subclass
of its torchao class whose forward hands torchao's matmul a ``Float8TrainingTensor`` over the
gathered bytes and the bucket's scale, which it takes as already cast; the gradient reaches the
parameter as torchao's own would.

torchao is imported only here, and only when a model holds a ``Float8Linear``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

_FLOAT8_LINEAR = "torchao.float8.float8_linear.Float8Linear"
TORCHAO_MISSING = (
    "this model holds a torchao Float8Linear, but torchao cannot be imported here; install the "
    "torchao that converted it (pip install torchao==0.18.0) to shard it"
)


@dataclass
class Float8WeightSpec:
    """How one ``Float8Linear``'s weight is cast: torchao's target dtype and matmul config, and
    where its float8 copy lives once a bucket holds it (``source(index)`` -> (bytes, scale))."""

    float8_dtype: torch.dtype
    linear_mm_config: object
    round_scales_to_power_of_2: bool
    source: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None


def float8_spec(param: nn.Parameter) -> Float8WeightSpec | None:
    """The float8 cast a parameter's bucket must make, or None for an ordinary parameter."""
    return getattr(param, "_megatron_fsdp_float8", None)


def _is_float8_linear(module: nn.Module) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" == _FLOAT8_LINEAR for c in type(module).__mro__)


def float8_gathers_blocked_by(cpu_offload: bool, outer_shards_optimizer: bool) -> str | None:
    """Why no weight of a model sharded with these settings can be gathered in float8, or None.
    The float8 copy is cast where the step installs the main params, on the device: offloaded,
    the step runs on the host; with the optimizer sharded over the outer group, each rank holds
    only part of its shard's main params."""
    if cpu_offload:
        return "CPU offloading (the main params are stepped on the host)"
    if outer_shards_optimizer:
        return "outer_dp_sharding_strategy='optim' (each rank holds part of its shard's main params)"
    return None


def prepare_float8_linears(
    named_modules: Iterable[tuple[str, nn.Module]], blocked_by: str | None = None
) -> dict[nn.Parameter, nn.Parameter]:
    """Marks the weights of the ``Float8Linear`` modules among ``named_modules`` that asked for
    float8 all-gathers, replacing torchao's wrapper parameters by plain ones (returned as old ->
    new, so an optimizer built over the old ones still finds them), and gives each such module
    the forward that reads its gathered float8 weight. A weight that cannot be gathered in
    float8 (its recipe, or ``blocked_by``: see :func:`float8_gathers_blocked_by`) is gathered in
    its own dtype and cast by torchao in each forward, said in one log line per reason. Raises
    ImportError, before any collective, where a ``Float8Linear`` is found and torchao does not
    import."""
    replaced: dict[nn.Parameter, nn.Parameter] = {}
    kept: dict[tuple[str, bool], list[str]] = {}
    for name, linear, reason in _float8_linears(named_modules, blocked_by):
        config = linear.config
        weight_cast = config.cast_config_weight
        old = linear.weight
        # torchao's wrapper holds the weight as ._tensor; a plain parameter of it takes its place,
        # also where the weight is gathered in its own dtype: buckets hold plain tensors, and
        # torchao's forward casts a plain weight as it casts its wrapper's.
        if reason is not None:
            if hasattr(old, "_tensor"):
                replaced[old] = linear.weight = _plain_parameter(old)
            kept.setdefault((reason, bool(config.enable_fsdp_float8_all_gather)), []).append(name)
            continue
        new = linear.weight = replaced[old] = _plain_parameter(old)
        new._megatron_fsdp_float8 = Float8WeightSpec(
            weight_cast.target_dtype, linear.linear_mm_config, bool(config.round_scales_to_power_of_2)
        )
        linear.__class__ = _gathered_weight_class(type(linear))
    for (reason, asked), names in kept.items():
        logged = logger.warning if asked else logger.info
        logged("megatron_fsdp: %d Float8Linear weights (%s, ...) are gathered in their own dtype, not float8: %s",
               len(names), names[0], reason)
    return replaced


def _plain_parameter(old: nn.Parameter) -> nn.Parameter:
    """A new plain parameter over ``old``'s values, which ``old`` gives up: it lives on only as a
    key (an optimizer built over it finds the new one), and must not hold the full weight once
    the buckets have sharded it."""
    values = old._tensor if hasattr(old, "_tensor") else old
    new = nn.Parameter(values.detach(), requires_grad=old.requires_grad)
    values.data = torch.empty(0, dtype=values.dtype, device=values.device)
    return new


def float8_gathered_weights(module: nn.Module, blocked_by: str | None = None) -> dict[nn.Parameter, torch.dtype]:
    """The weights under ``module`` (as they are now: torchao's) that :func:`prepare_float8_linears`
    would gather in float8, with their float8 dtype; changes nothing (memory_plan.py's view)."""
    return {
        linear.weight: linear.config.cast_config_weight.target_dtype
        for _, linear, reason in _float8_linears(module.named_modules(), blocked_by)
        if reason is None
    }


def _float8_linears(
    named_modules: Iterable[tuple[str, nn.Module]], blocked_by: str | None
) -> list[tuple[str, nn.Module, str | None]]:
    """(name, module, why its weight is gathered in its own dtype, or None) of each
    ``Float8Linear``; ImportError where one is found and torchao does not import."""
    float8_modules = [(name, m) for name, m in named_modules if _is_float8_linear(m)]
    if not float8_modules:
        return []
    try:
        from torchao.float8.config import ScalingGranularity, ScalingType
    except ImportError as error:
        raise ImportError(TORCHAO_MISSING) from error
    found = []
    for name, linear in float8_modules:
        config = linear.config
        weight_cast = config.cast_config_weight
        reason = None
        if weight_cast.scaling_granularity is not ScalingGranularity.TENSORWISE:
            reason = f"rowwise ({weight_cast.scaling_granularity.value}) scales are made per row at each forward"
        elif weight_cast.scaling_type is not ScalingType.DYNAMIC:
            reason = f"{weight_cast.scaling_type.value} scaling"
        elif not config.enable_fsdp_float8_all_gather:
            reason = "not asked for (Float8LinearConfig(enable_fsdp_float8_all_gather=False))"
        elif not linear.weight.requires_grad:
            reason = "the weight is frozen (no main params to cast from)"
        elif blocked_by is not None:
            reason = blocked_by
        found.append((name, linear, reason))
    return found


class _Float8WeightFromGathered(torch.autograd.Function):
    """The gathered float8 weight as torchao's ``Float8TrainingTensor``; its gradient goes to
    the parameter unchanged (the parameter's values are not read: its float8 copy is)."""

    @staticmethod
    def forward(ctx, weight, data, scale, spec):  # noqa: ARG004 (weight: the autograd input)
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(data, scale, weight.dtype, spec.linear_mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def _forward_with_gathered_weight(linear: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """torchao's ``Float8Linear.forward`` over the gathered float8 weight: the weight is an
    argument, not module state written around the call, so a compiled block traces it as it
    traces any op (an attribute set in forward became a graph output whose gradient
    AOTAutograd could not match)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    param = linear._parameters["weight"]
    spec = float8_spec(param)
    if spec.source is None:  # no bucket holds it yet
        return super(type(linear), linear).forward(input)
    data, scale = spec.source()
    weight = _Float8WeightFromGathered.apply(param, data, scale, spec)
    if torch.is_autocast_enabled():
        input = input.to(torch.get_autocast_gpu_dtype())  # as torchao's forward does
    output = matmul_with_hp_or_float8_args.apply(input, weight.t(), linear.linear_mm_config, linear.config)
    if linear.bias is not None:
        output = output + linear.bias.to(output.dtype)
    return output


@functools.cache
def _gathered_weight_class(float8_linear: type) -> type:
    """``float8_linear`` (torchao's ``Float8Linear`` or a subclass) whose forward reads the
    gathered float8 weight: ``isinstance`` checks for torchao's class still hold."""
    return type(f"Gathered{float8_linear.__name__}", (float8_linear,), {"forward": _forward_with_gathered_weight})


def float8_scales(amax: torch.Tensor, float8_dtype: torch.dtype, round_to_power_of_2: bool) -> torch.Tensor:
    """torchao's tensorwise scale of each weight from its amax: the format's largest value over
    the amax (at least 1e-12), computed in float64, then float32; rounded down to a power of two
    when the recipe says so."""
    scales = (torch.finfo(float8_dtype).max / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    if round_to_power_of_2:
        scales = torch.exp2(torch.floor(torch.log2(scales)))
    return scales
