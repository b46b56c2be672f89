"""torchtitan's trainer over ``megatron_fsdp.fsdp2``: a torchtitan user selects this module where
they would select torchtitan's llama3 one, and nothing else changes::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module megatron_fsdp.integrations.torchtitan --config llama3_debugmodel

Every config function of torchtitan's ``torchtitan.models.llama3.config_registry``
(``llama3_debugmodel``, ``llama3_debugmodel_float8``, ``llama3_8b``, ...) is reachable here by
its name: it returns torchtitan's own ``Trainer.Config`` with the model spec's parallelize
function replaced by :func:`parallelize_llama` below, which applies torchtitan's activation
checkpointing and per-block compile as torchtitan's does, then shards with megatron_fsdp's
``fully_shard`` where torchtitan's calls torch's: one unit per transformer block, the embedding,
the final norm and the head grouped, then the root. Everything else (meta build, ``init_weights``
after parallelize, chunked loss, float8 Linear, DCP checkpoints, gradient accumulation, HSDP from
``data_parallel_replicate_degree``, tensor parallelism from ``tensor_parallel_degree`` and
context parallelism from ``context_parallel_degree``, applied before sharding as torchtitan
applies them) is torchtitan's. See docs/fsdp2.md, "torchtitan".

Pipeline parallelism (``pipeline_parallel_degree``) shards each stage torchtitan's pipeline split
makes as it shards the whole model, ZeRO-3 weights kept gathered between micro-batches as
torchtitan's default policy keeps them under PP; it is refused, naming the reason, on a torch
whose pipeline schedules lack the ``step(arg_mbs=...)`` torchtitan calls (torch 2.13 does: its
FSDP2 run stops there too). Expert parallelism is refused with a clear error, and so are tensor
and context parallelism under an SPMD backend other than ``partial_dtensor`` (whose FSDP mesh is
torchtitan's flattened "fsdp" dim, data-parallel shards and context-parallel ranks together).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from megatron_fsdp.fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

try:
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.fsdp import (
        disable_fsdp_gradient_division,
        enable_fsdp_symm_mem,
        get_fsdp_reshard_after_forward_policy,
    )
    from torchtitan.distributed.context_parallel import apply_cp_to_forward
    from torchtitan.models.llama3 import parallelize_llama as torchtitan_parallelize_llama
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "megatron_fsdp.integrations.torchtitan needs torchtitan (0.3.0 is tested): pip install torchtitan"
    ) from error

logger = logging.getLogger(__name__)

LLAMA3_CONFIG_REGISTRY = "torchtitan.models.llama3.config_registry"


def _refuse_unsupported(parallel_dims: Any, model: nn.Module, spmd_backend: str) -> None:
    """Raises before any collective, on every rank alike (the checks read only the config)."""
    if spmd_backend != "partial_dtensor" and (parallel_dims.tp_enabled or parallel_dims.cp_enabled):
        raise NotImplementedError(
            f"megatron_fsdp.integrations.torchtitan runs tensor and context parallelism under "
            f"--parallelism.spmd_backend partial_dtensor, not {spmd_backend!r}: pass --parallelism.spmd_backend "
            "partial_dtensor"
        )
    if parallel_dims.pp_enabled and not _schedules_take_torchtitans_step():
        raise NotImplementedError(
            "megatron_fsdp.integrations.torchtitan: torchtitan's pipeline path calls its schedule's "
            f"step(arg_mbs=..., kwarg_mbs=...), which torch {torch.__version__}'s pipeline schedules do not take "
            "(torch's own FSDP2 run stops there: ValueError 'Expecting N arg_mbs but got 1'). Pipeline parallelism "
            "through torchtitan needs a torch whose PipelineSchedule.step takes arg_mbs; until then use "
            "--parallelism.pipeline_parallel_degree 1, or drive torch.distributed.pipelining over stages sharded by "
            "megatron_fsdp.fsdp2.fully_shard yourself (docs/fsdp2.md, 'Pipeline parallelism')"
        )
    unsupported = ["expert parallelism"] if parallel_dims.ep_enabled else []
    if any(getattr(block, "moe_enabled", False) for block in model.layers.values()):
        unsupported.append("mixture-of-experts blocks")
    if unsupported:
        raise NotImplementedError(
            f"megatron_fsdp.integrations.torchtitan shards with data, tensor and context parallelism; this job asks for "
            f"{', '.join(unsupported)}. Use torchtitan's own module for it."
        )


def _schedules_take_torchtitans_step() -> bool:
    """Whether torch's pipeline schedules take the micro-batch lists torchtitan passes to step."""
    return all("arg_mbs" in inspect.signature(schedule.step).parameters
               for schedule in (PipelineScheduleSingle, PipelineScheduleMulti))


