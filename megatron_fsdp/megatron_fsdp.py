"""MegatronFSDP: the module wrapper that shards a model unit by unit and drives the hooks."""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from megatron_fsdp import _ops
from megatron_fsdp.checkpoint import pretrained, state_dicts
from megatron_fsdp.distributed_data_parallel_config import ddp_config_from_settings
from megatron_fsdp.engine.buckets.buffer import Bucket
from megatron_fsdp.engine.buckets.float8_weights import float8_gathers_blocked_by, prepare_float8_linears
from megatron_fsdp.engine.buckets.offload import OffloadTransfers
from megatron_fsdp.engine.buckets.user_buffers import NCCLUserBuffers
from megatron_fsdp.engine.groups.distributed_index import FSDPDistributedIndex
from megatron_fsdp.engine.params.sharded_params import MeshCache, ShardedParam
from megatron_fsdp.engine.params.upstream_param_attributes import mark_distributed_params
from megatron_fsdp.engine.planning.argument_types import check_argument_types
from megatron_fsdp.engine.planning.meta_init import materialize_unit_by_unit
from megatron_fsdp.engine.planning.plan import ShardingPlan, check_upstream_options, plan_from_upstream_arguments
from megatron_fsdp.engine.planning.shared_chunk_params import refuse_params_sharded_elsewhere
from megatron_fsdp.engine.planning.transformer_engine_refusal import refuse_transformer_engine
from megatron_fsdp.engine.step.schedule import FAILED_BACKWARD_ADVICE, StepScheduler, StepState
from megatron_fsdp.engine.step.step_hooks import StepHooks
from megatron_fsdp.engine.step.units import ROOT_UNIT_NAME, FSDPUnit, assign_params_to_units, find_unit_modules
from megatron_fsdp.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.optim.unsharded_step_guard import guard_optimizer_steps
from megatron_fsdp.param_and_grad_buffer import ParamAndGradBuffer

logger = logging.getLogger(__name__)


