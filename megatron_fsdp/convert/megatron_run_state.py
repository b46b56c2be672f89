"""The run state a Megatron-LM checkpoint carries beside its tensors, moved between fsdp_dtensor
and torch_dist: the optimizer's param groups and Adam step count, and the RNG state, each in the
form the other format's loader asks for.

- fsdp_dtensor (megatron-core's ``sharded_param_state_fsdp_dtensor``): per parameter,
  ``optimizer.param_to_group_meta.<prefix><name>.<key>`` items (its group's settings) and an fp32
  scalar ``optimizer.state.<prefix><name>.step``; the RNG state flattened as
  ``rng_state.(<pp>, <tp>).<i>.<field>`` (its generator states as uint8 tensors).
- torch_dist: the groups (without their parameters, each with ``step``) in the distributed
  optimizer's ``optimizer`` state (the ``dp_group_idx_0.optimizer/shard_0_1`` item for
  ``dp_reshardable``, the common state for ``fully_reshardable``); the RNG state as the
  ShardedObject ``rng_state/shard_<pp>.<tp>_<PP>.<TP>``, a list of one dict per saving rank.

Which group a parameter belongs to is not stored by torch_dist; megatron-core's default puts
1-D parameters and biases in the group without weight decay (``wd_mult`` 0), and that is the
rule used here; checkpoints with other groups (decoupled LR, per-module overrides) are refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_fsdp.convert.errors import ConversionError
from megatron_fsdp.convert.plan import Plan
from megatron_fsdp.convert.sources import DcpSource, TensorInfo

GROUP_META = "optimizer.param_to_group_meta."
DP_RESHARDABLE_GROUPS = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
_FSDP_RNG = re.compile(r"^rng_state\.\((\d+), (\d+)\)\.(\d+)\.(.+)$")
_TORCH_DIST_RNG = re.compile(r"^rng_state/shard_(\d+)\.(\d+)_(\d+)\.(\d+)$")
_TRACKER = "rng_tracker_states"
_NO_OPTIMIZER_FIX = "convert the weights alone with --no-optimizer and resume with --no-load-optim"


@dataclass
class RunState:
    """``groups``: the optimizer's param groups (settings only, no ``params`` or ``step``) in
    megatron-core's order; ``step``: Adam's step count; ``rng``: per
    ``(pp, tp)`` rank, the list of RNG-state dicts saved for it; ``grid``: ``(PP, TP)``."""

    groups: list[dict[str, Any]] = field(default_factory=list)
    step: float | None = None
    rng: dict[tuple[int, int], list[dict[str, Any]]] = field(default_factory=dict)
    grid: tuple[int, int] = (1, 1)


def _set_path(target: dict[str, Any], path: str, value: Any) -> None:
    head, _, rest = path.partition(".")
    if rest and head == _TRACKER:
        target.setdefault(head, {})[rest] = value
    else:
        target[path] = value


def read_fsdp_dtensor_state(source: DcpSource, optimizer_prefix: str) -> RunState:
    """The run state of an fsdp_dtensor checkpoint."""
    state = RunState()
    metas: dict[str, dict[str, Any]] = {}
    for name in source.objects:
        if name.startswith(GROUP_META):
            param, key = name[len(GROUP_META) :].rsplit(".", 1)
            metas.setdefault(param, {})[key] = source.read_item(name)
    keys: list[tuple] = []
    for meta in metas.values():
        key = tuple(sorted(meta.items(), key=repr))
        if key not in keys:
            keys.append(key)
            state.groups.append(dict(meta))
    # megatron-core orders its groups by their first parameter in registration order: a GPT's
    # embedding, with weight decay (its loader pairs groups by their settings, not their place).
    state.groups.sort(key=lambda group: group.get("wd_mult", 1.0) == 0.0)
    steps = {float(source.read(name)) for name in source.tensors if name.startswith(optimizer_prefix) and name.endswith(".step")}
    if len(steps) > 1:
        raise ConversionError(f"{source.path}: the parameters' Adam step counts differ ({sorted(steps)}): {_NO_OPTIMIZER_FIX}")
    state.step = steps.pop() if steps else None
    for name in [*source.objects, *source.tensors]:
        match = _FSDP_RNG.match(name)
        if match is None:
            continue
        pp, tp, index, path = int(match[1]), int(match[2]), int(match[3]), match[4]
        saved = state.rng.setdefault((pp, tp), [])
        saved.extend({} for _ in range(index + 1 - len(saved)))
        _set_path(saved[index], path, source.read(name) if name in source.tensors else source.read_item(name))
    if state.rng:
        state.grid = (1 + max(pp for pp, _ in state.rng), 1 + max(tp for _, tp in state.rng))
    return state


def read_torch_dist_state(source: DcpSource, sharding: str | None) -> RunState:
    """The run state of a torch_dist checkpoint (``sharding``: its distributed optimizer's
    ``distrib_optim_sharding_type``)."""
    state = RunState()
    if sharding == "dp_reshardable" and DP_RESHARDABLE_GROUPS in source.objects:
        optimizer = source.read_item(DP_RESHARDABLE_GROUPS)[0]
    else:
        optimizer = (source.read_object("optimizer") or {}).get("optimizer") or {}
    for group in optimizer.get("param_groups", []):
        settings = {key: value for key, value in group.items() if key not in ("params", "step")}
        state.groups.append(settings)
        state.step = group.get("step", state.step)
    for name in source.objects:
        match = _TORCH_DIST_RNG.match(name)
        if match is not None:
            state.rng[(int(match[1]), int(match[2]))] = source.read_item(name)[0]
            state.grid = (int(match[3]), int(match[4]))
    return state


def _require_groups(state: RunState) -> None:
    if state.step is None or not state.groups:
        raise ConversionError(f"the checkpoint holds Adam state but no param groups or step count: it is incomplete; {_NO_OPTIMIZER_FIX}")


def torch_dist_optimizer_common(state: RunState) -> dict[str, Any]:
    """The distributed optimizer's non-tensor state in torch_dist's common state, as megatron-core
    saves it with the ``fully_reshardable`` model-space tensors."""
    _require_groups(state)
    groups = [{**group, "step": state.step} for group in state.groups]
    return {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}


def add_torch_dist_rng(plan: Plan, state: RunState) -> None:
    """The RNG state as torch_dist's ShardedObjects."""
    pp_size, tp_size = state.grid
    for (pp, tp), saved in state.rng.items():
        plan.objects[f"rng_state/shard_{pp}.{tp}_{pp_size}.{tp_size}"] = [saved]


