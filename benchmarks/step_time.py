"""Training step time and memory of megatron_fsdp against NVIDIA's megatron-fsdp, torch FSDP2,
DDP and a one-GPU floor, on the same GPT (examples/gpt_model.py), data and seed, in one run.

    python benchmarks/step_time.py --nproc-per-node 2 --config 1.3B --micro-batch 1 --seq-len 1024

Each row (an implementation at a depth) runs in its own processes: this script launches
``torchrun --standalone --nproc_per_node N`` once per row, the row's rank 0 writes it as JSON,
and this process prints the rows as one table. Launched under torchrun as before
(``torchrun --standalone --nproc_per_node 2 benchmarks/step_time.py ...``), local rank 0 does
the launching with that many processes per row and the other ranks exit.

NVIDIA's megatron-fsdp (PyPI) is imported as ``megatron_fsdp`` too, so its row runs with the
directory it was installed into first on PYTHONPATH. Install it (and einops, which it imports)
there and name the directory:

    python -m pip install --no-deps --target /tmp/nv-site megatron_fsdp-0.6.1-py3-none-any.whl einops-0.8.1-py3-none-any.whl
    python benchmarks/step_time.py --nproc-per-node 1 --nvidia-site /tmp/nv-site \
        --impls "megatron_fsdp optim_grads_params fp32-comm,NVIDIA,torch FSDP2,floor"

Without --nvidia-site its row is skipped, saying so.

Every implementation computes in bf16 with fp32 master weights and fused AdamW (lr 1e-4):

- megatron_fsdp and NVIDIA's megatron-fsdp: a bf16 model, ``MixedPrecisionPolicy(fp32 main
  params, fp32 main grads, grad_comm_dtype fp32 | bf16)``, the transformer blocks as units
  (the ``bf16-grads`` row: bf16 main grads and communication);
- torch FSDP2: an fp32 model, ``fully_shard`` per block and on the root,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
- torch DDP: fp32 weights under bf16 autocast;
- ``compiled`` rows: each transformer block compiled after sharding (torchtitan's recipe);
  ``float8`` rows: torchtitan's float8 recipe (torchao's tensorwise ``Float8Linear`` in the
  blocks, float8 weight all-gathers; FSDP2 calls torchao's precompute after each step);
- ``hsdp`` and ``hfsdp`` rows (world size 4 and up, even): the ranks as a 2-D mesh of
  (2, world / 2), parameters sharded over the second dim and replicated over the first. Ours with
  ``outer_dp_sharding_strategy="no_shard"`` (HSDP) or ``"optim"`` (HFSDP: main params, main grads
  and optimizer state split over the first dim too; docs/hsdp.md); FSDP2's ``hsdp`` row is
  ``fully_shard`` with that 2-D mesh (its HSDP: replicate over dim 0, shard over dim 1). Both
  hybrid rows of ours are compared with FSDP2's HSDP row;
- the single-GPU floor (world size 1 only; skipped above it): our arithmetic with no sharding
  machinery, in plain torch: a bf16 model, fp32 master weights and gradients (the bf16 gradients
  copied in by one multi-tensor copy), fused AdamW on the masters, one multi-tensor cast back.

Reported per row: median step time over --steps timed steps after --warmup, its ratio to FSDP2's
row in the same configuration (eager, compiled, float8, offloaded), tokens/s/GPU, model
TFLOP/s/GPU and MFU (over the device's dense bf16 peak, float8 rows too), peak allocated and
reserved memory, the median CPU time per step (all of the process's threads from a step's
start until it returns to the caller, before the synchronise that ends the timed step:
launches, hooks, the autograd thread, and any wait inside the step), the CUDA kernels one step
launches (one profiled step after the timed ones), the final loss, and
the host memory held (resident set, pinned bytes; with CPU offloading the optimizer lives there).

``--layers 8,16`` runs --config's width at those depths; ``--largest`` goes through the depths
in order (default 8..64) and stops at the first that fails: the deepest model each
implementation trains. A depth whose offloaded state would not fit the host's available memory
(16 bytes per parameter) is skipped without trying, since the kernel would kill the run.

``--device cpu`` runs the same processes on gloo for a smoke test of the script (no GPU memory,
no kernel counts, times without meaning); NVIDIA's package and the offloaded rows need CUDA
and are skipped there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt_model import GPT, GPTConfig, TransformerBlock, training_flops_per_token  # noqa: E402

CONFIGS = {
    "small": GPTConfig(vocab_size=32000, seq_len=1024, layers=4, hidden=512, heads=8, ffn=1408),
    "1.3B": GPTConfig(vocab_size=32000, seq_len=2048, layers=24, hidden=2048, heads=16, ffn=5632),
    "8B": GPTConfig(vocab_size=128256, seq_len=4096, layers=32, hidden=4096, heads=32, ffn=14336),
}

NVIDIA = "NVIDIA megatron-fsdp optim_grads_params fp32-comm"
FLOOR = "single-GPU floor (plain torch)"


def _build(config: GPTConfig, device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    return model.to(dtype)


def _is_nvidia(package) -> bool:
    """Whether an imported ``megatron_fsdp`` is NVIDIA's package (it names NVIDIA as its contact)."""
    return getattr(package, "__contact_names__", "") == "NVIDIA"


