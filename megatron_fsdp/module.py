"""MegatronFSDP: the module wrapper that shards a model unit by unit and drives the hooks."""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from megatron_fsdp import _ops, checkpoint
from megatron_fsdp.buffer import Bucket
from megatron_fsdp.config import FSDPSettings, MixedPrecisionPolicy
from megatron_fsdp.mesh import DataParallelGroup
from megatron_fsdp.meta_init import materialize_unit_by_unit
from megatron_fsdp.schedule import StepScheduler, StepState
from megatron_fsdp.sharded_params import MeshCache, ShardedParam
from megatron_fsdp.units import ROOT_UNIT_NAME, FSDPUnit, assign_params_to_units, find_unit_modules
from megatron_fsdp.user_buffers import NCCLUserBuffers

logger = logging.getLogger(__name__)


def _tensors_requiring_grad(output: Any) -> list[torch.Tensor]:
    """The tensors inside a module output (tensors, tuples, lists, dicts, dataclass-like
    model outputs) that autograd will differentiate."""
    found: list[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dataclass_fields__"):
            stack.extend(getattr(item, field) for field in item.__dataclass_fields__)
    return found


def _deliver_grad(scheduler: weakref.ref, unit_index: int, bucket_index: int, index: int, param: nn.Parameter) -> None:
    live = scheduler()
    if live is not None:
        unit = live.units[unit_index]
        live.on_grad(unit, unit.trainable_buckets[bucket_index], index, param)


class MegatronFSDP(nn.Module):
    """Wraps ``module`` so every FSDP unit's parameters live in flat, sharded buffers.

    Built by :func:`megatron_fsdp.fully_shard_model`; ``self.module`` is the original model,
    whose parameters stay the same ``nn.Parameter`` objects (their ``.data`` are views into the
    buffers while gathered, empty while sharded under ``optim_grads_params``).
    """

    def __init__(
        self,
        module: nn.Module,
        dp: DataParallelGroup,
        settings: FSDPSettings,
        unit_classes: tuple[type, ...],
        meta_init_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.dp = dp
        self.settings = settings
        self.pool = _ops.new_bucket_pool(settings.fsdp_double_buffer)
        unit_modules = find_unit_modules(module, unit_classes)
        assignment = assign_params_to_units(module, [m for _, m in unit_modules])
        module_names = {m: name for name, m in unit_modules}

        def build_unit(owner: nn.Module | None) -> FSDPUnit:
            name = ROOT_UNIT_NAME if owner is None else module_names[owner]
            # Looked up now: meta-device init replaces parameter objects as it materialises them.
            named = dict(module.named_parameters())
            return FSDPUnit(name, [(n, named[n]) for n in assignment[owner]], dp, settings, self.pool)

        # Peak bytes of initialised, not yet sharded parameters during meta-device init.
        self.meta_init_peak_bytes: int | None = None
        if meta_init_device is not None:
            built, self.meta_init_peak_bytes = materialize_unit_by_unit(module, assignment, build_unit, meta_init_device)
        else:
            built = {owner: build_unit(owner) for owner in assignment}
        self.units: list[FSDPUnit] = [built[owner] for owner in assignment]
        self.root_unit = self.units[0]
        meshes = MeshCache()
        for bucket in self.all_buckets():
            bucket.add_faces(meshes)
        # Each model parameter -> the DTensor parameter users see in its place.
        self._faces: dict[nn.Parameter, ShardedParam] = {
            param: face for bucket in self.all_buckets() for param, face in zip(bucket.params, bucket.faces)
        }
        for param in [*module.parameters(), *self.parameters()]:
            # Lets fully_shard_optimizer(optimizer) find this wrapper from the optimizer's params.
            param._megatron_fsdp_owner = weakref.ref(self)
        self.scheduler = StepScheduler(self.units, settings, dp)
        # Where the buffers live (and forward computes).
        self.compute_device = next((b.device for b in self.all_buckets()), torch.device("cpu"))
        self.user_buffers = NCCLUserBuffers.create(self.pool, dp, self.compute_device) if settings.nccl_ub else None
        self._policy = settings.mixed_precision
        self.optimizer_steps = 0
        self._register_hooks(unit_modules)
        total = sum(b.layout.padded_numel for u in self.units for b in u.buckets)
        logger.info(
            "megatron_fsdp: %d units, %d buckets, %d elements (padded) sharded %s over %d ranks",
            len(self.units), sum(len(u.buckets) for u in self.units), total, settings.strategy.label, dp.size,
        )

    # -- hooks --------------------------------------------------------------------------------

    def _register_hooks(self, unit_modules: list[tuple[str, nn.Module]]) -> None:
        units_by_name = {unit.name: unit for unit in self.units}
        for name, module in unit_modules:
            unit = units_by_name[name]
            module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
            module.register_forward_hook(functools.partial(self._post_forward, unit))
        # Gradient hooks live in C++ on the parameters, where Python's garbage collector cannot
        # see them: they hold the scheduler weakly, so a model nobody uses is freed.
        scheduler = weakref.ref(self.scheduler)
        for unit_index, unit in enumerate(self.units):
            for bucket_index, bucket in enumerate(unit.trainable_buckets):
                for index, param in enumerate(bucket.params):
                    param.register_post_accumulate_grad_hook(
                        functools.partial(_deliver_grad, scheduler, unit_index, bucket_index, index)
                    )

    # The hooks gather, reshard and re-point parameters through the C++ pool and collectives:
    # under torch.compile they run eagerly between graphs (a graph break at each unit boundary)
    # instead of being traced.

    @torch.compiler.disable
    def _pre_forward(self, unit: FSDPUnit, module: nn.Module, args: Any) -> None:
        self.scheduler.before_unit_forward(unit)

    @torch.compiler.disable
    def _post_forward(self, unit: FSDPUnit, module: nn.Module, args: Any, output: Any) -> None:
        if self.scheduler.after_unit_forward(unit):
            self._arm_pre_backward(unit, output)

    @torch.compiler.disable
    def _after_root_forward(self, output: Any) -> None:
        if not self._arm_pre_backward(None, output):
            self.scheduler.end_forward_without_backward()

    def _arm_pre_backward(self, unit: FSDPUnit | None, output: Any) -> bool:
        tensors = _tensors_requiring_grad(output) if torch.is_grad_enabled() else []
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self.scheduler.before_unit_backward(unit), mode="any"
            )
        return bool(tensors)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._pre_forward(self.root_unit, self.module, args)
        output = self.module(*args, **kwargs)
        self._after_root_forward(output)
        return output

    # -- training-loop controls ---------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without reducing them across ranks
        (strategies 0 and 1); 2 and 3 still reduce-scatter every micro-batch to free memory.
        The first backward outside reduces everything accumulated."""
        previous = self.scheduler.sync_grads
        self.scheduler.sync_grads = False
        try:
            yield
        finally:
            self.scheduler.sync_grads = previous

    def finish_grad_sync(self) -> None:
        """Waits for every gradient reduction; the optimizer step calls it for you."""
        self.scheduler.finish_grad_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: every parameter's ``.grad`` becomes None (or zeros), and the main
        gradients behind them are released (or zeroed)."""
        self.zero_grad_buffer(set_to_none)

    def zero_grad_buffer(self, set_to_none: bool = True) -> None:
        """Releases the main gradients, or with ``set_to_none=False`` zeroes them in place
        (``optimizer.zero_grad(set_to_none)`` calls it). Released gradients are re-created by
        the next reduction, so forward runs without them."""
        for bucket in self.trainable_buckets():
            bucket.zero_main_grad(set_to_none)

    # -- the parameters users see -------------------------------------------------------------

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint.state_dict's helpers: the wrapped model sits under
        ``module``, and the FQNs leave that out."""
        return {"module": "module"}

    def __getattr__(self, name: str) -> Any:
        """Attributes of the wrapped model (``model.config``, ``model.blocks``) read through the
        wrapper, whose FQNs are the wrapped model's: torch's state-dict helpers walk them so."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped model's parameter FQNs, each with its DTensor face: this rank's piece of
        the main weights, whose ``.grad`` shows the reduced gradient after each gradient sync
        (docs/architecture.md, "The parameter contract"). ``self.module``'s own parameters are
        the compute weights forward and backward use. The faces belong to this wrapper, not to
        the wrapped submodules, so ``recurse=False`` gives them too: torch's state-dict helpers
        read each module's own parameters that way."""
        for name, param in self.module.named_parameters(remove_duplicate=remove_duplicate):
            yield (f"{prefix}.{name}" if prefix else name), self._faces[param].param

    # -- optimizer support --------------------------------------------------------------------

    def trainable_buckets(self) -> list[Bucket]:
        return [bucket for unit in self.units for bucket in unit.trainable_buckets]

    def all_buckets(self) -> list[Bucket]:
        return [bucket for unit in self.units for bucket in unit.buckets]

    def optimizer_params(self) -> dict[nn.Parameter, nn.Parameter]:
        """Each trainable model parameter -> the main-parameter piece the optimizer steps."""
        return {
            param: optim_param
            for bucket in self.trainable_buckets()
            for param, optim_param in zip(bucket.params, bucket.optim_params)
        }

    def face_of(self, param: nn.Parameter) -> nn.Parameter:
        """The DTensor parameter :meth:`parameters` shows for the model parameter ``param``."""
        return self._faces[param].param

    def prepare_optimizer_step(self) -> None:
        """Finishes the gradient sync, which points every optimizer piece at its gradient."""
        if self.scheduler.state is not StepState.IDLE:
            raise RuntimeError("optimizer.step() was called during forward or backward")
        self.finish_grad_sync()
        if self.settings.check_for_nan_in_grad:
            self.scheduler.check_reduced_grads_finite(self.optimizer_steps)

    def install_optimizer_step(self) -> None:
        for bucket in self.trainable_buckets():
            bucket.install_main_params()
        self.optimizer_steps += 1
        if self.user_buffers is not None:
            self.user_buffers.register_new_buckets()

    # -- mixed precision ----------------------------------------------------------------------

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        return self._policy

    @mixed_precision_policy.setter
    def mixed_precision_policy(self, policy: MixedPrecisionPolicy) -> None:
        """Between steps, ``grad_comm_dtype`` may change (e.g. to bf16 once training is stable);
        the main-parameter and main-gradient dtypes size the buffers and stay."""
        if self.scheduler.state is not StepState.IDLE:
            raise RuntimeError("change the mixed-precision policy between steps, not during forward or backward")
        for unit in self.units:
            for bucket in unit.buckets:
                bucket.set_policy(policy)
        self._policy = policy

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Parameter FQN -> DTensor of the parameter's global shape holding this rank's piece
        (fp32 main weights where they exist), plus buffers: ready for
        ``torch.distributed.checkpoint``. With ``preproc_state_dict_for_dcp_ckpt=False``, the
        wrapped module's own ``state_dict()``."""
        if not self.settings.preproc_state_dict_for_dcp_ckpt:
            return self.module.state_dict(*args, **kwargs)
        return checkpoint.model_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Loads :meth:`state_dict`'s form (filled in place by ``dcp.load``) or full tensors
        (e.g. a plain model's state dict); raises naming missing, unexpected and mis-shaped keys."""
        if assign:
            raise ValueError("assign=True cannot apply: parameters live in megatron_fsdp's buffers")
        if self.scheduler.state is not StepState.IDLE:
            raise RuntimeError("load a state dict between steps, not during forward or backward")
        checkpoint.load_model_state_dict(self, state_dict, strict=strict)

    # -- inspection ---------------------------------------------------------------------------

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value by name (a collective: call on every rank). Trainable
        parameters come from the fp32 main parameters, frozen ones from the compute weights."""
        full = {}
        for unit in self.units:
            for bucket in unit.buckets:
                source = bucket.checkpoint_source()[0]
                full.update(zip(bucket.names, bucket.split_full(bucket.gather_full(source))))
        return full

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's reduced gradient by name (a collective), after
        ``finish_grad_sync()``."""
        full = {}
        for bucket in self.trainable_buckets():
            source = bucket.optimizer_grad_source()
            if source is None:  # nothing reduced since zero_grad
                source = torch.zeros(bucket.main_end - bucket.main_start, dtype=bucket.dtypes.main_grads, device=bucket.device)
            full.update(zip(bucket.names, bucket.split_full(bucket.gather_full(source))))
        return full
