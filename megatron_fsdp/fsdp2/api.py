"""``fully_shard(module, *, mesh, reshard_after_forward, shard_placement_fn, mp_policy,
offload_policy, ignored_params)``: torch FSDP2's call, sharding ``module`` in place over
megatron_fsdp's engine.

Each call makes one engine unit of the module's parameters that no earlier call on a submodule
took: the same flat, dtype-aware buckets, C++ ops and schedule as ``fully_shard_model``'s
units, with the strategy ``optim_grads_params`` (weights, gradients and optimizer state sharded).
Every argument is checked, and a call we cannot honour raises, on every rank before any
collective.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp.engine.buckets.float8_weights import float8_gathers_blocked_by, prepare_float8_linears
from megatron_fsdp.engine.config import FSDPSettings, ShardingStrategy
from megatron_fsdp.engine.groups.mesh import DataParallelGroup, resolve_dp_shard_group, resolve_outer_group
from megatron_fsdp.engine.params.dtensor_params import param_extent
from megatron_fsdp.engine.params.piece_dtensor import PieceDTensor, refuse_one_process_write
from megatron_fsdp.engine.params.registered_params import Registration
from megatron_fsdp.engine.planning.transformer_engine_refusal import refuse_transformer_engine
from megatron_fsdp.engine.step.units import FSDPUnit
from megatron_fsdp.fsdp2.module import MegatronFSDPModule
from megatron_fsdp.fsdp2.pipelining import expose_to_pipelining
from megatron_fsdp.fsdp2.state import STATE_ATTRIBUTE, ModuleShardingState, shared_resources, state_of
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy

logger = logging.getLogger(__name__)

# The class each module class becomes, made once per class (as FSDP2 does).
_SHARDED_CLASSES: dict[type, type] = {}


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: TorchMixedPrecisionPolicy = TorchMixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module | list[nn.Module]:
    """Shards ``module``'s parameters in place and returns ``module``, now an instance of torch's
    ``FSDPModule`` (its class becomes ``FSDP<Cls>``). Call it on each block, then on the root.
    A list of modules makes one unit of all their parameters (FSDP2's group: a final norm and
    the head, say, which may run at different times); the list comes back.

    - ``mesh``: a 1-D ``DeviceMesh`` to shard over (None: every rank of the default group), or a
      2-D one with named dims (HSDP: replicated over dim 0, sharded over dim 1).
    - ``reshard_after_forward``: True gives the gathered weights back after forward and gathers
      again in backward; False keeps them from forward through backward; None (default): True,
      except for the root (the module whose forward runs first), as FSDP2.
    - ``shard_placement_fn``: may return None or ``Shard(0)`` (``Shard(-1)`` of a 1-D one) for a parameter.
    - ``mp_policy``: torch's ``MixedPrecisionPolicy``. ``param_dtype`` is the dtype forward
      computes in (the sharded parameters keep theirs, and the optimizer steps them);
      ``reduce_dtype`` (default ``param_dtype``) the dtype gradients travel in, summed in the
      parameters' dtype; ``output_dtype`` and ``cast_forward_inputs`` as FSDP2's.
    - ``offload_policy``: ``OffloadPolicy()`` (no offloading) or ``CPUOffloadPolicy(pin_memory)``:
      the sharded parameters (what the optimizer steps), their gradients and so the optimizer
      state live on the host (docs/offloading.md); the stepped parameters reach the device at
      the root's next forward.
    - ``ignored_params``: parameters left as they are: not sharded, not reduced.

    After the call, ``module.parameters()`` are DTensors holding this rank's piece of each
    parameter (a contiguous range of the flattened parameter: see docs/fsdp2.md); a torch
    optimizer built over them steps the weights the next forward uses.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    ignored = _check_call(modules, reshard_after_forward, mp_policy, offload_policy, ignored_params)
    shard_in_place(
        modules, mesh, ignored=ignored, shard_placement_fn=shard_placement_fn,
        reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
        offload_pin_memory=offload_policy.pin_memory if isinstance(offload_policy, CPUOffloadPolicy) else None,
    )
    return modules if isinstance(module, (list, tuple)) else module