def _megatron_fsdp(nvidia: bool):
    """The ``megatron_fsdp`` this process imports, checked to be NVIDIA's or ours: both have that
    name, and PYTHONPATH decides which one loads (--nvidia-site puts NVIDIA's first)."""
    import megatron_fsdp

    if _is_nvidia(megatron_fsdp) != nvidia:
        wanted = "NVIDIA's megatron-fsdp" if nvidia else "this repository's megatron_fsdp"
        raise RuntimeError(f"this row needs {wanted}, but this process imports {megatron_fsdp.__file__}")
    return megatron_fsdp


def imports_here(name: str) -> bool:
    """Whether row ``name`` can be built in this process: the megatron_fsdp rows need the
    package (ours or NVIDIA's) that this process imports under that name."""
    if name != NVIDIA and not name.startswith("megatron_fsdp"):
        return True
    try:
        import megatron_fsdp
    except ImportError:
        return False
    return _is_nvidia(megatron_fsdp) == (name == NVIDIA)


def _convert_to_float8(model: GPT, device: torch.device) -> None:
    """torchtitan's float8 recipe: torchao's tensorwise ``Float8Linear`` in the transformer
    blocks (not the head) with float8 weight all-gathers; matmuls emulated in fp32 on the CPU."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=device.type != "cuda")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name.startswith("blocks."))


# The hybrid rows' first mesh dim: replicas (HSDP) or the outer split of the optimizer (HFSDP).
HYBRID_OUTER = 2


def _hybrid_mesh(device: torch.device, names: tuple[str, str]):
    """The ranks as a (HYBRID_OUTER, world / HYBRID_OUTER) mesh, the outer dim first."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (HYBRID_OUTER, dist.get_world_size() // HYBRID_OUTER), mesh_dim_names=names)


def _megatron(
    strategy: int, comm: torch.dtype, double_buffer: bool = False, nccl_ub: bool = False, offload: bool = False,
    main_grads: torch.dtype = torch.float32, float8: bool = False, capturable: bool = False, outer: str | None = None,
) -> Callable:
    """``outer``: None shards over every rank; "no_shard" (HSDP) or "optim" (HFSDP) runs on the
    hybrid mesh with that ``outer_dp_sharding_strategy``."""

    def make(config, device):
        megatron_fsdp = _megatron_fsdp(nvidia=False)
        mesh_arguments = {}
        if outer is not None:
            mesh = _hybrid_mesh(device, ("dp_outer", "dp_shard"))
            mesh_arguments = dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", outer_dp_sharding_strategy=outer)
        model = _build(config, device, torch.bfloat16)
        if float8:
            # Ours makes the float8 scales where the step installs the main params: no
            # precompute call after the step (torchao's is a no-op over our weights).
            _convert_to_float8(model, device)
        # capturable: the step count on the device, as a step captured in a CUDA graph needs.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=capturable)
        policy = megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=main_grads, grad_comm_dtype=comm)
        return megatron_fsdp.fully_shard(
            model, optimizer, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy, mixed_precision_policy=policy,
            fsdp_double_buffer=double_buffer, nccl_ub=nccl_ub, cpu_offload=offload, **mesh_arguments,
        ) + (False,)

    return make


