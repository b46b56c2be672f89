"""FSDP units: which parameters each unit owns, and a unit's sharded/unsharded life."""

from __future__ import annotations

import enum
import importlib
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn

from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.buckets.float8_bucket import Float8Bucket
from megatron_fsdp.engine.buckets.float8_weights import float8_spec
from megatron_fsdp.engine.buckets.offload import OffloadTransfers
from megatron_fsdp.engine.config import FSDPSettings
from megatron_fsdp.engine.groups.collectives import wait_for
from megatron_fsdp.engine.groups.mesh import DataParallelGroup
from megatron_fsdp.engine.params.dtensor_params import is_expert_param
from megatron_fsdp.engine.params.registered_params import RegisteredParams

logger = logging.getLogger(__name__)

ROOT_UNIT_NAME = "<root>"


class UnitState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gathers launched (a prefetch), not yet waited for
    UNSHARDED = "unsharded"


def resolve_unit_classes(fsdp_unit_modules: Iterable[type | str] | None) -> tuple[type, ...]:
    """Classes from classes or import paths (``"pkg.module.ClassName"``)."""
    classes = []
    for entry in fsdp_unit_modules or ():
        if isinstance(entry, type):
            classes.append(entry)
            continue
        if not isinstance(entry, str) or "." not in entry:
            raise ValueError(
                f"fsdp_unit_modules entry {entry!r} is neither a class nor an import path like 'package.module.ClassName'"
            )
        module_path, _, class_name = entry.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_path), class_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"fsdp_unit_modules entry {entry!r} cannot be imported: {error}") from error
        if not isinstance(cls, type):
            raise ValueError(f"fsdp_unit_modules entry {entry!r} is not a class")
        classes.append(cls)
    return tuple(classes)


def find_unit_modules(
    root: nn.Module, classes: tuple[type, ...], units_required: bool, log_absent: bool = True
) -> list[tuple[str, nn.Module]]:
    """Every module of the given classes, in registration order. Classes the model does not
    hold are accepted with one log line, as upstream accepts them (Megatron-LM names its MoE and
    Mamba layers for every GPT). ``units_required``: classes were named but none occurs, and the
    strategy shards weights (the whole model would be gathered at once): raise. ``log_absent``:
    False for a second look at the same model (the memory plan), so the line appears once."""
    found = [(name, m) for name, m in root.named_modules() if m is not root and isinstance(m, classes)]
    present = {type(m) for _, m in found}
    absent = [cls for cls in classes if not any(issubclass(p, cls) for p in present)]
    if classes and not found and units_required:
        model_classes = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(
            f"fsdp_unit_modules names {', '.join(_class_path(cls) for cls in absent)}, but the model holds no "
            f"module of those classes (its classes: {', '.join(model_classes)}): name the classes of its blocks"
        )
    if absent and log_absent:
        logger.info(
            "fsdp_unit_modules: the model holds no %s; %s",
            ", ".join(_class_path(cls) for cls in absent),
            "its parameters outside the other units form the root unit" if found else "the whole model is one unit",
        )
    return found


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def assign_params_to_units(root: nn.Module, unit_modules: Sequence[nn.Module]) -> dict[nn.Module | None, list[str]]:
    """Parameter names per owning unit (``None`` is the root unit). A parameter belongs to the
    innermost unit around the module that holds it; one reachable from two units (a weight tied
    across them) goes to the root, which stays gathered for the whole step."""
    unit_set = set(unit_modules)
    owners: dict[nn.Parameter, set] = {}

    def walk(module: nn.Module, unit: nn.Module | None) -> None:
        if module in unit_set:
            unit = module
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(param, set()).add(unit)
        for child in module.children():
            walk(child, unit)

    walk(root, None)
    assignment: dict[nn.Module | None, list[str]] = {None: []}
    for unit in unit_modules:
        assignment[unit] = []
    for name, param in root.named_parameters():
        units = owners[param]
        assignment[next(iter(units)) if len(units) == 1 else None].append(name)
    return assignment


