"""Upstream megatron-fsdp 0.6.1's API surface, on one gloo rank: every name of its ``__all__``,
every keyword of ``fully_shard``, ``fully_shard_model``, ``fully_shard_optimizer`` and
``MegatronFSDP``, every public method, ``FSDPDistributedIndex`` and the
``DistributedDataParallelConfig`` fields, present, accepted and doing what upstream's do.
The lists are upstream's, written out (the tests must not need upstream installed)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import megatron_fsdp
from models import Block, make_batch, make_model

UPSTREAM_ALL = [
    "DistributedDataParallelConfig", "MegatronFSDP", "FSDPDistributedIndex", "MixedPrecisionPolicy", "fully_shard",
    "fully_shard_model", "fully_shard_optimizer", "__contact_emails__", "__contact_names__", "__description__",
    "__download_url__", "__homepage__", "__keywords__", "__license__", "__package_name__", "__repository_url__",
    "__shortversion__", "__version__",
]
# fully_shard_model's parameters in upstream's order (fully_shard adds optimizer after module).
UPSTREAM_FULLY_SHARD_MODEL = [
    "module", "device_mesh", "dp_shard_dim", "dp_outer_dim", "tp_dim", "hybrid_fsdp_group", "hybrid_fsdp_expt_group",
    "expt_device_mesh", "fsdp_group_ag", "expt_fsdp_group_ag", "fsdp_unit_modules", "zero_dp_strategy",
    "outer_dp_sharding_strategy", "device", "init_model_with_meta_device", "mixed_precision_policy",
    "overlap_grad_reduce", "overlap_param_gather", "sync_model_each_microbatch", "preproc_state_dict_for_dcp_ckpt",
    "report_nan_in_param_grad", "average_in_collective", "disable_bucketing", "calculate_per_token_loss",
    "keep_fp8_transpose_cache", "nccl_ub", "fsdp_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail",
    "disable_symmetric_registration", "enable_fine_grained_param_gather", "use_decoupled_grad", "cuda_graph_mode",
    "maxpool_double_buffer",
]
UPSTREAM_MEGATRON_FSDP_INIT = [
    "module", "dist_index", "ddp_config", "mixed_precision_policy", "fsdp_unit_modules", "disable_bucketing", "device",
    "calculate_per_token_loss", "init_model_with_meta_device", "sync_model_each_microbatch", "keep_fp8_transpose_cache",
    "nccl_ub", "fsdp_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail", "disable_symmetric_registration",
    "enable_fine_grained_param_gather_hook", "enable_fine_grained_param_gather_backward_hook",
    "fine_grained_recurse_module_types", "report_nan_in_param_grad",
]
UPSTREAM_METHODS = [
    "no_sync", "sync", "set_model_auto_sync", "get_distributed_index", "mixed_precision_context",
    "reset_mixed_precision_policy", "start_param_sync", "start_grad_sync", "synchronize_param_gather",
    "synchronize_gradient_reduce", "attach_grad_to_optimizer_state", "finish_grad_sync", "scale_gradients",
    "zero_grad_buffer", "install_optimized_model_weights", "broadcast_params", "all_gather_and_wait_parameters_ready",
    "forward", "param_and_grad_buffer",
]
UPSTREAM_INDEX_INIT = [
    "device_mesh", "dp_shard_dim", "dp_outer_dim", "tp_dim", "hybrid_fsdp_group", "hybrid_fsdp_expt_group",
    "hsdp_outer_dp_shard", "expt_device_mesh", "fsdp_group_ag", "expt_fsdp_group_ag",
]
UPSTREAM_INDEX_METHODS = [
    "get_submesh", "get_dp_group", "get_fsdp_group", "get_outer_fsdp_group", "get_root_mesh",
    "get_logical_hybrid_fsdp_rank",
]
UPSTREAM_INDEX_ATTRIBUTES = [
    "device_mesh", "dp_shard_dim", "dp_outer_dim", "tp_dim", "use_hybrid_fsdp", "hsdp_outer_dp_shard",
    "expt_device_mesh", "fsdp_group", "fsdp_group_ag", "expt_fsdp_group_ag", "outer_fsdp_group", "hybrid_fsdp_group",
    "hybrid_fsdp_expt_group", "expt_fsdp_group", "expt_outer_fsdp_group",
]
# Upstream's DistributedDataParallelConfig fields and defaults.
UPSTREAM_DDP_CONFIG = dict(
    overlap_grad_reduce=False, overlap_param_gather=False, check_for_nan_in_grad=False, bucket_size=None,
    average_in_collective=False, fp8_param_gather=False, data_parallel_sharding_strategy="no_shard",
    gradient_reduce_div_fusion=True, suggested_communication_unit_size=None, keep_fp8_transpose_cache=False,
    nccl_ub=False, fsdp_double_buffer=False, fsdp_all_gather_in_start_param_sync=True,
    fsdp_db_use_persist_buf_on_alloc_fail=False, outer_dp_sharding_strategy="no_shard",
    disable_symmetric_registration=False, fsdp_manual_registration=False,
    megatron_fsdp_main_params_dtype=torch.float32, megatron_fsdp_main_grads_dtype=None,
    megatron_fsdp_grad_comm_dtype=None, megatron_fsdp_use_decoupled_grad=False, megatron_fsdp_cuda_graph_mode=False,
    megatron_fsdp_enable_fine_grained_param_gather=False, megatron_fsdp_max_pool_double_buffer=False,
)
# Keywords that tune upstream's performance only: accepted with True, nothing changes.
PERFORMANCE_ONLY = dict(
    average_in_collective=True, disable_bucketing=True, keep_fp8_transpose_cache=True,
    fsdp_db_use_persist_buf_on_alloc_fail=True, disable_symmetric_registration=True,
    enable_fine_grained_param_gather=True, cuda_graph_mode=True, maxpool_double_buffer=True,
)


def _parameter_names(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_every_upstream_name_keyword_method_and_field_exists() -> None:
    missing = [name for name in UPSTREAM_ALL if not hasattr(megatron_fsdp, name) or name not in megatron_fsdp.__all__]
    assert not missing, f"upstream names missing from megatron_fsdp: {missing}"
    ours = _parameter_names(megatron_fsdp.fully_shard_model)
    assert ours[: len(UPSTREAM_FULLY_SHARD_MODEL)] == UPSTREAM_FULLY_SHARD_MODEL, "fully_shard_model's order differs"
    expected = ["module", "optimizer", *UPSTREAM_FULLY_SHARD_MODEL[1:]]
    assert _parameter_names(megatron_fsdp.fully_shard)[: len(expected)] == expected, "fully_shard's order differs"
    assert _parameter_names(megatron_fsdp.fully_shard_optimizer)[:2] == ["optimizer", "preproc_state_dict_for_dcp_ckpt"]
    init = _parameter_names(megatron_fsdp.MegatronFSDP.__init__)[1:]
    assert init[: len(UPSTREAM_MEGATRON_FSDP_INIT)] == UPSTREAM_MEGATRON_FSDP_INIT, "MegatronFSDP's order differs"
    assert not [m for m in UPSTREAM_METHODS if not hasattr(megatron_fsdp.MegatronFSDP, m)]
    index_init = _parameter_names(megatron_fsdp.FSDPDistributedIndex.__init__)[1:]
    assert index_init == UPSTREAM_INDEX_INIT
    assert not [m for m in UPSTREAM_INDEX_METHODS if not hasattr(megatron_fsdp.FSDPDistributedIndex, m)]
    config = megatron_fsdp.DistributedDataParallelConfig()
    wrong = {k: getattr(config, k, "<missing>") for k, v in UPSTREAM_DDP_CONFIG.items() if getattr(config, k, "<missing>") != v}
    assert not wrong, f"DistributedDataParallelConfig fields missing or with other defaults: {wrong}"
    assert megatron_fsdp.MixedPrecisionPolicy() == megatron_fsdp.MixedPrecisionPolicy(torch.float32, None, None)


def _train(model, optimizer, steps: int = 2) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(*make_batch(step, 4))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_every_upstream_keyword_is_accepted_and_performance_only_ones_change_nothing(single_rank_group) -> None:
    """fully_shard with upstream's whole signature set (the performance-only keywords True, the
    process groups given) trains exactly like the defaults; the keywords of megatron_fsdp 0.1
    (collective_timeout, the deprecated dtype flags) still work."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    group = mesh["dp_shard"].get_group()
    plain = make_model()
    plain_model, plain_optimizer = megatron_fsdp.fully_shard(
        plain, torch.optim.Adam(plain.parameters(), lr=1e-2), fsdp_unit_modules=[Block]
    )
    expected = _train(plain_model, plain_optimizer)
    module = make_model()
    model, optimizer = megatron_fsdp.fully_shard(
        module, torch.optim.Adam(module.parameters(), lr=1e-2), device_mesh=mesh, dp_shard_dim="dp_shard",
        tp_dim="tp", fsdp_group_ag=group, fsdp_unit_modules=["models.Block"], zero_dp_strategy=3,
        outer_dp_sharding_strategy=0, device=torch.device("cpu"), mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(),
        overlap_grad_reduce=True, overlap_param_gather=True, sync_model_each_microbatch=True,
        preproc_state_dict_for_dcp_ckpt=True, report_nan_in_param_grad=False, calculate_per_token_loss=False,
        nccl_ub=False, fsdp_double_buffer=False, use_decoupled_grad=False, collective_timeout=60, **PERFORMANCE_ONLY,
    )
    assert model.settings.fsdp_double_buffer, "maxpool_double_buffer turns on double buffering"
    assert model.get_distributed_index().get_fsdp_group(independent_all_gather=True) is group
    assert _train(model, optimizer) == expected
    with pytest.warns(DeprecationWarning):
        legacy = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block], preserve_fp32_weights=True,
                                                 grad_reduce_in_fp32=False)
    # upstream's keyword call, and megatron_fsdp 0.1's positional one
    assert megatron_fsdp.fully_shard_optimizer(optimizer=torch.optim.SGD(legacy.parameters(), lr=0.1),
                                               preproc_state_dict_for_dcp_ckpt=False) is not None
    other = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block])
    assert megatron_fsdp.fully_shard_optimizer(torch.optim.SGD(other.parameters(), lr=0.1), other) is not None