def _nvidia(config, device):
    """NVIDIA's megatron-fsdp set up as our "optim_grads_params fp32-comm" row, through its
    ``fully_shard`` with its default mesh (all ranks sharding, a trivial TP dim)."""
    megatron_fsdp = _megatron_fsdp(nvidia=True)
    model = _build(config, device, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    policy = megatron_fsdp.MixedPrecisionPolicy(
        main_params_dtype=torch.float32, main_grads_dtype=torch.float32, grad_comm_dtype=torch.float32
    )
    # Its fully_shard takes one AdamW step on zero gradients to create the optimizer state (step
    # count 1, weight decay once): its losses differ slightly from the others' from then on.
    model, optimizer = megatron_fsdp.fully_shard(
        model, optimizer, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy="optim_grads_params",
        mixed_precision_policy=policy,
    )
    return model, optimizer, False


def _fsdp2_with(offload: bool, float8: bool = False, hybrid: bool = False) -> Callable:
    """``hybrid``: HSDP, ``fully_shard`` over the 2-D hybrid mesh (replicate dim 0, shard dim 1)."""

    def make(config, device):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        model = _build(config, device, torch.float32)
        if float8:
            _convert_to_float8(model, device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload_policy = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
        mesh = {"mesh": _hybrid_mesh(device, ("dp_replicate", "dp_shard"))} if hybrid else {}
        for block in model.blocks:
            fully_shard(block, mp_policy=policy, offload_policy=offload_policy, **mesh)
        fully_shard(model, mp_policy=policy, offload_policy=offload_policy, **mesh)
        # Offloaded, the parameters are on the host: torch's fused AdamW has a CPU kernel too.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        if float8:
            # torchtitan's step: every float8 weight's scale in one op after the optimizer step.
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
        return model, optimizer, False

    return make


def _compiled(make: Callable) -> Callable:
    """``make`` with each transformer block compiled after sharding (torchtitan's recipe)."""

    def build(config, device):
        model, optimizer, autocast = make(config, device)
        # MegatronFSDP wraps the model as .module; FSDP2 shards it in place.
        inner = getattr(model, "module", model)
        for block in inner.blocks:
            block.compile()
        return model, optimizer, autocast

    return build


def _ddp(config, device):
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(_build(config, device, torch.float32), device_ids=device_ids)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), True


class MasterWeightAdamW:
    """Fused AdamW on fp32 master copies of bf16 weights, in plain torch: megatron_fsdp's step
    arithmetic without its sharding machinery. ``step()`` copies the weights' bf16 gradients into
    the masters' fp32 gradients (one multi-tensor copy), runs torch's fused AdamW on the masters
    and casts them back into the weights (one multi-tensor copy). The master gradients stay
    allocated between steps, as the copy needs a destination."""

    def __init__(self, weights: Iterable[torch.nn.Parameter], **adamw) -> None:
        self.weights = list(weights)
        self.masters = [weight.detach().float().requires_grad_() for weight in self.weights]
        for master in self.masters:
            master.grad = torch.zeros_like(master)
        self.adamw = torch.optim.AdamW(self.masters, fused=True, **adamw)
        self.state = self.adamw.state

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_copy_([master.grad for master in self.masters], [weight.grad for weight in self.weights])
        self.adamw.step()
        torch._foreach_copy_(self.weights, self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for weight in self.weights:
            if set_to_none:
                weight.grad = None
            elif weight.grad is not None:
                weight.grad.zero_()


def _floor_with(capturable: bool = False) -> Callable:
    def make(config, device):
        model = _build(config, device, torch.bfloat16)
        return model, MasterWeightAdamW(model.parameters(), lr=1e-4, capturable=capturable), False

    return make


IMPLEMENTATIONS: dict[str, Callable] = {
    "megatron_fsdp optim_grads_params fp32-comm": _megatron(3, torch.float32),
    "megatron_fsdp optim_grads_params fp32-comm compiled": _compiled(_megatron(3, torch.float32)),
    "megatron_fsdp optim_grads_params fp32-comm float8": _megatron(3, torch.float32, float8=True),
    "megatron_fsdp optim_grads_params fp32-comm compiled float8": _compiled(_megatron(3, torch.float32, float8=True)),
    "megatron_fsdp optim_grads_params bf16-comm": _megatron(3, torch.bfloat16),
    # bf16 main gradients: the C++ ops step AdamW reading them as they are (no fp32 copy).
    "megatron_fsdp optim_grads_params bf16-grads": _megatron(3, torch.bfloat16, main_grads=torch.bfloat16),
    "megatron_fsdp optim_grads_params fp32-comm double-buffer": _megatron(3, torch.float32, double_buffer=True),
    "megatron_fsdp optim_grads_params fp32-comm nccl-ub": _megatron(3, torch.float32, nccl_ub=True),
    "megatron_fsdp optim_grads fp32-comm": _megatron(2, torch.float32),
    "megatron_fsdp optim fp32-comm": _megatron(1, torch.float32),
    "megatron_fsdp optim_grads_params fp32-comm cpu-offload": _megatron(3, torch.float32, offload=True),
    "megatron_fsdp optim_grads_params fp32-comm hsdp": _megatron(3, torch.float32, outer="no_shard"),
    "megatron_fsdp optim_grads_params fp32-comm hfsdp": _megatron(3, torch.float32, outer="optim"),
    NVIDIA: _nvidia,
    "torch FSDP2": _fsdp2_with(offload=False),
    "torch FSDP2 compiled": _compiled(_fsdp2_with(offload=False)),
    "torch FSDP2 float8": _fsdp2_with(offload=False, float8=True),
    "torch FSDP2 compiled float8": _compiled(_fsdp2_with(offload=False, float8=True)),
    "torch FSDP2 cpu-offload": _fsdp2_with(offload=True),
    "torch FSDP2 hsdp": _fsdp2_with(offload=False, hybrid=True),
    "torch DDP": _ddp,
    FLOOR: _floor_with(),
}


def batch(config: GPTConfig, args, step: int, rank: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(step * 1000 + rank)
    return torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), device=device, generator=generator)


def train_step(
    model, optimizer, autocast: bool, config: GPTConfig, tokens: torch.Tensor, after_phase: Callable[[], None] = lambda: None
) -> torch.Tensor:
    """One step: forward, backward, optimizer step; returns the loss (not synchronised).
    ``after_phase`` is called after each of the three (profile_step.py times them)."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1))
    after_phase()
    loss.backward()
    after_phase()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    after_phase()
    return loss.detach()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(name: str, make: Callable, config: GPTConfig, args, device: torch.device, progress: dict[str, str]) -> dict:
    """The row's numbers; ``progress["at"]`` says what it is doing (for a failure's report)."""
    cuda = device.type == "cuda"
    progress["at"] = "building the model"
    model, optimizer, autocast = make(config, device)
    rank = dist.get_rank()
    times, cpu_times, losses = [], [], []
    for step in range(args.warmup + args.steps):
        progress["at"] = f"step {step + 1} of {args.warmup + args.steps}"
        tokens = batch(config, args, step, rank, device)
        _synchronize(device)
        started, cpu_started = time.perf_counter(), time.process_time()
        loss = train_step(model, optimizer, autocast, config, tokens)
        cpu_time = time.process_time() - cpu_started
        _synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
            cpu_times.append(cpu_time)
        losses.append(loss)
    final_loss = torch.stack(losses[-5:]).float().mean()
    dist.all_reduce(final_loss)
    tokens = batch(config, args, args.warmup + args.steps, rank, device)
    progress["at"] = "the profiled step that counts kernels"
    kernels = _kernels_in_one_step(model, optimizer, autocast, config, tokens) if cuda else None
    median = statistics.median(times)
    tokens_per_s = args.micro_batch * args.seq_len / median
    flops = training_flops_per_token(config, args.seq_len)
    peak = peak_bf16_tflops(torch.cuda.get_device_name(device)) if cuda else None
    tflops = flops * tokens_per_s / 1e12
    return {
        "median_step_s": median,
        "tokens_per_s_per_gpu": tokens_per_s,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
        "cpu_ms_per_step": statistics.median(cpu_times) * 1e3,
        "kernels_per_step": kernels,
        # Over the whole run (0 and 0 for eager rows).
        **compile_counts(),
        "final_loss": final_loss.item() / dist.get_world_size(),
        **_host_memory(model, optimizer),
        **_environment(name, device),
    }


# Dense bf16 tensor-core peak (TFLOP/s) by device name, from NVIDIA's data sheets (SXM parts).
# MFU is model FLOPs over this peak for every row, float8 rows included, as torchtitan reports it.
_PEAK_BF16_TFLOPS = {"H100 80GB HBM3": 989.4, "H200": 989.4}


def peak_bf16_tflops(device_name: str) -> float | None:
    return next((peak for part, peak in _PEAK_BF16_TFLOPS.items() if part in device_name), None)


def compile_counts() -> dict[str, int]:
    """torch.compile's graphs and graph breaks in this process so far."""
    counters = torch._dynamo.utils.counters
    return {"compiled_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def _kernels_in_one_step(model, optimizer, autocast: bool, config: GPTConfig, tokens: torch.Tensor) -> int:
    """CUDA kernels one training step launches, as the profiler (CUPTI) records them; copies
    and memsets are not kernels and not counted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step(model, optimizer, autocast, config, tokens)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            return sum(event.get("cat") == "kernel" for event in json.load(file)["traceEvents"])


def _host_memory(model, optimizer) -> dict:
    """Host memory this process holds now (resident set and its high-water mark), pinned bytes
    of torch's host allocator, the optimizer state on the host, and megatron_fsdp's own
    offloaded buffers."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    host_state = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.device.type == "cpu"
    )
    row = {
        "host_rss_gib": int(status["VmRSS"].split()[0]) / 2**20,
        "host_peak_rss_gib": int(status["VmHWM"].split()[0]) / 2**20,
        "host_optimizer_state_gib": host_state / 2**30,
        "host_pinned_gib": torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / 2**30,
    }
    if hasattr(model, "offloaded_host_bytes"):
        row["offloaded_buffers_gib"] = model.offloaded_host_bytes() / 2**30
    return row