def _constant(value: torch.Tensor):
    def build(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [value.clone()]

    return build


def _no_decay(name: str, info: TensorInfo) -> bool:
    """megatron-core's default: biases and 1-D parameters take no weight decay."""
    return name.endswith(".bias") or len(info.shape) == 1


def _group_index(state: RunState, param: str, info: TensorInfo) -> int:
    if len(state.groups) == 1:
        return 0
    decay = [index for index, group in enumerate(state.groups) if group.get("wd_mult", 1.0) != 0.0]
    no_decay = [index for index, group in enumerate(state.groups) if group.get("wd_mult", 1.0) == 0.0]
    if len(state.groups) != 2 or len(decay) != 1 or len(no_decay) != 1:
        raise ConversionError(
            f"the checkpoint's optimizer has {len(state.groups)} param groups; which parameter is in which is not "
            f"stored by torch_dist, and only megatron-core's default two (weight decay, and none for biases and 1-D "
            f"parameters) are placed here: {_NO_OPTIMIZER_FIX}"
        )
    return no_decay[0] if _no_decay(param, info) else decay[0]


def add_fsdp_dtensor_optimizer_state(plan: Plan, state: RunState, optimizer_prefix: str) -> None:
    """Each parameter's group settings and step, for every parameter the plan writes Adam state for."""
    _require_groups(state)
    suffix = ".exp_avg"
    params = [name[len(optimizer_prefix) : -len(suffix)] for name in list(plan.targets) if name.startswith(optimizer_prefix) and name.endswith(suffix)]
    step = torch.tensor(state.step, dtype=torch.float32)
    for param in params:
        info = plan.targets[f"{optimizer_prefix}{param}{suffix}"]
        # megatron-core keys a SwiGLU fc1's group by the whole parameter, its state by the halves
        whole = param[:-2] if param.endswith(("_w", "_v")) and param[:-2] + "_w" in params and param[:-2] + "_v" in params else param
        for key, value in state.groups[_group_index(state, param, info)].items():
            plan.objects[f"{GROUP_META}{optimizer_prefix[len('optimizer.state.') :]}{whole}.{key}"] = value
        plan.add([], [(f"{optimizer_prefix}{param}.step", TensorInfo((), torch.float32))], _constant(step))


def add_fsdp_dtensor_rng(plan: Plan, state: RunState) -> None:
    """The RNG state flattened as fsdp_dtensor keeps it: tensors as tensors, the rest as items."""
    for (pp, tp), saved in state.rng.items():
        for index, fields in enumerate(saved):
            flat = {f"{key}.{name}": value for key, values in fields.items() if isinstance(values, dict) for name, value in values.items()}
            flat.update({key: value for key, value in fields.items() if not isinstance(value, dict)})
            for path, value in flat.items():
                name = f"rng_state.({pp}, {tp}).{index}.{path}"
                if isinstance(value, torch.Tensor):
                    plan.add([], [(name, TensorInfo(tuple(value.shape), value.dtype))], _constant(value))
                else:
                    plan.objects[name] = value