class BucketKey(NamedTuple):
    """What the parameters of one bucket share within their unit."""

    owner: str  # the root unit's module holding them ("" in other units)
    dtype: torch.dtype
    requires_grad: bool
    expert: bool
    float8: torch.dtype | None = None  # torchao Float8Linear weights gathered in this float8 dtype
    # A weight megatron-core ties across pipeline stages (``shared_embedding``): alone in its
    # bucket, so that its shard range depends only on its shape and the data-parallel size, the
    # same on both stages, whose local gradients megatron-core all-reduces elementwise.
    tied_across_stages: bool = False


def bucket_groups(
    unit_name: str,
    named_params: Sequence[tuple[str, nn.Parameter]],
    float8_dtypes: Mapping[nn.Parameter, torch.dtype] | None = None,
    experts: Collection[nn.Parameter] | None = None,
) -> dict[BucketKey, list[tuple[str, nn.Parameter]]]:
    """A unit's parameters grouped into buckets, in order: one per dtype, trainability,
    expert-ness and float8 gathering; in the root unit also one per module. The root unit's
    parameters (embedding, head, final norm) meet backward far apart: one bucket per module lets
    the head's gradients reduce, and their buffer go back to the pool, long before the
    embedding's arrive at the end. ``float8_dtypes`` and ``experts``: the float8-gathered weights
    and the expert parameters when they are not marked yet (a plan of a model not sharded:
    memory_plan.py). A weight tied across pipeline stages gets a bucket of its own (see
    :class:`BucketKey`)."""
    groups: dict[BucketKey, list[tuple[str, nn.Parameter]]] = {}
    for param_name, param in named_params:
        owner = param_name.rpartition(".")[0] if unit_name == ROOT_UNIT_NAME else ""
        spec = float8_spec(param)
        float8 = float8_dtypes.get(param) if float8_dtypes is not None else spec and spec.float8_dtype
        expert = param in experts if experts is not None else is_expert_param(param)
        tied = bool(getattr(param, "shared_embedding", False))
        key = BucketKey(param_name if tied else owner, param.dtype, param.requires_grad, expert, float8, tied)
        groups.setdefault(key, []).append((param_name, param))
    return groups


def pool_role(key: BucketKey, is_root: bool) -> str:
    """The same role for the matching buckets of every (repetitive) unit, so they alternate
    on two persistent pool blocks; the root unit's buckets, live all step, get their own."""
    unit = f"root:{key.owner}" if is_root else f"tied:{key.owner}" if key.tied_across_stages else "unit"
    trainable = "trainable" if key.requires_grad else "frozen"
    float8 = f":{str(key.float8).removeprefix('torch.')}" if key.float8 is not None else ""
    return f"{unit}:{str(key.dtype).removeprefix('torch.')}:{trainable}{':expert' if key.expert else ''}{float8}"