def _environment(name: str, device: torch.device) -> dict:
    """What this row ran on, and for the megatron_fsdp rows which package it imported."""
    cuda = device.type == "cuda"
    environment = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "world_size": dist.get_world_size(),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
    }
    package = sys.modules.get("megatron_fsdp")
    if package is not None and (name == NVIDIA or name.startswith("megatron_fsdp")):
        environment["package"] = f"megatron_fsdp {package.__version__} ({os.path.dirname(package.__file__)})"
    return environment


def _parameters(config: GPTConfig) -> int:
    per_layer = 4 * config.hidden * config.hidden + 3 * config.hidden * config.ffn + 2 * config.hidden
    return config.layers * per_layer + (2 * config.vocab_size + config.seq_len + 1) * config.hidden


def _host_bytes_available() -> int:
    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines())
    return int(meminfo["MemAvailable"].split()[0]) * 1024


def _skip_reason(name: str, config: GPTConfig, args, nproc: int) -> str | None:
    """Why row ``name`` does not run at this depth and world size, or None."""
    if name == FLOOR and nproc != 1:
        return "skipped: the floor is one GPU's; run it with --nproc-per-node 1"
    if name == NVIDIA:
        if args.nvidia_site is None:
            return "skipped: pass --nvidia-site DIR, with NVIDIA's megatron-fsdp installed there by pip install --target DIR"
        if not os.path.isdir(os.path.join(args.nvidia_site, "megatron_fsdp")):
            return f"skipped: no megatron_fsdp package in {args.nvidia_site}"
        if args.device != "cuda":
            return "skipped: NVIDIA's megatron-fsdp needs CUDA"
    if "offload" in name and args.device != "cuda":
        return "skipped: offloading needs CUDA"
    if _is_hybrid(name) and (nproc < 2 * HYBRID_OUTER or nproc % HYBRID_OUTER):
        return f"skipped: the hybrid mesh ({HYBRID_OUTER}, world / {HYBRID_OUTER}) needs a world size of {2 * HYBRID_OUTER} or more, a multiple of {HYBRID_OUTER}"
    # Offloaded main params, gradients and Adam's two moments: 16 bytes per parameter, split
    # over the ranks of this host; 10% headroom for the rest of the processes.
    needed = 16 * _parameters(config) if "offload" in name else 0
    available = _host_bytes_available()
    if needed > 0.9 * available:
        return f"skipped: needs ~{needed / 2**30:.0f} GiB of host memory, {available / 2**30:.0f} GiB available"
    return None


