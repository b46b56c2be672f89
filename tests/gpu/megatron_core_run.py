"""One side of tests/gpu/test_megatron_core.py, run under torchrun: trains megatron-core's
GPTModel with its FullyShardedDataParallel, distributed optimizer (clip_grad=1.0) and
finalize_model_grads, the way Megatron-LM's training loop drives them, on megatron-core's
bundled megatron-fsdp or (``--package ours``) on megatron_fsdp through
``megatron_fsdp.integrations.megatron_core.install()``; saves and loads the ``fsdp_dtensor``
checkpoint as Megatron-LM's checkpointing does. Rank 0 writes what it measured to ``--out``.

    torchrun --nproc-per-node N tests/gpu/megatron_core_run.py --package ours --out ours.json --ckpt DIR
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

STRATEGIES = ("optim_grads_params", "optim_grads", "optim")
STEPS, SAVE_AT = 20, 10
VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 256, 32, 2, 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--package", choices=("bundled", "ours"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    return parser.parse_args()


args = parse_args()
if args.package == "ours":
    from megatron_fsdp.integrations import megatron_core as _switch

    _switch.install()  # before the first import of megatron.core

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    finalize_model_grads,
)
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (  # noqa: E402
    preprocess_state_dict_for_uneven_dtensor,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_fp8_extra_state_case  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: E402


def build_model(seed: int) -> GPTModel:
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
    )
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ).cuda()


def wrap(model: GPTModel, strategy: str | None) -> torch.nn.Module:
    """FSDP with ``strategy``; None: megatron-core's own DDP, the single-process-equivalent reference."""
    if strategy is None:
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
        return DistributedDataParallel(model.config, ddp_config, model)
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=True, overlap_param_gather=True, use_distributed_optimizer=True,
    )
    return FullyShardedDataParallel(model.config, ddp_config, model, fsdp_unit_modules=[TransformerLayer])


def build(strategy: str | None, seed: int) -> tuple[torch.nn.Module, object]:
    model = wrap(build_model(seed), strategy)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, clip_grad=1.0), [model]
    )
    config = model.config
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def batches(step: int) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of ``step``: the same in every run."""
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool)).logical_not().cuda()
    position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ).cuda()
    out = []
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator).cuda()
        out.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], position_ids=position_ids, attention_mask=mask))
    return out


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    per_token = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(output: torch.Tensor):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    return per_token, loss_func


def train_step(model: torch.nn.Module, optimizer, step: int) -> tuple[float, float]:
    """Megatron-LM's train_step: zero the grad buffers, forward/backward every micro-batch
    (no_sync, then finalize_model_grads), optimizer.step() (clips, steps, installs weights)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    stored = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches(step)), model=model,
        num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
    )
    success, grad_norm, _ = optimizer.step()
    if not success:
        raise RuntimeError(f"optimizer step {step} was skipped")
    loss = torch.stack([item["lm loss"] for item in stored]).mean()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item(), float(grad_norm)


def fsdp_dtensor_state(model: torch.nn.Module, optimizer, is_loading: bool) -> dict:
    """What Megatron-LM's checkpointing hands DCP for ``--ckpt-format fsdp_dtensor``."""
    state = {"model": unwrap_model(model).state_dict_for_save_checkpoint()}
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"}
    )
    handle_fp8_extra_state_case(state["model"])
    return state


def save(model: torch.nn.Module, optimizer, directory: str) -> None:
    state = preprocess_state_dict_for_uneven_dtensor(fsdp_dtensor_state(model, optimizer, is_loading=False))
    dcp.save(state_dict=state, storage_writer=FileSystemWriter(directory))


def load(model: torch.nn.Module, optimizer, directory: str) -> None:
    state = fsdp_dtensor_state(model, optimizer, is_loading=True)
    raw_model, raw_optimizer = state["model"].copy(), state["optimizer"].copy()
    preprocess_state_dict_for_uneven_dtensor(state)
    dcp.load_state_dict(state_dict=state, storage_reader=FileSystemReader(directory), planner=DefaultLoadPlanner())
    try:  # Megatron-LM retries without strict when a strict load raises
        model.load_state_dict(raw_model, strict=True)
    except Exception:  # noqa: BLE001 - as Megatron-LM's load_model_state_dict
        model.load_state_dict(raw_model, strict=False)
    optimizer.load_state_dict(raw_optimizer)


def run_strategy(strategy: str, directory: str) -> dict:
    model, optimizer = build(strategy, seed=1234)
    history = []
    for step in range(STEPS):
        if step == SAVE_AT:
            save(model, optimizer, directory)
        history.append(train_step(model, optimizer, step))
    del model, optimizer
    fresh, fresh_optimizer = build(strategy, seed=4321)  # other initial weights: the load must replace them
    load(fresh, fresh_optimizer, directory)
    resumed = [train_step(fresh, fresh_optimizer, step) for step in range(SAVE_AT, STEPS)]
    return {
        "losses": [loss for loss, _ in history], "grad_norms": [norm for _, norm in history],
        "resumed_losses": [loss for loss, _ in resumed], "resumed_grad_norms": [norm for _, norm in resumed],
    }


def main() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    parallel_state.initialize_model_parallel(1, 1)
    import megatron.core.distributed.fsdp.src.megatron_fsdp as package

    results: dict = {"package": args.package, "package_file": package.__file__, "world_size": dist.get_world_size(),
                     "strategies": {}, "errors": {}}
    if args.package == "bundled":
        model, optimizer = build(None, seed=1234)
        reference = [train_step(model, optimizer, step) for step in range(STEPS)]
        results["reference"] = {"losses": [l for l, _ in reference], "grad_norms": [n for _, n in reference]}
        del model, optimizer
    for strategy in args.strategies.split(","):
        try:
            results["strategies"][strategy] = run_strategy(strategy, os.path.join(args.ckpt, args.package, strategy))
        except Exception:  # noqa: BLE001 - every strategy reports, the test prints the traceback
            results["errors"][strategy] = traceback.format_exc()
            print(f"[{args.package}] {strategy} failed:\n{results['errors'][strategy]}", flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