def test_upstream_only_keywords_are_accepted_or_refused_before_any_collective(single_rank_group) -> None:
    with pytest.raises(ValueError, match="set use_decoupled_grad=False"):
        megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block], use_decoupled_grad=True)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_outer", "dp_shard"))
    with pytest.raises(ValueError, match="calculate_per_token_loss=True with dp_outer_dim"):
        megatron_fsdp.fully_shard_model(make_model(), device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                                        fsdp_unit_modules=[Block], calculate_per_token_loss=True)
    with pytest.raises(TypeError, match="cuda_graph_mode must be True or False"):
        megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block], cuda_graph_mode="yes")
    with pytest.raises(TypeError, match="fsdp_group_ag must be a torch.distributed.ProcessGroup"):
        megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block], fsdp_group_ag="dp")


def test_megatron_fsdp_built_with_upstreams_constructor_trains_like_fully_shard(single_rank_group) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    index = megatron_fsdp.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp")
    config = megatron_fsdp.DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                                        overlap_grad_reduce=True, overlap_param_gather=True)
    model = megatron_fsdp.MegatronFSDP(make_model(), index, config, fsdp_unit_modules=[Block], sync_model_each_microbatch=True)
    assert model.get_distributed_index() is index and model.ddp_config is config
    optimizer = megatron_fsdp.fully_shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    plain = make_model()
    reference, reference_optimizer = megatron_fsdp.fully_shard(plain, torch.optim.Adam(plain.parameters(), lr=1e-2),
                                                               fsdp_unit_modules=[Block])
    assert _train(model, optimizer) == _train(reference, reference_optimizer)
    assert reference.ddp_config.data_parallel_sharding_strategy == "optim_grads_params"
    defaults = megatron_fsdp.MegatronFSDP(make_model(), fsdp_unit_modules=[Block])
    assert defaults.settings.strategy.label == "optim_grads_params" and not defaults.model_auto_sync