def _run_or_oom(name: str, config: GPTConfig, args, device: torch.device) -> dict:
    progress: dict[str, str] = {}
    try:
        return _run(name, IMPLEMENTATIONS[name], config, args, device, progress)
    except torch.OutOfMemoryError as error:
        # When and where it ran out (the innermost frame of ours or the benchmark's), how much was held.
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "torch/" not in f.filename]
        where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].line}" if frames else "?"
        message = str(error).split("See documentation")[0].strip()
        return {"error": "out of memory", "during": progress.get("at"), "where": where, "message": message}


# What torchrun sets for its workers: a launcher that runs under torchrun hands none of it on.
_TORCHRUN_VARIABLES = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
}


def _child_environment(name: str, args) -> dict[str, str]:
    environment = {
        key: value for key, value in os.environ.items()
        if key not in _TORCHRUN_VARIABLES and not key.startswith("TORCHELASTIC_")
    }
    if name == NVIDIA:
        path = [os.path.abspath(args.nvidia_site), environment.get("PYTHONPATH", "")]
        environment["PYTHONPATH"] = os.pathsep.join(part for part in path if part)
    return environment


def _worker_command(name: str, layers: int, args, nproc: int, row_path: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        os.path.abspath(__file__), "--worker", name, "--layers", str(layers), "--row-out", row_path,
        "--config", args.config, "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
    ]


