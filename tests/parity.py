"""Sharded training against a single-process reference on the same model, data and seed.

The reference trains one model on the concatenated global batch (all ranks, all micro-batches),
keeping fp32 master weights for a bf16 model exactly as megatron_fsdp does. The sharded run
splits the same rows over ranks and micro-batches. Both report the loss of every step, the
reduced gradients of the last step and the parameters after the last step.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import megatron_fsdp
from models import Block, make_batch, make_model


@dataclass(frozen=True)
class Setup:
    strategy: int | str = 3
    accum: int = 1
    dtype: torch.dtype = torch.float32
    optimizer: str = "adam"
    steps: int = 5
    micro_rows: int = 2
    model_options: tuple = ()
    no_sync_until_last: bool = False
    sync_each_microbatch: bool = True
    policy: megatron_fsdp.MixedPrecisionPolicy | None = None
    hsdp: tuple[int, int] | None = None  # (dp_outer, dp_shard) sizes of a 2-D mesh
    outer_strategy: str = "no_shard"
    double_buffer: bool = False
    # Gradient clipping before each step: None, "torch" (torch.nn.utils.clip_grad_norm_ over
    # model.parameters()) or "fused" (megatron_fsdp.clip_grad_norm_); MAX_NORM is small enough
    # that every step clips.
    clip: str | None = None
    # CPU offloading (cpu_offload=True): main params, optimizer grads and state on the host.
    offload: bool = False
    # fsdp_unit_modules; without any class the model holds, the whole model is one unit.
    unit_modules: tuple = (Block,)
    # Record the collectives each micro-batch (and the gradient sync after them) launches.
    count_collectives: bool = False
    # fully_shard's check_for_nan_in_grad: every rank's reduced shards checked before each step.
    check_for_nan_in_grad: bool = False

    def build_model(self):
        return make_model(seed=0, dtype=self.dtype, **dict(self.model_options))


@dataclass
class Result:
    losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    # Total gradient norm of each step (clipped runs): as returned by the clip, and as the other
    # way computes it on the same gradients (the fused norm before torch's clip, torch's norm of
    # the DTensor gradients before the fused clip).
    norms: list[float] = field(default_factory=list)
    other_norms: list[float] = field(default_factory=list)
    # count_collectives: per step, the collectives of each micro-batch and then of
    # finish_grad_sync() (torch.distributed's function names, e.g. "reduce_scatter_single"), and the
    # number of trainable buckets, each of which a step must reduce.
    collectives: list[list[Counter]] = field(default_factory=list)
    trainable_buckets: int = 0


ADAM_LR = 1e-2
MAX_NORM = 0.05


def build_optimizer(params, name: str) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=ADAM_LR)
    if name == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)
    if name == "adam_fused":
        return torch.optim.Adam(params, lr=1e-2, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    raise ValueError(name)


def _rows(setup: Setup, world: int, step: int):
    return make_batch(step, world * setup.accum * setup.micro_rows)


def reference_run(setup: Setup, world: int, compute_dtype: torch.dtype | None = None, device: str = "cpu") -> Result:
    """The single-process run; ``compute_dtype`` overrides the model's dtype (the same initial
    values, e.g. a bf16 model's weights trained in fp32 as the exact-arithmetic yardstick)."""
    model = setup.build_model().to(device)
    if compute_dtype is not None:
        model = model.to(compute_dtype)
    main_dtype = main_params_dtype(setup)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    master = {n: p.detach().to(main_dtype).clone().requires_grad_(True) for n, p in trainable}
    optimizer = build_optimizer(list(master.values()), setup.optimizer)
    result = Result()
    for step in range(setup.steps):
        tokens, targets = _rows(setup, world, step)
        loss = model(tokens.to(device), targets.to(device))
        loss.backward()
        result.losses.append(loss.item())
        for name, param in trainable:
            master[name].grad = param.grad.to(main_dtype)
        if setup.clip is not None:
            result.norms.append(torch.nn.utils.clip_grad_norm_(list(master.values()), MAX_NORM).item())
        if step == setup.steps - 1:
            result.grads = {n: (master[n].grad if setup.clip else p.grad).detach().cpu() for n, p in trainable}
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for name, param in trainable:
                param.copy_(master[name])
                param.grad = None
    result.params = {n: _reported(master[n] if n in master else p) for n, p in model.named_parameters()}
    return result