def test_megatron_fsdp_constructor_refuses_an_index_that_contradicts_the_config(single_rank_group) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_outer", "dp_shard"))
    index = megatron_fsdp.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    config = megatron_fsdp.DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", outer_dp_sharding_strategy="optim",
        num_distributed_optimizer_instances=2,
    )
    with pytest.raises(ValueError, match="pass hsdp_outer_dp_shard=True to FSDPDistributedIndex"):
        megatron_fsdp.MegatronFSDP(make_model(), index, config, fsdp_unit_modules=[Block])
    with pytest.raises(TypeError, match="dist_index must be a megatron_fsdp.FSDPDistributedIndex"):
        megatron_fsdp.MegatronFSDP(make_model(), mesh, config, fsdp_unit_modules=[Block])


def test_distributed_index_getters_follow_the_mesh(single_rank_group) -> None:
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    hybrid = mesh[("dp_outer", "dp_shard")]._flatten("dp").get_group()
    index = megatron_fsdp.FSDPDistributedIndex(
        device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", tp_dim="tp", hybrid_fsdp_group=hybrid,
        hsdp_outer_dp_shard=True,
    )
    assert not [a for a in UPSTREAM_INDEX_ATTRIBUTES if not hasattr(index, a)]
    assert index.use_hybrid_fsdp and index.get_dp_group() is hybrid
    assert index.get_fsdp_group() is mesh["dp_shard"].get_group()
    assert index.get_outer_fsdp_group() is mesh["dp_outer"].get_group()
    assert index.get_root_mesh() is mesh and index.get_submesh("tp") == mesh["tp"]
    assert index.get_submesh(["dp_shard", "tp"]) == mesh[("dp_shard", "tp")]
    assert index.get_logical_hybrid_fsdp_rank() == 0
    with pytest.raises(ValueError, match="has no sub-mesh"):
        index.get_submesh(["dp_shard", "nope"])
    no_group = megatron_fsdp.FSDPDistributedIndex(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    with pytest.raises(ValueError, match="pass the flattened"):
        no_group.get_dp_group()
    with pytest.raises(ValueError, match="applies to HFSDP only"):
        no_group.get_logical_hybrid_fsdp_rank()
    plain = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block]).get_distributed_index()
    assert plain.get_dp_group() is plain.get_fsdp_group() and not plain.use_hybrid_fsdp