class _ShowsModuleSignature:
    """A method that, on an instance, shows the wrapped module's forward signature to
    ``inspect.signature`` (through ``__wrapped__``): Transformers' Trainer keeps the batch columns
    it names. On the class it is the plain function."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __get__(self, wrapper: MegatronFSDP | None, owner: type | None = None) -> Callable[..., Any]:
        if wrapper is None:
            return self.function
        return functools.update_wrapper(functools.partial(self.function, wrapper), wrapper.module.forward)


DDP_WRAP_REFUSAL = (
    "a megatron_fsdp-sharded model reduces its own gradients over the data-parallel group: do not wrap it in "
    "DistributedDataParallel; train the model fully_shard returned as it is (accelerator.prepare leaves it so)"
)


class MegatronFSDP(nn.Module):
    """Wraps ``module`` so every FSDP unit's parameters live in flat, sharded buffers.

    Built by :func:`megatron_fsdp.fully_shard_model`, or with upstream megatron-fsdp's
    constructor ``MegatronFSDP(module, dist_index, ddp_config=None, mixed_precision_policy=None,
    fsdp_unit_modules=None, disable_bucketing=False, device=None, calculate_per_token_loss=False,
    init_model_with_meta_device=False, sync_model_each_microbatch=False, ...)``:

    - ``dist_index``: an :class:`FSDPDistributedIndex` (None: the default process group).
    - ``ddp_config``: a ``DistributedDataParallelConfig`` (megatron_fsdp's or megatron-core's):
      strategies, overlap, NaN check, ``nccl_ub``/``fsdp_double_buffer``; None: upstream's
      default, ``optim_grads_params`` with overlap, ``nccl_ub``/``fsdp_double_buffer`` from the
      keywords.
    - ``mixed_precision_policy``: None takes the config's ``megatron_fsdp_*_dtype`` fields.
    - ``sync_model_each_microbatch`` (default False here, True in ``fully_shard_model``): see
      :meth:`set_model_auto_sync`.
    - ``calculate_per_token_loss``, ``report_nan_in_param_grad``, ``device``,
      ``init_model_with_meta_device``, ``fsdp_unit_modules``: as in ``fully_shard_model``.
    - ``disable_bucketing``, ``keep_fp8_transpose_cache``, ``fsdp_db_use_persist_buf_on_alloc_fail``,
      ``disable_symmetric_registration``, ``enable_fine_grained_param_gather_hook``,
      ``enable_fine_grained_param_gather_backward_hook``, ``fine_grained_recurse_module_types``:
      performance tuning of upstream's; accepted, no effect.

    ``self.module`` is the original model, whose parameters stay the same ``nn.Parameter``
    objects (their ``.data`` are views into the buffers while gathered, empty while sharded
    under ``optim_grads_params``).
    """

    # Accelerate wraps each model it prepares in DistributedDataParallel unless the model says it
    # is prepared already. A sharded model reduces its own gradients; DDP's reduction over the
    # sharded pieces would be wrong (docs/hugging_face.md).
    _is_accelerate_prepared = True
    # An optimizer stepping this model's parameters must be sharded with it, or its first step
    # raises (optim/unsharded_step_guard.py); megatron-core's face installs the weights itself.
    refuses_unsharded_optimizers = True
    # Whether the client that writes this model's checkpoints keys each plain expert parameter
    # by its global expert index (megatron-core does); otherwise ranks holding other experts
    # would write under the same keys, so such parameters are refused (checkpoint/state_dicts.py).
    expert_keys_made_global = False

    def __init__(
        self,
        module: nn.Module,
        dist_index: FSDPDistributedIndex | None = None,
        ddp_config: Any = None,
        mixed_precision_policy: MixedPrecisionPolicy | None = None,
        fsdp_unit_modules: Sequence[type | str] | None = None,
        disable_bucketing: bool = False,
        device: torch.device | str | None = None,
        calculate_per_token_loss: bool = False,
        init_model_with_meta_device: bool = False,
        sync_model_each_microbatch: bool = False,
        keep_fp8_transpose_cache: bool = False,
        nccl_ub: bool = False,
        fsdp_double_buffer: bool = False,
        fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
        disable_symmetric_registration: bool = False,
        enable_fine_grained_param_gather_hook: bool = False,
        enable_fine_grained_param_gather_backward_hook: bool = False,
        fine_grained_recurse_module_types: tuple[type, ...] | None = None,
        report_nan_in_param_grad: bool = False,
    ) -> None:
        super().__init__()
        check_argument_types(locals())
        if dist_index is not None and not isinstance(dist_index, FSDPDistributedIndex):
            raise TypeError(f"dist_index must be a megatron_fsdp.FSDPDistributedIndex or None, got {dist_index!r}")
        if isinstance(module, MegatronFSDP):
            raise ValueError("this model is already sharded by megatron_fsdp")
        refuse_transformer_engine(module)
        refuse_params_sharded_elsewhere(module)
        # Tuning of upstream's own pipelines: nothing to change here (logged when set).
        check_upstream_options(
            disable_bucketing=disable_bucketing, keep_fp8_transpose_cache=keep_fp8_transpose_cache,
            fsdp_db_use_persist_buf_on_alloc_fail=fsdp_db_use_persist_buf_on_alloc_fail,
            disable_symmetric_registration=disable_symmetric_registration,
            enable_fine_grained_param_gather=enable_fine_grained_param_gather_hook
            or enable_fine_grained_param_gather_backward_hook or bool(fine_grained_recurse_module_types),
        )
        plan = plan_from_upstream_arguments(
            module, dist_index, ddp_config, mixed_precision_policy, fsdp_unit_modules, device,
            init_model_with_meta_device, sync_model_each_microbatch, calculate_per_token_loss,
            report_nan_in_param_grad, nccl_ub, fsdp_double_buffer,
        )
        self._build(module, plan, ddp_config)

    @classmethod
    def from_plan(cls, module: nn.Module, plan: ShardingPlan) -> MegatronFSDP:
        """The wrapper ``fully_shard_model`` builds, from arguments it has checked."""
        wrapper = cls.__new__(cls)
        nn.Module.__init__(wrapper)
        wrapper._build(module, plan, None)
        return wrapper

    def _build(self, module: nn.Module, plan: ShardingPlan, ddp_config: Any) -> None:
        settings, dp = plan.settings, plan.dist_index.data_parallel
        self.module = module
        self.dp = dp
        self.dist_index = plan.dist_index
        self.settings = settings
        self._ddp_config = ddp_config
        # torchao Float8Linear weights made plain parameters (float8-gathered, or wrapped by torchao), old -> new.
        blocked_by = float8_gathers_blocked_by(settings.cpu_offload, dp.outer is not None and dp.outer_shards_optimizer)
        self.replaced_params = prepare_float8_linears(module.named_modules(), blocked_by)
        self.pool = _ops.new_bucket_pool(settings.fsdp_double_buffer)
        unit_modules = find_unit_modules(module, plan.unit_classes, units_required=settings.strategy.shards_weights)
        assignment = assign_params_to_units(module, [m for _, m in unit_modules])
        self.offload_transfers = (
            OffloadTransfers(plan.buffers_device, settings.offload_pin_memory) if settings.cpu_offload else None
        )
        module_names = {m: name for name, m in unit_modules}

        def build_unit(owner: nn.Module | None) -> FSDPUnit:
            name = ROOT_UNIT_NAME if owner is None else module_names[owner]
            # Looked up now: meta-device init replaces parameter objects as it materialises them.
            named = dict(module.named_parameters())
            return FSDPUnit(name, [(n, named[n]) for n in assignment[owner]], dp, settings, self.pool, self.offload_transfers)

        # Peak bytes of initialised, not yet sharded parameters during meta-device init.
        self.meta_init_peak_bytes: int | None = None
        if plan.meta_init_device is not None:
            built, self.meta_init_peak_bytes = materialize_unit_by_unit(module, assignment, build_unit, plan.meta_init_device)
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
        for param in [*module.parameters(), *self.replaced_params]:
            # Lets fully_shard_optimizer(optimizer) find this wrapper from an optimizer built over
            # the model's parameters (the faces carry upstream's _megatron_fsdp_model).
            param._megatron_fsdp_owner = weakref.ref(self)
        mark_distributed_params(self, module, self._faces, self.dist_index)
        if self.refuses_unsharded_optimizers:
            guard_optimizer_steps(self)
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
        """The engine's hooks (engine/step/step_hooks.py) on each unit's module and trainable parameter;
        the root unit's run from :meth:`forward`."""
        self._step_hooks = StepHooks(self.scheduler, self.zero_grad_buffer)
        units_by_name = {unit.name: unit for unit in self.units}
        for name, module in unit_modules:
            self._step_hooks.register_forward_hooks(module, units_by_name[name])
        self._step_hooks.register_grad_hooks()

    @_ShowsModuleSignature
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module between the root unit's hooks."""
        self._step_hooks.pre_forward(self.root_unit, self.module, args)
        output = self.module(*args, **kwargs)
        self._step_hooks.after_root_forward(output, self.root_unit)
        return output

    # -- training-loop controls ---------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without reducing them across ranks
        (strategies 0 and 1); 2 and 3 still reduce-scatter every micro-batch to free memory.
        The first backward outside reduces everything accumulated."""
        with self.scheduler.no_sync():
            yield

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Reduces what was held back, waits for every gradient reduction and shows the
        gradients as ``.grad``; the optimizer step calls it for you. ``force_all_reduce``
        (DDP's keyword, kept by upstream) changes nothing: everything is reduced anyway."""
        self.scheduler.finish_grad_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: every parameter's ``.grad`` becomes None (or zeros), and the main
        gradients behind them are released (or zeroed)."""
        self.zero_grad_buffer(set_to_none)

    def zero_grad_buffer(self, set_to_none: bool = True, params: Collection[nn.Parameter] | None = None) -> None:
        """Releases the main gradients, or with ``set_to_none=False`` zeroes them in place
        (``optimizer.zero_grad(set_to_none)`` calls it). Released gradients are re-created by
        the next reduction, so forward runs without them. After a backward that raised, it also
        drops that step's gradients not yet reduced and reshards every unit: the next forward
        starts a new step. ``params`` (faces): zero only theirs, in place, keeping the others'
        (an optimizer over part of the model, optim/grad_release.py), unless a backward raised."""
        if self.scheduler.backward_failed():
            self._abandon_failed_step()
            params = None
        for bucket in self.trainable_buckets():
            if params is None:
                bucket.grads.zero(set_to_none)
            else:
                bucket.grads.zero_of(params)

    def _abandon_failed_step(self) -> None:
        """A hook for faces that register other tensors during a step (megatron-core's)."""
        self.scheduler.abandon_failed_step()

    # -- upstream megatron-fsdp's controls ------------------------------------------------------

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        """Whether each backward synchronises the model: finishes its gradient reductions
        (averaging over dp_outer under HSDP) and shows the gradients as the parameters'
        ``.grad``. Off (upstream's default for a directly built ``MegatronFSDP``), strategies
        2/3 still reduce-scatter each micro-batch into the main gradients but ``.grad`` stays
        as it was (``None`` after ``zero_grad``), strategies 0/1 accumulate locally, and the
        micro-batch that runs with it on (or ``finish_grad_sync()``, or the optimizer step)
        synchronises everything accumulated. Set it before that micro-batch's forward."""
        if not isinstance(sync_model, bool):
            raise TypeError(f"sync_model must be True or False, got {sync_model!r}")
        self.scheduler.auto_sync = sync_model

    @property
    def model_auto_sync(self) -> bool:
        """See :meth:`set_model_auto_sync`."""
        return self.scheduler.auto_sync

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        """Auto-sync on inside (see :meth:`set_model_auto_sync`), off after, as upstream's:
        wrap the last micro-batch of a step."""
        self.set_model_auto_sync(True)
        try:
            yield
        finally:
            self.set_model_auto_sync(False)

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Between steps: under ``optim_grads_params`` with ``overlap_param_gather``, starts
        gathering the first unit of the next forward. The weights are always current (the
        optimizer step installs them), so ``force_sync=True`` only waits for gathers in flight.
        ``force_dispatch`` is accepted for upstream's signature. megatron-core's
        ``fsdp_all_gather_in_start_param_sync=False`` (in ``ddp_config``) turns the prefetch off."""
        if force_sync:
            self.scheduler.synchronize_param_gather()
        elif getattr(self._ddp_config, "fsdp_all_gather_in_start_param_sync", True):
            self.scheduler.start_param_prefetch()

    def start_grad_sync(self, *unused: Any) -> None:
        """Launches the reductions of gradients held back (strategies 0/1 under ``no_sync`` or
        without auto-sync); :meth:`finish_grad_sync` waits for them."""
        self.scheduler.start_grad_sync()

    def synchronize_param_gather(self) -> None:
        """Waits for every weight all-gather in flight and reshards every unit."""
        self.scheduler.synchronize_param_gather()

    def synchronize_gradient_reduce(self) -> None:
        """Reduces what was held back and waits for every reduction (and the dp_outer average):
        the main gradients are complete; :meth:`attach_grad_to_optimizer_state` shows them."""
        self.scheduler.synchronize_gradient_reduce()

    def attach_grad_to_optimizer_state(self) -> None:
        """Points every parameter's ``.grad`` (and the optimizer's pieces) at the reduced
        gradients (:meth:`synchronize_gradient_reduce` first)."""
        self.scheduler.show_grads()

    @torch.no_grad()
    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiplies every gradient held (reduced, shown as ``.grad``, or held back un-reduced)
        by ``scaling_factor``; reductions in flight are finished first, so they are scaled too."""
        self.scheduler.finish_pending_reductions()
        for bucket in self.trainable_buckets():
            bucket.grads.scale(float(scaling_factor))

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Makes every replica of the weights equal to the first data-parallel rank's: each
        bucket's main weights (frozen ones: weights) are broadcast over the ranks that hold
        the same piece (every rank for ``no_shard``, dp_outer under HSDP), then installed."""
        for bucket in self.all_buckets():
            bucket.broadcast_from_first_replica()

    def install_optimized_model_weights(self) -> None:
        """Writes the stepped main weights into the compute weights (gathering them for
        strategies 1/2). The optimizer step does it; for ``optimizer.step()`` run by other code."""
        for bucket in self.trainable_buckets():
            bucket.weights.install()

    def all_gather_and_wait_parameters_ready(
        self,
        params: Iterable[torch.Tensor],
        prefetch: bool = True,
        prefetch_order: Any = None,
        wait_bucket_ready: bool = True,
        bwd: bool = False,
    ) -> None:
        """Gathers the units holding ``params`` (parameters of ``module`` or their faces from
        :meth:`parameters`); with ``wait_bucket_ready=False`` only starts the gathers. They stay
        gathered until that unit's next forward ends, backward ends, or
        :meth:`synchronize_param_gather`. ``prefetch``, ``prefetch_order`` and ``bwd`` are
        accepted for upstream's signature (prefetching follows the recorded order anyway)."""
        unit_of = {}
        for unit in self.units:
            for bucket in unit.buckets:
                for param, face in zip(bucket.params, bucket.faces):
                    unit_of[param] = unit_of[face.param] = unit
        wanted = []
        for param in params:
            if param not in unit_of:
                raise ValueError(f"a tensor of shape {tuple(param.shape)} is not a parameter of this sharded model")
            if unit_of[param] not in wanted:
                wanted.append(unit_of[param])
        for unit in wanted:
            if wait_bucket_ready:
                unit.unshard()
            else:
                unit.start_unshard()

    @contextlib.contextmanager
    def mixed_precision_context(self, mixed_precision_policy: MixedPrecisionPolicy) -> Iterator[None]:
        """:meth:`reset_mixed_precision_policy` inside, the previous policy after."""
        previous = self.mixed_precision_policy
        self.reset_mixed_precision_policy(mixed_precision_policy)
        try:
            yield
        finally:
            self.mixed_precision_policy = previous

    def reset_mixed_precision_policy(self, mixed_precision_policy: MixedPrecisionPolicy) -> None:
        """Takes the new policy's ``grad_comm_dtype``; the main-parameter and main-gradient
        dtypes size the buffers and stay, as upstream's. (Upstream 0.6.1 applies the new
        ``grad_comm_dtype`` only with ``nccl_ub``/``fsdp_double_buffer``, the opposite of what
        its comment says; here it always applies.)"""
        if not isinstance(mixed_precision_policy, MixedPrecisionPolicy):
            raise TypeError(f"expected a megatron_fsdp.MixedPrecisionPolicy, got {mixed_precision_policy!r}")
        current = self.mixed_precision_policy
        self.mixed_precision_policy = MixedPrecisionPolicy(
            current.main_params_dtype, current.main_grads_dtype, mixed_precision_policy.grad_comm_dtype
        )

    def _replace_param_with_distributed_if_needed(self) -> None:
        """Upstream's docstrings (and NeMo Automodel) call this before building an optimizer over
        ``parameters()``. Upstream registers its distributed parameters in ``self.module``, which
        its constructor already did, so there the call only matters after a forward; here
        ``parameters()`` always are the distributed parameters and ``self.module`` keeps the
        compute weights. What it does here: put back upstream's attributes on the distributed
        parameters where they went missing (engine/params/upstream_param_attributes.py)."""
        mark_distributed_params(self, self.module, self._faces, self.dist_index)

    def get_distributed_index(self) -> FSDPDistributedIndex:
        """The meshes and groups this model is sharded over."""
        return self.dist_index

    @property
    def ddp_config(self) -> Any:
        """The ``DistributedDataParallelConfig`` given to the constructor, or (for a model built
        by ``fully_shard_model``) megatron_fsdp's describing its settings."""
        if self._ddp_config is None:
            self._ddp_config = ddp_config_from_settings(self.settings, self.dist_index)
        return self._ddp_config

    @property
    def param_and_grad_buffer(self) -> ParamAndGradBuffer:
        """Upstream's ``ParamAndGradBuffer``: a view of this model's buckets as upstream's
        parameter groups (megatron_fsdp/param_and_grad_buffer.py), made on first use."""
        face = self.__dict__.get("_param_and_grad_buffer_face")
        if face is None:
            face = self.__dict__["_param_and_grad_buffer_face"] = ParamAndGradBuffer(self)
        return face

    # -- the parameters users see -------------------------------------------------------------

    def _fqn_modifiers(self) -> dict[str, str]:
        """For torch.distributed.checkpoint.state_dict's helpers: the wrapped model sits under
        ``module``, and the FQNs leave that out."""
        return {"module": "module"}

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """DistributedDataParallel reads this before any collective: there a sharded model
        refuses to be wrapped, on every rank, naming the fix."""
        raise TypeError(DDP_WRAP_REFUSAL)

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
        the wrapped submodules, so ``recurse=False`` gives them too, under every name of a tied
        weight: torch's state-dict helpers read each module's own parameters that way, and must
        find the face behind each name the wrapped submodules' walk gave them."""
        for name, param in self.module.named_parameters(remove_duplicate=remove_duplicate and recurse):
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

    def prepare_optimizer_step(self, sync_grads: bool = True) -> None:
        """Finishes the gradient sync (unless the caller did), which shows every gradient."""
        if self.scheduler.backward_failed():
            raise RuntimeError(f"optimizer.step() was called after a backward that raised: {FAILED_BACKWARD_ADVICE}")
        if self.scheduler.state is not StepState.IDLE:
            raise RuntimeError("optimizer.step() was called during forward or backward")
        if sync_grads:
            self.finish_grad_sync()
        if self.settings.check_for_nan_in_grad:
            self.scheduler.check_reduced_grads_finite(self.optimizer_steps)

    def install_optimizer_step(self, install_weights: bool = True) -> None:
        if install_weights:
            self.install_optimized_model_weights()
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
        return state_dicts.model_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Loads :meth:`state_dict`'s form (filled in place by ``dcp.load``) or full tensors
        (e.g. a plain model's state dict); raises naming missing, unexpected and mis-shaped keys.
        Returns torch's ``(missing_keys, unexpected_keys)``, empty when ``strict``."""
        if assign:
            raise ValueError("assign=True cannot apply: parameters live in megatron_fsdp's buffers")
        if self.scheduler.state is not StepState.IDLE:
            raise RuntimeError("load a state dict between steps, not during forward or backward")
        state_dicts.load_model_state_dict(self, state_dict, strict=strict)
        return nn.modules.module._IncompatibleKeys(*state_dicts.incompatible_keys(self, state_dict))

    def save_pretrained(self, save_directory: str, *args: Any, **kwargs: Any) -> str:
        """Hugging Face's ``save_pretrained`` of the wrapped model, every rank writing its own
        pieces (nothing gathered): the directory ``from_pretrained`` loads. A collective, call it
        on every rank; arguments and defaults: :func:`megatron_fsdp.save_pretrained`."""
        return pretrained.save_pretrained(self, save_directory, *args, **kwargs)

    # -- inspection ---------------------------------------------------------------------------

    def offloaded_host_bytes(self) -> int:
        """With ``cpu_offload``: host bytes of the main parameters, the gradients the optimizer
        reads and the staging buffers (the optimizer state, also on the host, is the
        optimizer's); 0 without."""
        if self.offload_transfers is None:
            return 0
        held = sum(bucket.host.host_bytes for bucket in self.trainable_buckets())
        return held + self.offload_transfers.staging_bytes

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value by name (a collective: call on every rank): gathered over
        the data-parallel ranks, so under tensor or expert parallelism each rank's own part
        (``state_dict()`` holds the global tensors). Trainable parameters come from the fp32 main
        parameters, frozen ones from the compute weights."""
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
            source = bucket.grads.optimizer_source()
            if bucket.host is not None and bucket.grads.optimizer_grads is not None:
                # Offloaded: what the host step reads, where a clip scaled them.
                source = bucket.grads.optimizer_grads.to(bucket.dtypes.main_grads)
            if source is None:  # nothing reduced since zero_grad
                source = torch.zeros(bucket.main_end - bucket.main_start, dtype=bucket.dtypes.main_grads, device=bucket.device)
            full.update(zip(bucket.names, bucket.split_full(bucket.gather_full(source))))
        return full