def main_params_dtype(setup: Setup) -> torch.dtype:
    """The main (master) weights' dtype: fp32 under megatron_fsdp's default policy, else the policy's."""
    return (setup.policy or megatron_fsdp.MixedPrecisionPolicy()).resolve(setup.dtype).main_params


def _reported(param: torch.Tensor) -> torch.Tensor:
    """A parameter as a run reports it: in fp32, or in float64 where it is float64 (so float64
    runs are compared at their own precision)."""
    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
    return param.detach().to("cpu", dtype)


def sharded_run(rank: int, world: int, setup: Setup, device: str = "cpu") -> Result:
    model = setup.build_model().to(device)
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], setup.optimizer)
    mesh_arguments = {}
    if setup.hsdp is not None:
        mesh = init_device_mesh(torch.device(device).type, setup.hsdp, mesh_dim_names=("dp_outer", "dp_shard"))
        mesh_arguments = dict(
            device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", outer_dp_sharding_strategy=setup.outer_strategy
        )
    model, optimizer = megatron_fsdp.fully_shard(
        model,
        optimizer,
        **mesh_arguments,
        fsdp_unit_modules=list(setup.unit_modules),
        zero_dp_strategy=setup.strategy,
        sync_model_each_microbatch=setup.sync_each_microbatch,
        mixed_precision_policy=setup.policy,
        fsdp_double_buffer=setup.double_buffer,
        cpu_offload=setup.offload,
        check_for_nan_in_grad=setup.check_for_nan_in_grad,
    )
    result = Result(trainable_buckets=len(model.trainable_buckets()))
    for step in range(setup.steps):
        tokens, targets = _rows(setup, world, step)
        total = torch.zeros((), dtype=torch.float64, device=device)
        windows: list[Counter] = []
        for micro in range(setup.accum):
            start = (micro * world + rank) * setup.micro_rows
            rows = slice(start, start + setup.micro_rows)
            deferred = setup.no_sync_until_last and micro < setup.accum - 1
            with model.no_sync() if deferred else contextlib.nullcontext(), _collectives(setup, windows):
                loss = model(tokens[rows].to(device), targets[rows].to(device))
                (loss / setup.accum).backward()
            total += loss.detach().double()
        with _collectives(setup, windows):
            model.finish_grad_sync()
        dist.all_reduce(total)
        result.losses.append(total.item() / (world * setup.accum))
        result.collectives.append(windows)
        if setup.clip is not None:
            _clip(model, setup.clip, result)
        if step == setup.steps - 1:
            result.grads = {n: g.cpu() for n, g in model.full_gradients().items()}
        optimizer.step()
        optimizer.zero_grad()
    result.params = {n: _reported(p) for n, p in model.full_parameters().items()}
    return result


@contextlib.contextmanager
def watching_collectives(on_call: Callable[[str, FrameType], None]) -> Iterator[None]:
    """Calls ``on_call(name, frame)`` for each torch.distributed collective called on this thread
    while open (the outermost call of torch's public functions: a deprecated alias that calls its
    successor counts once), by a Python profile hook on this thread, which launches every
    collective. torch's profiler was the first choice; stopping it while gloo's threads still
    recorded events crashed it in CI."""
    inside: list = []

    def profile(frame, event, arg) -> None:
        code = frame.f_code
        if code.co_name not in TORCH_COLLECTIVES or code.co_filename != _C10D_FILE:
            return
        if event == "call":
            if not inside:
                on_call(code.co_name, frame)
            inside.append(frame)
        elif event == "return" and inside and inside[-1] is frame:
            inside.pop()

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)


@contextlib.contextmanager
def _collectives(setup: Setup, windows: list[Counter]) -> Iterator[None]:
    """With ``setup.count_collectives``, appends to ``windows`` the collective calls made inside."""
    if not setup.count_collectives:
        yield
        return
    counted: Counter = Counter()
    with watching_collectives(lambda name, frame: counted.update((name,))):
        yield
    windows.append(counted)


# torch.distributed's collective functions, as megatron_fsdp calls them.
TORCH_COLLECTIVES = frozenset((
    "all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single", "all_gather_single",
    "all_gather_into_tensor", "broadcast", "all_gather",
))
_C10D_FILE = torch.distributed.distributed_c10d.__file__
# What reduces gradients: reduce-scatter, all-reduce, and the all-to-all of a promoting reduction.
GRADIENT_REDUCTIONS = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