class FSDPUnit:
    """One unit's buckets and its state: weights gathered (UNSHARDED) or not (SHARDED)."""

    def __init__(
        self,
        name: str,
        named_params: list[tuple[str, nn.Parameter]],
        dp: DataParallelGroup,
        settings: FSDPSettings,
        pool: torch.ScriptObject,
        transfers: OffloadTransfers | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """``compute_dtype``: the dtype forward computes in (FSDP2's ``param_dtype``); None: each
        parameter's own."""
        self.name = name
        self.settings = settings
        # The unit whose forward brackets the step (stays gathered into backward). The wrapper's
        # root unit is one from the start; FSDP2's front door names its root at the first forward.
        self.is_root = name == ROOT_UNIT_NAME
        self.buckets = [
            self._bucket(members, dp, settings, pool, pool_role(key, self.is_root), key, transfers, compute_dtype)
            for key, members in bucket_groups(name, named_params).items()
        ]
        self.trainable_buckets = [b for b in self.buckets if b.requires_grad]
        # Frozen weights are still read in backward, but no gradient says when they are done:
        # such a unit is resharded at the end of backward instead of when its grads arrive.
        self._all_trainable = bool(self.buckets) and all(b.requires_grad for b in self.buckets)
        # FSDP2's per-module switches; the whole-model wrapper keeps these defaults.
        # reshard_after_forward None: every unit but the root reshards after its forward.
        self.reshard_after_forward: bool | None = None
        self.reshard_after_backward = True
        # False: gradients stay un-reduced, accumulating, until a backward with it True.
        self.requires_gradient_sync = True
        # False (FSDP2's set_requires_all_reduce under HSDP): gradients are reduced over the shard
        # group and accumulate there; their average over the replicas waits for it to be True.
        self.requires_all_reduce = True
        # FSDP2's front door: which tensors the modules' attributes hold (None: the wrapper's
        # modules keep the compute parameters registered throughout).
        self.registration: RegisteredParams | None = None
        shards = settings.strategy.shards_weights and bool(self.buckets)
        self.state = UnitState.SHARDED if shards else UnitState.UNSHARDED
        self._reduced_buckets: set[int] = set()
        self._gathers: list = []

    @staticmethod
    def _bucket(
        members: list[tuple[str, nn.Parameter]],
        dp: DataParallelGroup,
        settings: FSDPSettings,
        pool: torch.ScriptObject,
        pool_role: str,
        key: BucketKey,
        transfers: OffloadTransfers | None,
        compute_dtype: torch.dtype | None,
    ) -> Bucket:
        names, params = [n for n, _ in members], [p for _, p in members]
        bucket_class = Float8Bucket if key.float8 is not None else Bucket
        if not key.expert:
            return bucket_class(names, params, dp, settings, pool, pool_role, transfers=transfers, compute_dtype=compute_dtype)
        # Expert gradients hold the contributions of every rank whose tokens reached the expert:
        # summed over the expert-data-parallel group (and its outer replicas, which divide by
        # their own count), they average over the dense one.
        inner_divisor = dp.dense_size // (dp.expert.outer.size if dp.expert.outer is not None else 1)
        return bucket_class(
            names, params, dp.expert, settings, pool, pool_role, grad_divisor=inner_divisor, transfers=transfers,
            compute_dtype=compute_dtype,
        )

    @property
    def reshard_on_grads(self) -> bool:
        """Whether the unit reshards once every gradient of it arrived (not at the end of backward)."""
        return self._all_trainable and self.reshard_after_backward

    @property
    def reshards_after_forward(self) -> bool:
        return not self.is_root if self.reshard_after_forward is None else self.reshard_after_forward

    def start_unshard(self) -> None:
        """Launches the all-gathers (asynchronous: on CUDA they overlap with compute)."""
        if self.state is not UnitState.SHARDED:
            return
        self._gathers = [bucket.weights.gather(async_op=True) for bucket in self.buckets]
        self.state = UnitState.UNSHARDING

    def unshard(self) -> None:
        """Gathers the weights (or waits for a prefetch) and points the parameters at them."""
        self.start_unshard()
        if self.state is not UnitState.UNSHARDING:
            return
        for index, (bucket, work) in enumerate(zip(self.buckets, self._gathers)):
            if work is not None:
                what = (f"unit {self.name!r}: the all-gather of its weights (bucket {index}: {bucket.dtype}, "
                        f"{bucket.names[0]} .. {bucket.names[-1]})")
                wait_for(work, self.settings.collective_timeout, what, bucket.dp.group, bucket.device)
            bucket.weights.point_params_at_full()
        self._gathers = []
        self.state = UnitState.UNSHARDED
        if self.registration is not None:
            self.registration.show_unsharded()

    def reshard(self) -> None:
        if self.state is UnitState.SHARDED or not self.settings.strategy.shards_weights:
            return
        self.unshard()  # a prefetch still in flight must land before its memory goes back
        for bucket in self.buckets:
            bucket.weights.release()
        self.state = UnitState.SHARDED
        if self.registration is not None:
            self.registration.show_sharded()

    def note_bucket_reduced(self, bucket: Bucket) -> bool:
        """True once every trainable bucket of the unit has launched its reduction."""
        self._reduced_buckets.add(id(bucket))
        return len(self._reduced_buckets) == len(self.trainable_buckets)

    def end_backward(self) -> None:
        self._reduced_buckets.clear()
        for bucket in self.trainable_buckets:
            bucket.grads.end_backward()