def shard_in_place(
    modules: list[nn.Module],
    mesh: DeviceMesh | None,
    *,
    ignored: set[nn.Parameter] = frozenset(),
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    reshard_after_forward: bool | None = None,
    mp_policy: TorchMixedPrecisionPolicy = TorchMixedPrecisionPolicy(),
    engine_policy: MixedPrecisionPolicy | None = None,
    grad_divisor: float = 1.0,
    offload_pin_memory: bool | None = None,
) -> None:
    """What every in-place front door does once its own arguments are checked (each module by
    :func:`check_module`): one unit of the modules' parameters, its hooks, ``FSDP<Cls>``.
    ``engine_policy``: megatron_fsdp's policy as it is (upstream's v2), instead of the one made
    from FSDP2's ``mp_policy`` (which then only casts inputs and outputs); ``grad_divisor``:
    reduced gradients are divided by it on top of the group size (upstream's v2);
    ``offload_pin_memory``: offload (FSDP2's ``CPUOffloadPolicy(pin_memory)``), None: do not."""
    keyed = _managed_registrations_of(modules, ignored)
    name = ", ".join(type(module).__name__ for module in modules)
    _check_params(name, keyed, shard_placement_fn, mesh)
    dp = _with_tensor_parallel_mesh(_data_parallel_group(mesh), keyed)
    if prepare_float8_linears(_weight_owners(keyed), float8_gathers_blocked_by(offload_pin_memory is not None, False)):
        keyed = _managed_registrations_of(modules, ignored)  # the float8 linears hold new weights
    materialises = bool(keyed) and keyed[0].param.is_meta
    if materialises:
        keyed = _materialise(keyed, _mesh_device(mesh))
    first_key = _first_keys(keyed)
    params = list(first_key)
    if mesh is not None and params and not materialises:
        _move_to_mesh_device(modules, params, _mesh_device(mesh))
    policy, compute_dtype = (engine_policy, None) if engine_policy is not None else _mixed_precision(params, mp_policy)
    offloads = offload_pin_memory is not None
    settings = FSDPSettings(
        strategy=ShardingStrategy.OPTIM_GRADS_PARAMS, mixed_precision=policy, sync_model_each_microbatch=True,
        cpu_offload=offloads, offload_pin_memory=bool(offload_pin_memory),
    )
    resources = shared_resources()
    device = params[0].device if params else _mesh_device(mesh)
    transfers = resources.transfers(device, bool(offload_pin_memory)) if offloads else None
    unit = FSDPUnit(
        name, [(first_key[p], p) for p in params], dp, settings, resources.pool, transfers, compute_dtype=compute_dtype
    )
    if reshard_after_forward is not None:
        unit.reshard_after_forward = reshard_after_forward
    for bucket in unit.trainable_buckets:
        bucket.grad_divisor *= grad_divisor
    state = ModuleShardingState(modules, unit, dp, settings, mp_policy, keyed, resources)
    # Eager under torch.compile, as FSDP2's own hooks are: a compiled block's call would otherwise
    # compile these hooks' frames up to the engine's (eager) step hooks, a graph break and a
    # resume frame for each, whose guards run on every call.
    pre_forward = torch.compiler.disable(state.pre_forward)
    post_forward = torch.compiler.disable(state.post_forward)
    for module in modules:
        module.__dict__[STATE_ATTRIBUTE] = state
        expose_to_pipelining(module, state)
        module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(post_forward)
        module.__class__ = _sharded_class(type(module))
    state.register_state_dict_hooks(modules)
    logger.info(
        "megatron_fsdp.fsdp2: %s sharded in place over %d ranks (%d parameters, %d buckets)",
        name, dp.size, len(params), len(unit.buckets),
    )


def _check_call(
    modules: list[Any],
    reshard_after_forward: Any,
    mp_policy: Any,
    offload_policy: Any,
    ignored_params: Any,
) -> set[nn.Parameter]:
    """The arguments that need no look at the parameters; returns the ignored ones."""
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for module in modules:
        check_module(module)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"reshard_after_forward={reshard_after_forward!r}: resharding to a smaller world after forward is not "
            "supported by megatron_fsdp.fsdp2; pass True, False or None"
        )
    if not isinstance(mp_policy, TorchMixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy (also exported by megatron_fsdp.fsdp2), "
            f"got {type(mp_policy).__name__}"
        )
    if type(offload_policy) not in (OffloadPolicy, CPUOffloadPolicy):
        raise TypeError(f"offload_policy must be torch's OffloadPolicy() or CPUOffloadPolicy(pin_memory=...), got {offload_policy!r}")
    ignored = set(ignored_params or ())
    if any(not isinstance(p, nn.Parameter) for p in ignored):
        raise TypeError("ignored_params must be a set of nn.Parameter")
    return ignored