def _run_in_own_processes(name: str, layers: int, args, nproc: int) -> dict:
    """Row ``name`` at ``layers`` from a torchrun of its own (its output goes to this terminal)."""
    with tempfile.TemporaryDirectory() as folder:
        row_path = os.path.join(folder, "row.json")
        process = subprocess.Popen(_worker_command(name, layers, args, nproc, row_path), env=_child_environment(name, args))
        try:
            code = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _stop(process)
            return {"error": f"timed out after {args.timeout:g} s"}
        except BaseException:
            _stop(process)
            raise
        if not os.path.exists(row_path):
            return {"error": f"failed: torchrun exited with {code} (its output is above)"}
        with open(row_path) as file:
            row = json.load(file)
        if code != 0:
            row["exit_code"] = code
        return row


def _stop(torchrun: subprocess.Popen) -> None:
    """Stops a row's torchrun, which on SIGTERM stops its workers (each in a process group of
    its own, out of reach of a signal to ours); SIGKILL if it has not exited in a minute."""
    torchrun.terminate()
    try:
        torchrun.wait(timeout=60)
    except subprocess.TimeoutExpired:
        torchrun.kill()
        torchrun.wait()


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def wanted_implementations(impls: str) -> list[str]:
    """Implementations by comma-separated names: an exact name picks itself, anything else every
    name containing it; 'all' picks all."""
    if impls == "all":
        return list(IMPLEMENTATIONS)
    picked = set()
    for item in impls.split(","):
        picked.update([item] if item in IMPLEMENTATIONS else [n for n in IMPLEMENTATIONS if item in n])
    return [n for n in IMPLEMENTATIONS if n in picked]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and batch arguments that :func:`model_config` and :func:`batch` read, shared by
    the benchmarks built on this one."""
    parser.add_argument("--config", choices=sorted(CONFIGS), default="1.3B")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)


def model_config(args) -> GPTConfig:
    return GPTConfig(**{**CONFIGS[args.config].__dict__, "seq_len": args.seq_len})


def _work(args) -> None:
    """One row in this torchrun's processes: ``args.worker`` at depth ``args.layers``; rank 0
    writes it to ``args.row_out``."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        # NCCL takes device memory outside torch's allocator at its first collective. On one GPU
        # an implementation may call none, so the harness's own all-reduce of the loss would come
        # first, after a model that fills the GPU left nothing: every row takes it here instead.
        dist.all_reduce(torch.zeros(1, device=device))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    config = dataclasses.replace(model_config(args), layers=int(args.layers))
    row = {"implementation": args.worker, "layers": config.layers, "parameters_b": _parameters(config) / 1e9}
    row.update(_run_or_oom(args.worker, config, args, device))
    if dist.get_rank() == 0:
        with open(args.row_out, "w") as file:
            json.dump(row, file)
    dist.destroy_process_group()