def _data_parallel_mesh(parallel_dims: Any, spmd_backend: str) -> Any:
    """The mesh torchtitan's FSDP path shards over: (dp_replicate, shard dim) under HSDP."""
    shard_dim = "fsdp" if spmd_backend == "partial_dtensor" else "dp_shard"
    names = ["dp_replicate", shard_dim] if parallel_dims.dp_replicate_enabled else [shard_dim]
    return parallel_dims.get_mesh(names)


def shard_decoder(
    model: nn.Module,
    mesh: Any,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
    enable_symm_mem: bool = False,
    pp_enabled: bool = False,
) -> None:
    """Shards a torchtitan decoder in place with megatron_fsdp's ``fully_shard``, in the units
    torchtitan's ``apply_fsdp_to_decoder`` makes for a dense model: the embedding (with the norm
    and head when weights are tied), the final norm and head as one group kept gathered after
    forward unless the policy is ``"always"``, each transformer block, then the root. Gradients
    are not divided by the group size: torchtitan's loss already divides by the global token
    count. ``model`` may be one pipeline stage of it (``pp_enabled``), missing the embedding or the
    norm and head; the ``"default"`` policy then keeps the weights gathered between micro-batches."""
    fsdp_kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False),
    }
    if cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy()
    reshard_after_forward = get_fsdp_reshard_after_forward_policy(reshard_after_forward_policy, pp_enabled=pp_enabled)
    keep_head_gathered = reshard_after_forward_policy == "always"
    head = [m for m in (model.norm, model.lm_head) if m is not None]
    if model.enable_weight_tying:
        fully_shard([model.tok_embeddings, *head], **fsdp_kwargs, reshard_after_forward=keep_head_gathered)
    else:
        if model.tok_embeddings is not None:
            fully_shard(model.tok_embeddings, **fsdp_kwargs, reshard_after_forward=reshard_after_forward)
        if len(head) == 2:
            fully_shard(head, **fsdp_kwargs, reshard_after_forward=keep_head_gathered)
    for block in model.layers.values():
        fully_shard(block, **fsdp_kwargs, reshard_after_forward=reshard_after_forward)
    fully_shard(model, **fsdp_kwargs)
    if enable_symm_mem:
        enable_fsdp_symm_mem(model)
    disable_fsdp_gradient_division(model)
    logger.info("megatron_fsdp: sharded %d blocks over mesh %s", len(model.layers), mesh)


def parallelize_llama(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
) -> nn.Module:
    """torchtitan's parallelize function for llama3 (same keywords as torchtitan's
    ``parallelize_llama``), sharding with megatron_fsdp: context parallelism and tensor
    parallelism as torchtitan applies them, activation checkpointing, then per-block
    ``torch.compile`` when ``compile.components`` holds ``"model"``, then :func:`shard_decoder`.
    The model may be on the meta device, as torchtitan builds it."""
    _refuse_unsupported(parallel_dims, model, parallelism.spmd_backend)
    if parallel_dims.cp_enabled:
        attentions = [block.attention.inner_attention for block in model.layers.values()]
        apply_cp_to_forward(attentions, parallel_dims.get_mesh("cp"))
    if parallel_dims.tp_enabled:
        # torchtitan's own plan: the parameters become DTensors on the "tp" dim, whose local
        # tensors fully_shard then shards over the "fsdp" dim of the same mesh.
        model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    shard_decoder(
        model,
        _data_parallel_mesh(parallel_dims, parallelism.spmd_backend),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
        pp_enabled=parallel_dims.pp_enabled,
    )
    return model


def with_megatron_fsdp(config: Any) -> Any:
    """Returns torchtitan's ``Trainer.Config`` ``config`` with its llama3 model spec sharded by
    megatron_fsdp (the spec's ``parallelize_fn`` replaced). Raises ``ValueError`` for a spec
    whose parallelize function is not torchtitan's llama3 one."""
    spec = config.model_spec
    if spec is None or spec.parallelize_fn is not torchtitan_parallelize_llama:
        raise ValueError(
            "megatron_fsdp.integrations.torchtitan replaces torchtitan's llama3 parallelize function; "
            f"this config's model spec uses {getattr(spec, 'parallelize_fn', None)!r}"
        )
    spec.parallelize_fn = parallelize_llama
    return config


def __getattr__(name: str) -> Callable[[], Any]:
    """``--config NAME``: torchtitan's llama3 config function NAME, sharded by megatron_fsdp."""
    registry = importlib.import_module(LLAMA3_CONFIG_REGISTRY)
    make_config = getattr(registry, name, None) if not name.startswith("_") else None
    if not callable(make_config) or not name.startswith("llama3"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (nor has {LLAMA3_CONFIG_REGISTRY})")

    @functools.wraps(make_config)
    def make_megatron_fsdp_config() -> Any:
        return with_megatron_fsdp(make_config())

    return make_megatron_fsdp_config