def check_module(module: Any) -> None:
    """A module that can be sharded in place: a plain ``nn.Module``, not sharded already by any
    API (the whole-model wrapper included)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    # Checked on the modules alone, so every rank raises alike before any collective.
    by_torch = [name for name, sub in module.named_modules() if isinstance(sub, FSDPModule) and not isinstance(sub, MegatronFSDPModule)]
    if by_torch:
        what = f"its submodule {by_torch[0]!r} is" if by_torch[0] else "it is"
        raise ValueError(
            f"megatron_fsdp.fsdp2.fully_shard({type(module).__name__}): {what} sharded by torch's own fully_shard "
            "(torch.distributed.fsdp); the two implementations cannot be mixed in one model: shard every module "
            "with megatron_fsdp.fsdp2.fully_shard, or every one with torch's"
        )
    if isinstance(module, FSDPModule):
        raise ValueError(f"{type(module).__name__} is already sharded by fully_shard: call it once per module")
    refuse_transformer_engine(module)
    if type(module).__name__ == "MegatronFSDP" or any(hasattr(p, "_megatron_fsdp_owner") for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} is (part of) a model sharded by megatron_fsdp's whole-model fully_shard "
            "(MegatronFSDP): shard the model with one API, either fully_shard_model(model, fsdp_unit_modules=[...]) "
            "or megatron_fsdp.fsdp2.fully_shard per block and root, on the plain model"
        )


def _managed_registrations_of(modules: list[nn.Module], ignored: set[nn.Parameter]) -> list[Registration]:
    return [entry for module in modules for entry in _managed_registrations(module, ignored)]


def _first_keys(keyed: list[Registration]) -> dict[nn.Parameter, str]:
    """Each parameter, in order of first registration, under its first key (a tied weight's
    other registrations name it again)."""
    first: dict[nn.Parameter, str] = {}
    for registration in keyed:
        first.setdefault(registration.param, registration.key)
    return first


def _weight_owners(keyed: list[Registration]) -> list[tuple[str, nn.Module]]:
    """(name, module) of each module whose ``weight`` this call shards: where torchao's
    ``Float8Linear`` weights are found (engine/buckets/float8_weights.py), not under modules sharded earlier."""
    owners = {owner: key.rpartition(".")[0] for key, owner, attribute, _ in keyed if attribute == "weight"}
    return [(name, owner) for owner, name in owners.items()]


def _managed_registrations(module: nn.Module, ignored: set[nn.Parameter]) -> list[Registration]:
    """Every registration of a parameter this call shards: those under ``module`` outside
    submodules already sharded in place, less the ignored. A tied weight has one entry per
    registration."""
    found: list[Registration] = []

    def walk(owner: nn.Module, prefix: str) -> None:
        for name, param in owner._parameters.items():
            if param is not None and param not in ignored:
                found.append(Registration(prefix + name, owner, name, param))
        for child_name, child in owner._modules.items():
            if child is not None and state_of(child) is None:
                walk(child, f"{prefix}{child_name}.")

    walk(module, "")
    return found


def _is_shard_0(placement: Any, ndim: int) -> bool:
    """``Shard(0)``, or a ``Shard`` of the same dim counted from the end (``Shard(-1)`` of a 1-D parameter)."""
    return isinstance(placement, Shard) and -ndim <= placement.dim < ndim and placement.dim % ndim == 0


def _check_params(
    name: str,
    keyed: list[Registration],
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    mesh: DeviceMesh | None,
) -> None:
    for key, owner, _, param in keyed:
        if isinstance(param, DTensor):
            _check_tensor_parallel_param(key, param, mesh)
        if isinstance(owner, FSDPModule):
            raise ValueError(f"{key} belongs to a module sharded by torch's own fully_shard: use one fully_shard for the model")
        if shard_placement_fn is not None:
            placement = shard_placement_fn(param)
            if placement is not None and not _is_shard_0(placement, param.ndim):
                raise ValueError(
                    f"shard_placement_fn returned {placement!r} for {key}: megatron_fsdp.fsdp2 shards every parameter "
                    "into contiguous pieces of its flattened value over the mesh's one dim; return None or Shard(0)"
                )
    devices = {param.device for _, _, _, param in keyed}
    if len(devices) > 1 and torch.device("meta") in devices:
        raise ValueError(
            f"{name}'s parameters are partly on the meta device ({sorted(map(str, devices))}): build "
            "the whole model on the meta device, or none of it"
        )
    if len(devices) > 1:
        raise ValueError(f"{name}'s parameters are spread over {sorted(map(str, devices))}: move them to one device")


def _check_tensor_parallel_param(key: str, param: DTensor, mesh: DeviceMesh | None) -> None:
    """A DTensor parameter (``parallelize_module``'s) is sharded as its local tensor over ``mesh``,
    data-parallel dims of the same devices as the mesh it was tensor-parallelised on, as FSDP2
    does; checked on metadata alone, so every rank raises alike before any collective."""
    tp_mesh = param.device_mesh
    tp_names = tp_mesh.mesh_dim_names or ()
    if not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names or not tp_names:
        # Without a mesh it may also be a parameter torch's own fully_shard sharded (under a
        # module sharded by torch's), which nothing on the parameter tells apart.
        raise ValueError(
            f"{key} is a DTensor on mesh {tp_mesh}: if it was sharded by torch's fully_shard, shard every module "
            "with one fully_shard; if it is tensor parallel, fully_shard needs the data-parallel dims of the same "
            f"devices as mesh=..., with named dims, to shard its local tensor over: {_TENSOR_PARALLEL_FIX}"
        )
    if set(tp_names) & set(mesh.mesh_dim_names):
        raise ValueError(_not_other_dims(key, tp_names, mesh))
    # The whole-model door's check of what its buckets can place (Shard or Replicate, each tensor dim split once).
    param_extent(key, param)


def _with_tensor_parallel_mesh(dp: DataParallelGroup, keyed: list[Registration]) -> DataParallelGroup:
    """``dp`` whose faces of DTensor parameters live on the data-parallel dim and the parameters'
    own (FSDP2's 2-D placements): the two meshes joined as FSDP2 joins them, since a client such
    as torchtitan slices them from different meshes over the same devices."""
    tp_meshes = {registration.param.device_mesh for registration in keyed if isinstance(registration.param, DTensor)}
    if not tp_meshes:
        return dp
    if len(tp_meshes) > 1:
        raise ValueError(
            f"one fully_shard call holds DTensor parameters on {len(tp_meshes)} different meshes "
            f"({', '.join(sorted(str(m.mesh_dim_names) for m in tp_meshes))}); shard the modules of each in calls of their own"
        )
    (tp_mesh,) = tp_meshes
    try:
        # The mesh's coordinates are computed from its rank tensor, which must stay a real tensor
        # under a FakeTensorMode (megatron_fsdp.simulate's); nothing else changes.
        with unset_fake_temporarily():
            joined = DeviceMesh._concatenate([dp.mesh, tp_mesh])
    except RuntimeError as error:  # from the meshes' layouts alone: every rank alike
        key = next(r.key for r in keyed if isinstance(r.param, DTensor))
        raise ValueError(_not_other_dims(key, tp_mesh.mesh_dim_names, dp.mesh) + f" ({error})") from error
    return dataclasses.replace(dp, root_mesh=joined)


_TENSOR_PARALLEL_FIX = (
    "tensor-parallelise with parallelize_module(module, world_mesh['tp'], plan) and shard with "
    "fully_shard(module, mesh=world_mesh['dp']), both meshes sliced from one named mesh "
    "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))"
)


def _not_other_dims(key: str, tp_names: Any, mesh: DeviceMesh) -> str:
    return (
        f"{key} is a DTensor on mesh dims {tuple(tp_names)}, which are not other dims of the devices fully_shard's "
        f"mesh (dims {mesh.mesh_dim_names}) spans; {_TENSOR_PARALLEL_FIX}"
    )


def _data_parallel_group(mesh: Any) -> DataParallelGroup:
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}")
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard needs a 1-D mesh, or a 2-D one for HSDP; got {mesh.ndim} dims {mesh.mesh_dim_names}")
    if mesh is None or mesh.ndim == 1:
        return resolve_dp_shard_group(mesh, None)
    # HSDP, as FSDP2: replicate over dim 0, shard over dim 1.
    if mesh.mesh_dim_names is None:
        raise ValueError(
            "a 2-D mesh (HSDP) needs dim names: init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
        )
    replicate, shard = mesh.mesh_dim_names
    return resolve_outer_group(resolve_dp_shard_group(mesh, shard), mesh, replicate, None, False)


def _mesh_device(mesh: DeviceMesh | None) -> torch.device:
    """The device a mesh computes on (FSDP2's rule); without a mesh, the current CUDA device if
    there is one, else the CPU."""
    device_type = mesh.device_type if mesh is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, getattr(torch, device_type).current_device())


def _materialise(keyed: list[Registration], device: torch.device) -> list[Registration]:
    """Meta parameters replaced by parameters of uninitialised memory on ``device``, one call's
    at a time (the buckets copy them and let them go): as after FSDP2's ``to_empty``, the module's
    own init then writes the pieces. A meta tensor cannot take data in place, so each is a new
    object, registered wherever the meta one was (ties survive)."""
    replacements: dict[nn.Parameter, nn.Parameter] = {}
    for _, _, _, param in keyed:
        if param not in replacements:
            replacements[param] = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
            replacements[param].__dict__.update(param.__dict__)  # what marks it (a float8 weight's spec)
    for _, owner, name, param in keyed:
        owner._parameters[name] = replacements[param]
    return [registration._replace(param=replacements[registration.param]) for registration in keyed]


def _move_to_mesh_device(modules: list[nn.Module], params: list[nn.Parameter], device: torch.device) -> None:
    """As FSDP2: the parameters (and the buffers beside them) go to the mesh's device."""
    with torch.no_grad():
        for param in params:
            if param.device != device:
                param.data = param.data.to(device)
        for owner in (m for module in modules for m in module.modules()):
            for name, buffer in owner._buffers.items():
                if buffer is not None and buffer.device != device:
                    owner._buffers[name] = buffer.to(device)


def _mixed_precision(
    params: list[nn.Parameter], mp_policy: TorchMixedPrecisionPolicy
) -> tuple[MixedPrecisionPolicy, torch.dtype | None]:
    """The engine's policy and compute dtype for FSDP2's: the sharded (main) parameters and
    gradients keep the parameters' dtype, forward computes in ``param_dtype``, gradients travel
    in ``reduce_dtype`` (default ``param_dtype``)."""
    dtypes = {p.dtype for p in params}
    param_dtype = mp_policy.param_dtype
    if param_dtype is not None and dtypes == {param_dtype}:
        param_dtype = None
    if param_dtype is None or not dtypes:  # no parameters of its own (a root over sharded blocks): nothing to cast
        return MixedPrecisionPolicy(main_params_dtype=None, grad_comm_dtype=mp_policy.reduce_dtype), None
    if len(dtypes) > 1:
        raise NotImplementedError(
            f"mp_policy.param_dtype={param_dtype} with parameters of several dtypes {sorted(map(str, dtypes))} is not "
            "supported by megatron_fsdp.fsdp2: give the module's parameters one dtype first"
        )
    (main,) = dtypes
    comm = mp_policy.reduce_dtype or param_dtype
    return MixedPrecisionPolicy(main_params_dtype=main, main_grads_dtype=main, grad_comm_dtype=comm), param_dtype


def _refuse_deepcopy(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a module sharded in place by fully_shard cannot be deep-copied: copy it before fully_shard")


def _save_pretrained_of_full_tensors(cls: type) -> Callable[..., Any]:
    """Hugging Face's ``save_pretrained`` for ``FSDP<cls>``: given full tensors in ``state_dict``
    (torch's ``get_model_state_dict(..., full_state_dict=True)``, what Trainer's and Accelerate's
    FSDP2 paths pass), the model's own. Without one, or with the sharded pieces in it, refused
    before anything is written: Transformers would write the config, then fail inside
    safetensors on the writing rank alone (Trainer calls it on the first rank only)."""

    def save_pretrained(self: nn.Module, *args: Any, state_dict: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if state_dict is None or any(isinstance(value, PieceDTensor) for value in state_dict.values()):
            raise refuse_one_process_write(
                f"{type(self).__name__}.save_pretrained of a model sharded in place by megatron_fsdp.fsdp2, "
                "without full tensors in state_dict (pass state_dict=get_model_state_dict(model, "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True)), gathered on every rank, as under FSDP2; "
                "or call megatron_fsdp.save_pretrained(model, directory) on every rank, which gathers nothing)"
            )
        return cls.save_pretrained(self, *args, state_dict=state_dict, **kwargs)

    return save_pretrained


def _sharded_class(cls: type) -> type:
    sharded = _SHARDED_CLASSES.get(cls)
    if sharded is None:
        methods: dict[str, Any] = {"__deepcopy__": _refuse_deepcopy}
        if callable(getattr(cls, "save_pretrained", None)):
            methods["save_pretrained"] = _save_pretrained_of_full_tensors(cls)
        sharded = type(f"FSDP{cls.__name__}", (MegatronFSDPModule, cls), methods)
        _SHARDED_CLASSES[cls] = sharded
    return sharded