def _launch(args) -> None:
    """Every wanted row in processes of its own, then the table."""
    # Terminated, stop the running row's torchrun on the way out, as on Ctrl-C.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    nproc = args.nproc_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    config = model_config(args)
    depths = args.layers or ("8,16,20,24,28,32,40,48,56,64" if args.largest else str(config.layers))
    rows = []
    for name in wanted_implementations(args.impls):
        for layers in [int(depth) for depth in depths.split(",")]:
            depth_config = dataclasses.replace(config, layers=layers)
            row = {"implementation": name, "layers": layers, "parameters_b": _parameters(depth_config) / 1e9}
            reason = _skip_reason(name, depth_config, args, nproc)
            row.update({"error": reason} if reason else _run_in_own_processes(name, layers, args, nproc))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # the rows so far, so a cut-off run keeps them; _report writes the whole file
                with open(args.out, "w") as handle:
                    json.dump({"rows": rows, "partial": True}, handle, indent=2)
            if args.largest and "error" in row:
                break
    _report(rows, args, config, nproc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--impls", default="all", help="comma-separated names (exact, else substrings) or 'all'")
    parser.add_argument("--out", default=None, help="write rows and setting as JSON here")
    parser.add_argument("--layers", default=None,
                        help="comma-separated depths to run --config's width at (default: its own depth)")
    parser.add_argument("--largest", action="store_true",
                        help="go through --layers (default 8,16,20,24,28,32,40,48,56,64) up to the first that fails")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="processes (GPUs) per row (default: torchrun's when launched by it, else 1)")
    parser.add_argument("--nvidia-site", default=None,
                        help="directory NVIDIA's megatron-fsdp was pip-installed into with --target (default: its row is skipped)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a smoke test on gloo (default cuda)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a row may take (default 1800)")
    # Set by the launcher for the processes of one row.
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _work(args)
    elif os.environ.get("LOCAL_RANK", "0") == "0":
        _launch(args)