def expected_reductions(setup: Setup) -> list[int]:
    """The gradient reductions of each window of a step (its micro-batches, then
    finish_grad_sync) by docs/sharding_strategies.md's accumulation table: a micro-batch that
    holds back (inside no_sync, or auto-sync off) reduce-scatters each bucket under strategies
    2/3 and communicates nothing under 0/1; the first sync reduces what 0/1 held; an outer (HSDP)
    group averages each bucket once per sync."""
    outer = 1 if setup.hsdp is not None else 0  # the outer group's reduction of each bucket per sync
    shards_grads = megatron_fsdp.ShardingStrategy.parse(setup.strategy).shards_grads
    held = [not setup.sync_each_microbatch or (setup.no_sync_until_last and micro < setup.accum - 1)
            for micro in range(setup.accum)]
    windows = [(1 if shards_grads or not h else 0) + (0 if h else outer) for h in held]
    windows.append((0 if shards_grads or not held[-1] else 1) + (outer if held[-1] else 0))
    return windows


def check_collectives(got: Result, setup: Setup, label: str) -> None:
    """Every step launched the gradient reductions expected_reductions says, per window and
    bucket, and a micro-batch that holds back under strategies 0/1 launched no collective."""
    expected = [count * got.trainable_buckets for count in expected_reductions(setup)]
    held_quiet = not megatron_fsdp.ShardingStrategy.parse(setup.strategy).shards_grads
    for step, windows in enumerate(got.collectives):
        counted = [sum(window[name] for name in GRADIENT_REDUCTIONS) for window in windows]
        assert counted == expected, (
            f"{label} step {step}: gradient reductions per micro-batch and sync {counted}, expected {expected} "
            f"({got.trainable_buckets} buckets); all collectives: {[dict(w) for w in windows]}"
        )
        for micro, window in enumerate(windows[:-1]):
            if held_quiet and expected[micro] == 0:
                assert not window, f"{label} step {step} micro-batch {micro} held back but launched {dict(window)}"


def _torch_norm(total: torch.Tensor) -> float:
    """torch's clip returns a replicated DTensor for DTensor gradients."""
    return (total.full_tensor() if isinstance(total, DTensor) else total).item()


