"""Runs torchtitan's own trainer on the CPU over gloo, in a rank process of tests/_dist.py.

torchtitan assumes an accelerator: it picks its device module when imported (CUDA when none is
found), reads memory statistics from it, and its decoder imports triton kernels for expert
parallelism. Only torchtitan is adapted here, before its first import: its device is "cpu" with
a device module answering what torchtitan asks of one (no memory statistics), its triton kernel
module (never run by a dense model) is replaced by one that raises if called, FlexAttention
runs eagerly (torch has no compiled CPU backward for it), FSDP reductions sum (gloo has no
PREMUL_SUM), the timeout change after the first step is a plain barrier, and float8 Linear
layers emulate their matmuls (as torchtitan's own error advises without float8 hardware).
megatron_fsdp is used as shipped.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _cpu_device_module() -> types.ModuleType:
    """torch.cpu plus the calls torchtitan makes on a CUDA-like module, answered for the host."""
    module = types.ModuleType("cpu_for_torchtitan")
    module.__dict__.update(vars(torch.cpu))
    module.set_device = lambda device: None
    module.device_count = lambda: 1
    module.current_device = lambda: 0
    module.get_device_name = lambda device=None: "cpu"
    module.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    module.memory_stats = lambda device=None: {}
    module.reset_peak_memory_stats = lambda device=None: None
    module.empty_cache = lambda: None
    return module


def _triton_kernels_placeholder() -> types.ModuleType:
    module = types.ModuleType(TRITON_KERNELS)

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{TRITON_KERNELS}.{name} is a triton kernel: CUDA only")

        return kernel

    module.__getattr__ = missing
    return module


def adapt_torchtitan_for_cpu() -> None:
    """Call before torchtitan is imported in this process."""
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError("torchtitan was imported before it was adapted for the CPU")
    import torch._utils as torch_utils

    find_type, find_module = torch_utils._get_available_device_type, torch_utils._get_device_module
    cpu_module = _cpu_device_module()
    torch_utils._get_available_device_type = lambda: "cpu"
    torch_utils._get_device_module = lambda device_type=None: cpu_module
    try:
        import torchtitan.tools.utils  # noqa: F401 - binds device_type and device_module now
    finally:
        torch_utils._get_available_device_type, torch_utils._get_device_module = find_type, find_module
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.modules.setdefault(TRITON_KERNELS, _triton_kernels_placeholder())
    _run_flex_attention_eagerly()
    _sum_reductions_for_gloo()
    _plain_barrier_for_timeouts()
    _emulate_float8_matmuls()


def _emulate_float8_matmuls() -> None:
    """torchtitan's float8 converter refuses a machine without float8 matmuls unless its config
    says ``emulate``, which the ``llama3_debugmodel_float8`` config does not (and cannot be given
    on the command line: the converter runs inside the config function). Set it: torchtitan then
    builds torchao's ``Float8LinearConfig(emulate=True)``, the tensorwise recipe computed in fp32."""
    from torchtitan.components.quantization.float8 import Float8LinearConverter

    build_converter = Float8LinearConverter.__init__

    def build_emulating(self: Any, config: Any) -> None:
        config.emulate = True
        build_converter(self, config)

    Float8LinearConverter.__init__ = build_emulating


def _plain_barrier_for_timeouts() -> None:
    """After the first step torchtitan shortens every group's timeout behind a barrier on the
    current CUDA device, through ``torch.distributed.set_timeout`` (newer than torch 2.13): a
    plain barrier here (the rank pool has its own timeout)."""
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: torch.distributed.barrier()


def _sum_reductions_for_gloo() -> None:
    """torchtitan turns FSDP's gradient division off (factor 1.0), which torch's FSDP2 does with a
    PREMUL_SUM reduce-scatter that gloo lacks; FSDP2's own switch sums instead, same values."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed import fsdp

    disable_division = fsdp.disable_fsdp_gradient_division

    def disable_division_with_sums(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_division_with_sums


def _run_flex_attention_eagerly() -> None:
    """torchtitan's attention is FlexAttention, compiled. torch has no compiled CPU backward for
    it, but its eager (math) path has one, behind a device check: run that, uncompiled. Under
    ``--compile.backend aot_eager`` torchtitan hands the attention region of each block to
    inductor (its only compiled flex path), which fails on the CPU: leave it to aot_eager,
    which runs the same math path."""
    import torch.nn.attention.flex_attention as flex
    from torchtitan.distributed import compile as titan_compile
    from torchtitan.models.common import attention

    flex._validate_device = lambda query, key, value: None
    attention.FlexAttention._compiled_flex_attn = flex.flex_attention
    attention._compiled_create_block_mask = flex.create_block_mask
    titan_compile._maybe_regional_inductor_backend = lambda model, backend: backend


def train(run_dir: str, args: list[str]) -> list[tuple[int, float]]:
    """torchtitan's entry point (``torchtitan.train.main``) without its process-group teardown:
    parse ``args`` with torchtitan's ConfigManager, build the Trainer, train, close. Runs in
    ``run_dir`` (which holds the assets, examples/torchtitan_offline_assets.py); returns each
    logged step's global average loss as the trainer's metrics logger received it."""
    if "torchtitan.tools.utils" not in sys.modules:
        adapt_torchtitan_for_cpu()
    from torchtitan.config import ConfigManager

    os.chdir(run_dir)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])  # what torchrun, torchtitan's launcher, sets
    config = ConfigManager().parse_args(args)
    trainer = config.build()
    losses: list[tuple[int, float]] = []
    log_metrics = trainer.metrics_processor.log

    def record(step: int, global_avg_loss: float, *rest: Any, **kwargs: Any) -> Any:
        losses.append((step, float(global_avg_loss)))
        return log_metrics(step, global_avg_loss, *rest, **kwargs)

    trainer.metrics_processor.log = record
    try:
        if config.checkpoint.create_seed_checkpoint:  # the entry point's seed branch
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        trainer.close()
    return losses


def train_runs(rank: int, world_size: int, run_dir: str, runs: list[list[str]]) -> list[list[tuple[int, float]]]:
    """:func:`train` for each argument list in turn, in one process group (torchtitan keeps an
    initialised one); for tests/_dist.py's ``run_distributed``."""
    return [train(run_dir, args) for args in runs]