# Configurations a row name ends with, in the order FSDP2's rows name them; a row is compared
# with FSDP2's row of the same ones (ours' hfsdp with FSDP2's hsdp: FSDP2 has no HFSDP).
CONFIGURATION_TAGS = ("cpu-offload", "compiled", "float8", "hsdp")


def _is_hybrid(name: str) -> bool:
    """Whether row ``name`` runs on the 2-D hybrid mesh."""
    return bool({"hsdp", "hfsdp"} & set(name.split()))


def fsdp2_counterpart(name: str) -> str:
    """The torch FSDP2 row in ``name``'s configuration (offloaded, compiled, float8, hybrid)."""
    words = ["hsdp" if word == "hfsdp" else word for word in name.split()]
    return " ".join(["torch FSDP2", *(tag for tag in CONFIGURATION_TAGS if tag in words)])


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ratio(value: float | None, reference: float | None) -> str:
    return "-" if value is None or not reference else f"{value / reference:.2f}"


def _report(rows: list[dict], args, config: GPTConfig, nproc: int) -> None:
    ran = next((r for r in rows if "device" in r), {})
    setting = {
        "device": ran.get("device", "none ran"),
        "gpus": nproc,
        "torch": ran.get("torch", torch.__version__),
        "nccl": ran.get("nccl"),
        "date": datetime.date.today().isoformat(),
        "config": args.config,
        "model": config.__dict__,
        "largest": args.largest,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "timed_steps": args.steps,
        "warmup": args.warmup,
    }
    done = {(r["implementation"], r.get("layers")): r for r in rows if "error" not in r}
    print(f"\n{setting['device']} x{setting['gpus']}, torch {setting['torch']}, NCCL {setting['nccl']}, {setting['date']}; "
          f"{args.config}, micro-batch {args.micro_batch}, seq {args.seq_len}, median of {args.steps} steps")
    print("| implementation | layers | params (B) | step ms | vs FSDP2 | vs floor | tokens/s/GPU | TFLOP/s/GPU | MFU | "
          "peak alloc GiB | peak reserved GiB | vs FSDP2 reserved | CPU ms/step | kernels/step | host RSS GiB | "
          "host pinned GiB | final loss |")
    print("| --- |" + " ---: |" * 16)
    for r in rows:
        layers, params = r.get("layers", config.layers), r.get("parameters_b", _parameters(config) / 1e9)
        if "error" in r:
            print(f"| {r['implementation']} | {layers} | {params:.2f} | {r['error']} |" + " |" * 13)
            continue
        # Each row against FSDP2 on the same model: the offloaded FSDP2 for offloaded rows.
        fsdp2 = done.get((fsdp2_counterpart(r["implementation"]), r.get("layers")), {})
        floor = done.get((FLOOR, r.get("layers")), {})
        print(f"| {r['implementation']} | {layers} | {params:.2f} | {r['median_step_s'] * 1e3:.1f} | "
              f"{_ratio(r['median_step_s'], fsdp2.get('median_step_s'))} | {_ratio(r['median_step_s'], floor.get('median_step_s'))} | "
              f"{r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | {_percent(r.get('mfu'))} | "
              f"{_number(r['peak_allocated_gib'], '.1f')} | "
              f"{_number(r['peak_reserved_gib'], '.1f')} | {_ratio(r['peak_reserved_gib'], fsdp2.get('peak_reserved_gib'))} | "
              f"{r['cpu_ms_per_step']:.1f} | {_number(r['kernels_per_step'], 'd')} | {r['host_rss_gib']:.1f} | "
              f"{r['host_pinned_gib']:.1f} | {r['final_loss']:.4f} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"setting": setting, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