def _clip(model: megatron_fsdp.MegatronFSDP, way: str, result: Result) -> None:
    if way == "torch":
        result.other_norms.append(megatron_fsdp.total_grad_norm(model).item())
        result.norms.append(_torch_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
    else:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        result.other_norms.append(_torch_norm(torch.nn.utils.get_total_norm(grads)))
        result.norms.append(megatron_fsdp.clip_grad_norm_(model, MAX_NORM).item())


def stepped_by_kernels(dtypes: megatron_fsdp.mixed_precision.ResolvedDtypes) -> bool:
    """Main gradients of a lower dtype than fp32 main params: megatron_fsdp's C++ ops step the
    optimizers these tests use (Adam, AdamW, SGD), reading the main gradients as they are."""
    return dtypes.grads_below_main_params and dtypes.main_params == torch.float32


def _clip_exactly(grads: list[torch.Tensor]) -> float:
    """torch's clip_grad_norm_ with the norm summed in float64 and the fp32 factor applied in
    fp32: the single-process clip at the precision megatron_fsdp computes it (torch's own
    computes the norm of bf16 gradients in bf16)."""
    total = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt().float()
    torch._foreach_mul_(grads, torch.clamp(MAX_NORM / (total + 1e-6), max=1.0))
    return total.item()


def emulated_reference_run(setup: Setup, world: int, device: str = "cpu") -> Result:
    """One process doing the sharded run's arithmetic with setup.policy: every rank's
    micro-batch gradient computed separately, accumulated and cast as the buckets do, summed
    across ranks in rank order in the main-gradient dtype when communication is less precise
    (the all-to-all + promoting_reduce path), else summed in the communication dtype, averaged
    and added into main gradients, stepped in the main-parameter dtype and cast back."""
    dtypes = setup.policy.resolve(setup.dtype)
    strategy = megatron_fsdp.ShardingStrategy.parse(setup.strategy)
    model = setup.build_model().to(device)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    master = {n: p.detach().to(dtypes.main_params).clone() for n, p in trainable}
    optimizer = build_optimizer(list(master.values()), setup.optimizer)
    result = Result()

    no_shard = strategy is megatron_fsdp.ShardingStrategy.NO_SHARD
    scale = torch.tensor(1.0 / world, dtype=torch.float32, device=device)

    def reduce_into(main: torch.Tensor, per_rank: list[torch.Tensor]) -> None:
        """One bucket reduction of every rank's gradient, added into the main gradient."""
        comm = [g.to(dtypes.comm) for g in per_rank]
        if dtypes.promotes_reduction:
            # promoting_reduce sums in fp32, or in fp64 where the main gradients are fp64.
            acc = torch.float64 if dtypes.main_grads == torch.float64 else torch.float32
            total = comm[0].to(acc)
            for g in comm[1:]:
                total = total + g.to(acc)
            if no_shard:  # the averaged shards are gathered in the communication dtype
                main.add_((total * scale).to(dtypes.main_grads).to(dtypes.comm))
            else:
                main.copy_((total * scale + main.to(acc)).to(main.dtype))
            return
        total = comm[0].clone()
        for g in comm[1:]:
            total += g
        main.add_(total, alpha=1.0 / world)

    for step in range(setup.steps):
        tokens, targets = _rows(setup, world, step)
        main_grads = {n: torch.zeros_like(p, dtype=dtypes.main_grads) for n, p in trainable}
        # The un-reduced buffers: one micro-batch in the communication dtype (strategies 2/3),
        # or accumulated locally in the main-gradient dtype (0/1).
        local_dtype = dtypes.comm if strategy.shards_grads else dtypes.main_grads
        local = {n: [torch.zeros_like(p, dtype=local_dtype) for _ in range(world)] for n, p in trainable}
        total_loss = 0.0
        for micro in range(setup.accum):
            for rank in range(world):
                start = (micro * world + rank) * setup.micro_rows
                rows = slice(start, start + setup.micro_rows)
                loss = model(tokens[rows].to(device), targets[rows].to(device))
                (loss / setup.accum).backward()
                total_loss += loss.item()
                for name, param in trainable:
                    local[name][rank].add_(param.grad)
                    param.grad = None
            deferred = setup.no_sync_until_last and micro < setup.accum - 1 and not strategy.shards_grads
            if not deferred:
                for name, _ in trainable:
                    reduce_into(main_grads[name], local[name])
                    local[name] = [torch.zeros_like(g) for g in local[name]]
        result.losses.append(total_loss / (world * setup.accum))
        reads_main_grads = stepped_by_kernels(dtypes)
        if setup.clip is not None and reads_main_grads:  # the clip scales the main gradients themselves
            result.norms.append(_clip_exactly(list(main_grads.values())))
        if step == setup.steps - 1:
            result.grads = {n: g.cpu() for n, g in main_grads.items()}
        for name, _ in trainable:
            master[name].grad = main_grads[name].to(dtypes.main_params)
        if setup.clip is not None and not reads_main_grads:  # it scales the copy the optimizer reads
            result.norms.append(_clip_exactly([m.grad for m in master.values()]))
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for name, param in trainable:
                param.copy_(master[name])
    result.params = {n: _reported(master[n] if n in master else p) for n, p in model.named_parameters()}
    return result


def compare_emulated(got: Result, expected: Result, setup: Setup, world: int, label: str) -> None:
    """Against emulated_reference_run. The all-to-all + promoting_reduce path sums in a fixed
    rank order, so the reference reproduces it bit for bit, as it does every path on 2 ranks
    (a + b has one rounding). A same-precision reduction on more ranks sums in the backend's
    own order: losses and gradients then agree within 3 unit roundoffs of the communication
    dtype per reduction (2e-2 for bf16, 2e-5 for fp32); Adam turns such differences in
    near-zero gradients into updates of up to lr per step with either sign, so parameters
    agree within 2 * lr * steps (SGD: the gradient tolerance times lr, summed over steps)."""
    dtypes = setup.policy.resolve(setup.dtype)
    exact = dtypes.promotes_reduction or world == 2
    rtol = 0.0 if exact else (2e-2 if dtypes.comm == torch.bfloat16 else 2e-5)
    param_atol = 0.0 if exact else 2 * ADAM_LR * setup.steps
    if setup.clip is not None:
        # The clip's norm sums in another order than the reference's: fp32 rounding, 1e-7
        # relative. Scaling every gradient by a factor that much off moves gradients by as much
        # and an Adam update only through eps (1e-8 against gradients of 1e-3): far below 1e-6.
        # A norm is as close as the gradients it sums (rtol when reductions sum in another order).
        for step, (a, b) in enumerate(zip(got.norms, expected.norms)):
            assert abs(a - b) <= max(rtol, 1e-6) * b, f"{label}: gradient norm at step {step}: {a} vs reference {b}"
        assert len(got.norms) == len(expected.norms) == setup.steps, f"{label}: not every step was clipped"
        rtol, param_atol = max(rtol, 1e-6), max(param_atol, 1e-6)
    for step, (a, b) in enumerate(zip(got.losses, expected.losses)):
        assert abs(a - b) <= rtol * abs(b), f"{label}: loss at step {step}: {a} vs {b}"
    for key, value in expected.grads.items():
        assert got.grads[key].dtype == value.dtype, f"{label}: gradient {key} is {got.grads[key].dtype}, expected {value.dtype}"
        err = max_relative_error(got.grads[key], value)
        assert err <= rtol, f"{label}: gradient {key}: relative error {err:.2e} > {rtol}"
    # The C++ ops round like torch's update up to one fp32 unit roundoff of the parameter per
    # step (measured: 4e-9 after 3 Adam steps).
    kernel_steps = stepped_by_kernels(dtypes)
    for key, value in expected.params.items():
        err = (got.params[key] - value).abs().max().item()
        bound = param_atol + (setup.steps * torch.finfo(torch.float32).eps * value.abs().max().item() if kernel_steps else 0.0)
        assert err <= bound, f"{label}: parameter {key}: max error {err:.2e} > {bound:.2e}"


def _local_values(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's values on this rank (what megatron_fsdp's full_* methods report), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def train_whole_batches(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, rows: int) -> Result:
    """A reference run without FSDP: each step one backward on ``rows`` rows (the global batch)."""
    result = Result()
    for step in range(steps):
        loss = model(*make_batch(step, rows))
        loss.backward()
        result.losses.append(loss.item())
        if step == steps - 1:
            result.grads = {n: _local_values(p.grad).clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    result.params = {n: _local_values(p).detach().clone() for n, p in model.named_parameters()}
    return result


def train_data_parallel(
    model: megatron_fsdp.MegatronFSDP,
    optimizer: torch.optim.Optimizer,
    steps: int,
    accum: int,
    micro_rows: int,
    dp_rank: int,
    dp_size: int,
    dp_group: dist.ProcessGroup | None = None,
) -> Result:
    """The sharded counterpart of :func:`train_whole_batches`: this data-parallel rank's rows of
    the same global batches, split into ``accum`` micro-batches; losses averaged over ranks."""
    result = Result()
    for step in range(steps):
        tokens, targets = make_batch(step, dp_size * accum * micro_rows)
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(accum):
            start = (micro * dp_size + dp_rank) * micro_rows
            loss = model(tokens[start : start + micro_rows], targets[start : start + micro_rows])
            (loss / accum).backward()
            total += loss.detach().double()
        dist.all_reduce(total, group=dp_group)
        result.losses.append(total.item() / (dp_size * accum))
        model.finish_grad_sync()
        if step == steps - 1:
            result.grads = model.full_gradients()
        optimizer.step()
        optimizer.zero_grad()
    result.params = model.full_parameters()
    return result


def sharded_runs(rank: int, world: int, setups: list[Setup], device: str = "cpu") -> list[Result]:
    return [sharded_run(rank, world, setup, device) for setup in setups]


def max_relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest error relative to the tensor's largest magnitude (elementwise relative error is
    meaningless for entries that are zero up to rounding)."""
    scale = expected.double().abs().max().clamp_min(1e-30)
    return ((got.double() - expected.double()).abs().max() / scale).item()


def run_differences(ours: dict, theirs: dict, what: str, rtol: float, keys: tuple[str, ...] = ("losses", "params")) -> list[str]:
    """What differs between two runs' results beyond ``rtol`` (:func:`max_relative_error`): under
    each of ``keys`` one tensor (the losses), or a dict of named tensors (parameters, gradients)."""
    problems = []
    for key in keys:
        expected = theirs[key]
        named = expected.items() if isinstance(expected, dict) else [(None, expected)]
        for name, want in named:
            got = ours[key][name] if name is not None else ours[key]
            if (error := max_relative_error(got, want)) > rtol:
                label = f"{key} {name}" if name is not None else key
                problems.append(f"{what}: {label} differs by {error:.2e} relative ({got.flatten()[:4].tolist()} vs {want.flatten()[:4].tolist()})")
    return problems


def compare(got: Result, expected: Result, loss_rtol: float, grad_rtol: float, param_rtol: float, label: str) -> None:
    for step, (a, b) in enumerate(zip(got.losses, expected.losses)):
        assert abs(a - b) <= loss_rtol * abs(b), f"{label}: loss at step {step}: {a} vs reference {b}"
    assert len(got.norms) == len(expected.norms), f"{label}: {len(got.norms)} clipped steps, reference {len(expected.norms)}"
    for step, (a, b) in enumerate(zip(got.norms, expected.norms)):
        assert abs(a - b) <= loss_rtol * abs(b), f"{label}: gradient norm at step {step}: {a} vs reference {b}"
    # The two ways to clip see the same gradients: they agree to fp32 rounding of a norm (a few
    # 1e-7 relative; 1e-6 leaves room for summation order).
    for step, (a, b) in enumerate(zip(got.norms, got.other_norms)):
        assert abs(a - b) <= 1e-6 * abs(b), f"{label}: step {step}: the clip's norm {a} vs the other way's {b}"
    assert got.grads.keys() == expected.grads.keys(), f"{label}: gradient names differ"
    for name, grad in expected.grads.items():
        err = max_relative_error(got.grads[name], grad)
        assert err <= grad_rtol, f"{label}: gradient of {name}: relative error {err:.2e} > {grad_rtol:.0e}"
    assert got.params.keys() == expected.params.keys(), f"{label}: parameter names differ"
    for name, param in expected.params.items():
        err = max_relative_error(got.params[name], param)
        assert err <= param_rtol, f"{label}: parameter {name}: relative error {err:.2e} > {param_rtol:.0e}"


def _distances(run: Result, exact: Result) -> dict[str, float]:
    distances = {f"loss {i}": abs(a - b) / abs(b) for i, (a, b) in enumerate(zip(run.losses, exact.losses))}
    distances.update({f"grad {n}": max_relative_error(run.grads[n].float(), g.float()) for n, g in exact.grads.items()})
    distances.update({f"param {n}": max_relative_error(run.params[n], p) for n, p in exact.params.items()})
    return distances


LOSS_ROUNDINGS = 2


def compare_low_precision(got: Result, reference: Result, exact: Result, label: str, slack: float = 2.0) -> None:
    """Low-precision runs cannot match each other to a fixed tolerance: the rounding of every
    activation depends on batch shapes. So, for each of losses, gradients and parameters, the
    sharded run's largest distance to the exact (fp32-compute) run must be within ``slack``
    times the single-process low-precision reference's. Both are the same kind of rounding
    process, so their worst distances differ by a small factor (about 1x measured); a sharding
    bug (a wrong shard, a missing scale, a gradient counted twice) moves values by O(1).

    The losses are one scalar a step, not a maximum over thousands of elements, so the ratio of
    two runs' worst loss distances does not settle near 1: with one CPU thread instead of
    torch's default, the summation order changes and it measured 2.6 (6.4e-3 against 2.5e-3).
    Their bound is therefore at least ``LOSS_ROUNDINGS`` unit roundoffs of the reference's
    gradient dtype (2^-8 for bf16), relative: the size of a rounding at the loss's own
    magnitude. A sharding bug shows in the gradients and parameters, whose bound has no floor."""
    ours, theirs = _distances(got, exact), _distances(reference, exact)
    assert ours.keys() == theirs.keys(), f"{label}: names differ"
    unit_roundoff = torch.finfo(next(iter(reference.grads.values())).dtype).eps / 2
    for kind in ("loss", "grad", "param"):
        worst_ours = max(v for k, v in ours.items() if k.startswith(kind))
        worst_theirs = max(v for k, v in theirs.items() if k.startswith(kind))
        bound = max(slack * worst_theirs, LOSS_ROUNDINGS * unit_roundoff if kind == "loss" else 0.0)
        assert worst_ours <= bound, (
            f"{label}: worst {kind} distance to fp32 {worst_ours:.2e} > {bound:.2e} "
            f"({slack} x the low-precision reference's {worst_theirs:.2e})"
        )
