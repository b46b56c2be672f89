"""The Megatron-LM way in: every validation error names the problem and its fix, flags and
configs convert both ways, and a model sharded through the flags trains bit for bit like the
same model sharded with hand-written fully_shard arguments (2 gloo ranks)."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp
from _dist import run_distributed
from megatron_fsdp import DistributedDataParallelConfig, MixedPrecisionPolicy
from megatron_fsdp.integrations.megatron_lm import args_from_ddp_config
from models import Block, make_batch, make_model


def _parse(*flags: str) -> argparse.Namespace:
    return megatron_fsdp.add_megatron_fsdp_args(argparse.ArgumentParser()).parse_args(list(flags))


def _config(*flags: str) -> DistributedDataParallelConfig:
    return megatron_fsdp.ddp_config_from_args(_parse(*flags))


FLAG_ERRORS = {
    "outer optim with inner optim": (
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim", "--outer-dp-sharding-strategy", "optim",
         "--num-distributed-optimizer-instances", "2"],
        ValueError, "outer_dp_sharding_strategy='optim' requires data_parallel_sharding_strategy='optim_grads_params', got 'optim'",
    ),
    "outer optim without an outer group": (
        ["--use-megatron-fsdp", "--outer-dp-sharding-strategy", "optim"],
        ValueError, "needs an outer data-parallel group: pass --num-distributed-optimizer-instances N",
    ),
    "zero optimizer instances": (
        ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "0"], ValueError, "must be an integer >= 1, got 0",
    ),
    "megatron fsdp and torch fsdp2": (
        ["--use-megatron-fsdp", "--use-torch-fsdp2"], ValueError, "--use-megatron-fsdp and --use-torch-fsdp2 are mutually exclusive",
    ),
    "torch fsdp2 alone": (["--use-torch-fsdp2"], ValueError, "pass --use-megatron-fsdp"),
    "another checkpoint format": (
        ["--use-megatron-fsdp", "--ckpt-format", "torch_dist"], ValueError, "--ckpt-format torch_dist cannot save a Megatron-FSDP model: pass --ckpt-format fsdp_dtensor",
    ),
    "cpu offload with pipeline parallelism": (
        ["--use-megatron-fsdp", "--cpu-offloading", "--pipeline-model-parallel-size", "2"],
        ValueError, "--cpu-offloading works only without pipeline parallelism, got --pipeline-model-parallel-size 2",
    ),
    "cpu offload with recompute": (
        ["--use-megatron-fsdp", "--cpu-offloading", "--recompute-granularity", "full"],
        ValueError, "--cpu-offloading works only without activation recomputation, got --recompute-granularity full",
    ),
    "pipeline parallelism": (
        ["--use-megatron-fsdp", "--pipeline-model-parallel-size", "4"],
        ValueError, "--pipeline-model-parallel-size 4: ddp_config_from_args configures fully_shard over every rank",
    ),
}


@pytest.mark.parametrize("name", list(FLAG_ERRORS))
def test_invalid_flag_combinations_raise_naming_the_fix(name: str) -> None:
    flags, error, message = FLAG_ERRORS[name]
    with pytest.raises(error) as raised:
        _config(*flags)
    assert message in str(raised.value), str(raised.value)


CONFIG_ERRORS = {
    "unknown strategy": (dict(data_parallel_sharding_strategy="zero3"), "unknown data_parallel_sharding_strategy 'zero3'"),
    "outer optim_grads": (dict(outer_dp_sharding_strategy="optim_grads", num_distributed_optimizer_instances=2), "is not supported: use 'no_shard'"),
    "fp8 parameters": (dict(fp8_param_gather=True), "set fp8_param_gather=False"),
    "decoupled gradients": (dict(megatron_fsdp_use_decoupled_grad=True), "param.grad: set it to False"),
    "preserve_fp32_weights=False with bf16 main params": (
        dict(preserve_fp32_weights=False, megatron_fsdp_main_params_dtype=torch.bfloat16),
        "preserve_fp32_weights=False contradicts megatron_fsdp_main_params_dtype=torch.bfloat16",
    ),
    "grad_reduce_in_fp32 with bf16 main grads": (
        dict(grad_reduce_in_fp32=True, megatron_fsdp_main_grads_dtype=torch.bfloat16),
        "grad_reduce_in_fp32=True contradicts megatron_fsdp_main_grads_dtype=torch.bfloat16",
    ),
    "an integer dtype": (dict(megatron_fsdp_grad_comm_dtype=torch.int32), "must be None or a float dtype"),
}


@pytest.mark.parametrize("name", list(CONFIG_ERRORS))
def test_invalid_configs_raise_on_construction(name: str) -> None:
    fields, message = CONFIG_ERRORS[name]
    with pytest.raises(ValueError) as raised:
        DistributedDataParallelConfig(**fields)
    assert message in str(raised.value), str(raised.value)


def test_hybrid_config_needs_a_mesh_with_its_outer_size(single_rank_group) -> None:
    config = DistributedDataParallelConfig(num_distributed_optimizer_instances=2)
    with pytest.raises(ValueError, match="needs a device_mesh with dims 'dp_outer' and 'dp_shard'"):
        config.fully_shard_kwargs()
    with pytest.raises(ValueError, match="has 1 ranks but num_distributed_optimizer_instances is 2"):
        config.fully_shard_kwargs(init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_outer", "dp_shard")))
    with pytest.raises(ValueError, match="does not divide the world size 1"):
        config.device_mesh("cpu")


def test_default_flags_give_the_default_config_with_nan_checks() -> None:
    # The flag's default strategy is Megatron-LM's (optim_grads_params), the dataclass's upstream's (no_shard).
    expected = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params", check_for_nan_in_grad=True)
    assert _config("--use-megatron-fsdp") == expected


def test_config_maps_onto_fully_shard_arguments() -> None:
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads", overlap_grad_reduce=True, grad_reduce_in_fp32=True,
        megatron_fsdp_grad_comm_dtype=torch.bfloat16, preserve_fp32_weights=False, nccl_ub=True,
    )
    assert config.fully_shard_kwargs() == dict(
        zero_dp_strategy="optim_grads",
        overlap_grad_reduce=True,
        overlap_param_gather=False,
        mixed_precision_policy=MixedPrecisionPolicy(None, torch.float32, torch.bfloat16),
        check_for_nan_in_grad=False,
        fsdp_double_buffer=False,  # fully_shard turns it on for nccl_ub
        nccl_ub=True,
        init_model_with_meta_device=False,
        cpu_offload=False,
    )


ROUND_TRIP_CONFIGS = [
    DistributedDataParallelConfig(),
    DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", outer_dp_sharding_strategy="optim",
        num_distributed_optimizer_instances=4, overlap_grad_reduce=True, overlap_param_gather=True,
        megatron_fsdp_main_params_dtype=None, megatron_fsdp_main_grads_dtype=torch.float32,
        megatron_fsdp_grad_comm_dtype=torch.bfloat16, check_for_nan_in_grad=True, fsdp_double_buffer=True,
        init_model_with_meta_device=True,
    ),
    DistributedDataParallelConfig(data_parallel_sharding_strategy="no_shard", megatron_fsdp_main_params_dtype=torch.float16, nccl_ub=True),
    DistributedDataParallelConfig(data_parallel_sharding_strategy="optim", cpu_offload=True),
]


@pytest.mark.parametrize("config", ROUND_TRIP_CONFIGS, ids=["defaults", "hfsdp-mixed", "no_shard-ub", "optim-offload"])
def test_flags_round_trip_to_the_same_config(config: DistributedDataParallelConfig) -> None:
    flags = args_from_ddp_config(config)
    assert _config(*flags) == config, flags


def test_deprecated_fields_round_trip_as_dtype_flags() -> None:
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, preserve_fp32_weights=False)
    again = _config(*args_from_ddp_config(config))
    assert again.mixed_precision_policy() == config.mixed_precision_policy() == MixedPrecisionPolicy(None, torch.float32, None)


# Each case: the flags, and the fully_shard arguments a user would write by hand for the same
# job ("mesh": the (dp_outer, dp_shard) sizes of the mesh to build), and the model's dtype.
E2E_CASES = {
    "optim_grads-bf16-comm": (
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--megatron-fsdp-main-grads-dtype", "fp32",
         "--megatron-fsdp-grad-comm-dtype", "bf16", "--overlap-grad-reduce", "--overlap-param-gather"],
        dict(zero_dp_strategy=2, check_for_nan_in_grad=True, overlap_grad_reduce=True, overlap_param_gather=True,
             mixed_precision_policy=MixedPrecisionPolicy(torch.float32, torch.float32, torch.bfloat16)),
        torch.float32,
    ),
    "hfsdp": (
        ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim",
         "--no-check-for-nan-in-loss-and-grad"],
        dict(mesh=(2, 1), zero_dp_strategy=3, outer_dp_sharding_strategy=1, overlap_grad_reduce=False, overlap_param_gather=False),
        torch.float32,
    ),
    "no_shard-bf16-weights-stepped": (
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard", "--megatron-fsdp-main-params-dtype", "auto"],
        dict(zero_dp_strategy="no_shard", check_for_nan_in_grad=True, overlap_grad_reduce=False, overlap_param_gather=False,
             mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=None)),
        torch.bfloat16,
    ),
    "optim_grads_params-cpu-offloading": (
        ["--use-megatron-fsdp", "--cpu-offloading", "--no-check-for-nan-in-loss-and-grad"],
        dict(zero_dp_strategy=3, cpu_offload=True, overlap_grad_reduce=False, overlap_param_gather=False),
        torch.float32,
    ),
}


def _train(model, optimizer, rank: int, world: int) -> dict:
    losses = []
    for step in range(4):
        tokens, targets = make_batch(step, 2 * world)
        loss = model(tokens[rank::world], targets[rank::world])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": model.full_parameters()}


def _both_ways(rank: int, world: int) -> dict:
    results = {}
    for name, (flags, direct, dtype) in E2E_CASES.items():
        config = _config(*flags)
        model = make_model(dtype=dtype)
        through_config = _train(*megatron_fsdp.fully_shard(
            model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block],
            **config.fully_shard_kwargs(config.device_mesh("cpu")),
        ), rank, world)
        direct = dict(direct)
        if "mesh" in direct:
            mesh = init_device_mesh("cpu", direct.pop("mesh"), mesh_dim_names=("dp_outer", "dp_shard"))
            direct.update(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
        model = make_model(dtype=dtype)
        by_hand = _train(*megatron_fsdp.fully_shard(
            model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block], **direct
        ), rank, world)
        results[name] = (through_config, by_hand)
    return results


@pytest.fixture(scope="module")
def both_ways() -> list[dict]:
    return run_distributed(_both_ways, 2)


@pytest.mark.parametrize("name", list(E2E_CASES))
def test_flags_shard_and_train_bit_for_bit_like_direct_fully_shard_arguments(both_ways, name: str) -> None:
    # Same arguments, same deterministic CPU kernels, same data: no rounding may differ.
    for rank, results in enumerate(both_ways):
        through_config, by_hand = results[name]
        assert through_config["losses"] == by_hand["losses"], f"rank {rank}: {through_config['losses']} vs {by_hand['losses']}"
        for param_name, value in by_hand["params"].items():
            assert torch.equal(through_config["params"][param_name], value), f"rank {rank}: {param_name} differs"


def test_clip_grad_flag_defaults_to_megatron_lm_and_yields_to_an_existing_one() -> None:
    assert _parse().clip_grad == 1.0 and _parse("--clip-grad", "0.5").clip_grad == 0.5
    parser = argparse.ArgumentParser()
    parser.add_argument("--clip-grad", type=float, default=2.0)  # Megatron-LM's own parser has it
    assert megatron_fsdp.add_megatron_fsdp_args(parser).parse_args([]).clip_grad == 2.0