def test_model_controls_do_what_upstreams_do(single_rank_group) -> None:
    """Gradients shown only when synchronised; scale_gradients scales them; the (param/grad)
    sync controls and broadcast_params keep training exact; the mixed-precision context changes
    only the communication dtype and restores it."""
    model = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block], sync_model_each_microbatch=False)
    optimizer = megatron_fsdp.fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert not model.model_auto_sync
    model(*make_batch(0, 2)).backward()
    assert all(p.grad is None for p in model.parameters()), "gradients shown before the sync"
    model.start_grad_sync()
    model.synchronize_gradient_reduce()
    assert all(p.grad is None for p in model.parameters())
    model.attach_grad_to_optimizer_state()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    model.scale_gradients(0.5)
    assert all(torch.equal(p.grad.full_tensor(), grads[n] * 0.5) for n, p in model.named_parameters())
    optimizer.step()
    optimizer.zero_grad()
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    model.broadcast_params()
    model.install_optimized_model_weights()
    assert all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    model.start_param_sync()
    model.synchronize_param_gather()
    model.start_param_sync(force_sync=True)
    model.all_gather_and_wait_parameters_ready(list(model.parameters())[:3])
    model.synchronize_param_gather()
    with model.sync():
        assert model.model_auto_sync
        model(*make_batch(1, 2)).backward()
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    assert not model.model_auto_sync
    policy = model.mixed_precision_policy
    with model.mixed_precision_context(megatron_fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16, torch.bfloat16)):
        assert model.mixed_precision_policy == megatron_fsdp.MixedPrecisionPolicy(policy.main_params_dtype, policy.main_grads_dtype, torch.bfloat16)
    assert model.mixed_precision_policy == policy


def test_param_and_grad_buffer_views_the_buckets(single_rank_group) -> None:
    model = megatron_fsdp.fully_shard_model(make_model(), fsdp_unit_modules=[Block])
    buffer = model.param_and_grad_buffer
    assert buffer is model.param_and_grad_buffer
    assert buffer.num_buckets == len(model.all_buckets())
    params = {id(p) for group in buffer.parameter_groups for p in group.model_weight_buffer.params}
    assert params == {id(p) for p in model.module.parameters()}



def test_upstream_optimizer_step_and_zero_grad_keywords(single_rank_group) -> None:
    """install_optimized_model_weights=False leaves the (bf16) compute weights as they were until
    model.install_optimized_model_weights(); zero_grad(zero_grad_buffer=False) keeps the main
    gradients; a plain zero_grad() releases them."""
    module = make_model(dtype=torch.bfloat16)
    model, optimizer = megatron_fsdp.fully_shard(
        module, torch.optim.SGD(module.parameters(), lr=0.1), fsdp_unit_modules=[Block], zero_dp_strategy="optim"
    )
    model(*make_batch(0, 2)).backward()
    before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    optimizer.step(install_optimized_model_weights=False)
    assert all(torch.equal(p, before[n]) for n, p in model.module.named_parameters()), "weights installed anyway"
    optimizer.zero_grad(zero_grad_buffer=False)
    assert any(g.abs().sum() > 0 for g in model.full_gradients().values()), "the main gradients were released"
    model.install_optimized_model_weights()
    stepped = model.full_parameters()
    assert all(torch.equal(p, stepped[n].to(p.dtype)) for n, p in model.module.named_parameters()), "not installed"
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
