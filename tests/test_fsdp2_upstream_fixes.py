"""Defects PyTorch's own FSDP2 tests (test_fully_shard_training.py, run by
scripts/fsdp2_upstream_tests.py) found in megatron_fsdp.fsdp2, each checked here on a small model of
our own against torch's ``fully_shard`` in the same ranks (gloo world 2).

Values: both run the same forward and backward on the same full fp32 weights and sum the same
gradients, so losses and gradients agree to 1e-6 relative (tests/test_fsdp2_parity.py's bound).
Collective counts (``CommDebugMode``): each ``fully_shard`` call here is one bucket per dtype, as
FSDP2's one all-gather / reduce-scatter per module, so the counts must be equal.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from _dist import run_distributed
from parity import max_relative_error, run_differences

RTOL, DIM = 1e-6, 8


def _stack(blocks: int = 3) -> nn.Sequential:
    """A root linear, then MLP blocks each to be sharded on its own."""
    torch.manual_seed(42)
    mlps = [nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM)) for _ in range(blocks)]
    return nn.Sequential(nn.Linear(DIM, DIM), *mlps)


def _collective_counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).rpartition(".")[2]: count for op, count in mode.get_comm_counts().items() if count}


# -- defect 4: gradient accumulation with sync off for some modules, root resharding ---------


def _accumulate(fully_shard, rank: int, sync_off: str, reshard_after_forward: bool, hold_after_backward: bool) -> dict:
    """Three micro-batches a step, gradient sync off on all but the last for ``sync_off``
    ('root': the root's own linear only; 'some': two of the three MLPs; 'all'); with
    ``hold_after_backward`` the same modules also stay gathered after those backwards."""
    model = _stack()
    for mlp in model[1:]:
        fully_shard(mlp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank + 1)
    losses, counts, grads = [], {}, {}
    for step in range(3):
        for micro in range(3):
            last = micro == 2
            targets = {"root": [(model, False)], "some": [(m, True) for m in model[1:3]], "all": [(model, True)]}[sync_off]
            for module, recurse in targets:
                module.set_requires_gradient_sync(last, recurse=recurse)
                if hold_after_backward:
                    module.set_reshard_after_backward(last, recurse=recurse)
            with CommDebugMode() as comms:
                loss = model(torch.randn(2, DIM, generator=generator)).sum()
                loss.backward()
            for name, count in _collective_counts(comms).items():
                counts[name] = counts.get(name, 0) + count
            losses.append(loss.detach())
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 1)
    return {"losses": torch.stack(losses), "grads": grads, "counts": counts}


def _accumulation_cases(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    problems = []
    cases = [("root", True, False), ("some", True, False), ("all", False, True), ("root", False, True)]
    for sync_off, reshard_after_forward, hold in cases:
        what = f"sync off for {sync_off}, reshard_after_forward={reshard_after_forward}, held after backward={hold}"
        ours = _accumulate(fully_shard, rank, sync_off, reshard_after_forward, hold)
        theirs = _accumulate(torch_fully_shard, rank, sync_off, reshard_after_forward, hold)
        problems += run_differences(ours, theirs, what, RTOL, keys=("losses", "grads"))
        if ours["counts"] != theirs["counts"]:
            problems.append(f"{what}: collectives {ours['counts']} vs FSDP2's {theirs['counts']}")
    return problems


def test_accumulation_with_partial_sync_and_root_resharding_matches_torch_fsdp2() -> None:
    """A root told ``reshard_after_forward=True`` gives its weights back after forward and gathers
    them again for backward, as FSDP2's; a root held gathered after backward
    (``set_reshard_after_backward(False)``) keeps every bucket gathered for the next forward."""
    for rank, problems in enumerate(run_distributed(_accumulation_cases, 2)):
        assert not problems, f"rank {rank}: {problems}"


# -- defect 1: a non-root's own forward and backward after the root's step ------------------


def _root_then_non_root(fully_shard, rank: int) -> dict:
    """A step through the root, ``zero_grad``, then a step through the first block alone: its
    gradients must start from zero (not from the root step's), the other blocks get none."""
    model = _stack()
    for mlp in model[1:]:
        fully_shard(mlp)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
    losses = [model(batch).sum()]
    losses[-1].backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(model[1](batch).sum())
    losses[-1].backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    losses.append(model(batch).sum())
    return {"losses": torch.stack(losses).detach(), "grads": grads}


def _non_root_case(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    ours, theirs = _root_then_non_root(fully_shard, rank), _root_then_non_root(torch_fully_shard, rank)
    problems = []
    if max_relative_error(ours["losses"], theirs["losses"]) > RTOL:
        problems.append(f"losses {ours['losses'].tolist()} vs {theirs['losses'].tolist()}")
    if ours["grads"].keys() != theirs["grads"].keys():
        problems.append(f"parameters with a gradient {sorted(ours['grads'])} vs {sorted(theirs['grads'])}")
    for name in ours["grads"].keys() & theirs["grads"].keys():
        if (error := max_relative_error(ours["grads"][name], theirs["grads"][name])) > RTOL:
            problems.append(f"{name}.grad differs by {error:.2e}")
    return problems


def test_non_root_forward_backward_after_root_step_matches_torch_fsdp2() -> None:
    """``optimizer.zero_grad()`` is honoured by the next step whichever module's forward starts
    it (it used to be read only at the root's forward: the block accumulated onto stale grads)."""
    for rank, problems in enumerate(run_distributed(_non_root_case, 2)):
        assert not problems, f"rank {rank}: {problems}"


# -- defect 7: a parameter that got no gradient keeps .grad None -----------------------------


class _SkippableHead(nn.Module):
    """The root's own parameters: ``gain``, used every step, and the head, skipped at times (one
    bucket, partly used)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.ones(DIM))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor, skip_head: bool) -> torch.Tensor:
        hidden = torch.relu(self.body(x)) * self.gain
        return hidden if skip_head else self.head(hidden)


def _skipping_head(fully_shard, rank: int, show_zeros: bool) -> dict:
    """Steps with the head used, skipped, then used in the first of two accumulated
    micro-batches only; AdamW with weight decay moves a parameter with a zero gradient, not one
    with None."""
    model = _SkippableHead()
    fully_shard(model.body)
    fully_shard(model)
    if show_zeros:
        model.set_reduce_scatter_unused_params(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(rank)
    with_grad, params = [], {}
    for skips in ([False], [True], [True], [False, True]):
        for micro, skip in enumerate(skips):
            model.set_requires_gradient_sync(micro == len(skips) - 1)
            model(torch.randn(4, DIM, generator=generator), skip).sum().backward()
        with_grad.append(sorted(name for name, p in model.named_parameters() if p.grad is not None))
        optimizer.step()
        optimizer.zero_grad()
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {"with_grad": with_grad, "params": params}


def _unused_cases(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    problems = []
    for show_zeros in (False, True):
        ours, theirs = _skipping_head(fully_shard, rank, show_zeros), _skipping_head(torch_fully_shard, rank, show_zeros)
        if ours["with_grad"] != theirs["with_grad"]:
            problems.append(f"show_zeros={show_zeros}: with .grad {ours['with_grad']} vs FSDP2's {theirs['with_grad']}")
        problems += run_differences(ours, theirs, f"show_zeros={show_zeros}", RTOL, keys=("params",))
    return problems


def test_unused_parameter_grad_is_none_as_torch_fsdp2() -> None:
    """FSDP2 reduce-scatters only parameters with a gradient (unless
    ``set_reduce_scatter_unused_params(True)``): an unused one keeps ``.grad`` None, which the
    optimizer skips. Ours showed zeros, so AdamW decayed the skipped head's weights."""
    for rank, problems in enumerate(run_distributed(_unused_cases, 2)):
        assert not problems, f"rank {rank}: {problems}"


# -- defect 2: unshard(async_op=True) on every module, then held gathered micro-batches --------


def _explicitly_unsharded(fully_shard, rank: int, reshard_after_backward: bool) -> dict:
    """A pipeline schedule's pattern: every module gathered ahead (``unshard(async_op=True)``),
    kept gathered (``reshard_after_forward=False``), gradients reduced on the last micro-batch
    only, optionally held gathered after the other backwards."""
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(42)
    model = nn.Sequential(nn.Embedding(32, DIM), *_stack(2)[1:], nn.Linear(DIM, 32))
    for block in model[1:3]:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.unshard(async_op=True)
    losses = []
    for micro in range(3):
        last = micro == 2
        model.set_requires_gradient_sync(last)
        if not reshard_after_backward:
            model.set_reshard_after_backward(last)
        losses.append(model(torch.randint(0, 32, (2, 5), generator=generator)).sum())
        losses[-1].backward()
    optimizer.step()
    return {"losses": torch.stack(losses).detach(), "params": {n: p.full_tensor() for n, p in model.named_parameters()}}


def _explicit_unshard_cases(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    problems = []
    for reshard_after_backward in (False, True):
        ours = _explicitly_unsharded(fully_shard, rank, reshard_after_backward)
        theirs = _explicitly_unsharded(torch_fully_shard, rank, reshard_after_backward)
        problems += run_differences(ours, theirs, f"reshard_after_backward={reshard_after_backward}", RTOL)
    return problems


def test_explicit_async_unshard_of_every_module_matches_torch_fsdp2() -> None:
    """The root held gathered after backward used to give its buckets back as their gradients
    arrived while still marked gathered: the next forward read freed weights."""
    for rank, problems in enumerate(run_distributed(_explicit_unshard_cases, 2)):
        assert not problems, f"rank {rank}: {problems}"


# -- defect 8: a parameter shared across separate fully_shard calls is refused ---------------


class _TiedAcross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, DIM)
        self.out = nn.Linear(DIM, 17, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


def _shared_across_calls(rank: int, world: int) -> list[str]:
    """Both ranks make the same calls; the error must come at the first forward (FSDP2's lazy
    init) on each, before that step's first all-gather (CommDebugMode counts none)."""
    from megatron_fsdp.fsdp2 import fully_shard

    outcomes = []
    for shard in (fully_shard, torch_fully_shard):
        model = _TiedAcross()
        shard(model.embed)
        shard(model.out)
        shard(model)
        with CommDebugMode() as comms:
            try:
                model(torch.randint(0, 17, (2, 4)))
                outcomes.append("no error")
            except ValueError as error:
                outcomes.append(str(error))
        outcomes.append(_collective_counts(comms))
    return outcomes


def test_parameter_shared_across_separate_calls_raises_as_torch_fsdp2() -> None:
    for rank, (ours, our_comms, theirs, _) in enumerate(run_distributed(_shared_across_calls, 2)):
        assert "already managed by another" in theirs, f"rank {rank}: FSDP2 said {theirs!r}"
        assert "fully_shard(Linear)" in ours and "'weight' is already managed by another fully_shard call" in ours, ours
        assert "fully_shard([a, b])" in ours, f"rank {rank}: the error names no fix: {ours!r}"
        assert not our_comms, f"rank {rank}: collectives before the error: {our_comms}"


# -- defect 6: which parameters are registered after forward ----------------------------------


def _registered_kinds(fully_shard, reshard_after_forward: bool | None, grouped: bool) -> list[list[bool]]:
    """Whether each parameter is a DTensor (sharded) after a forward, then after ``reshard()``."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 6), nn.Linear(6, 3)), nn.Linear(3, 3))
    if grouped:
        fully_shard(model[0][0], reshard_after_forward=reshard_after_forward)
        fully_shard(model[0][1], reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    model(torch.randn(2, 3))
    kinds = [[isinstance(p, DTensor) for p in model.parameters()]]
    model.reshard()
    return kinds + [[isinstance(p, DTensor) for p in model.parameters()]]


def _registration_cases(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    problems = []
    for reshard_after_forward in (True, False, None):
        for grouped in (False, True):
            ours = _registered_kinds(fully_shard, reshard_after_forward, grouped)
            theirs = _registered_kinds(torch_fully_shard, reshard_after_forward, grouped)
            if ours != theirs:
                problems.append(f"reshard_after_forward={reshard_after_forward}, grouped={grouped}: {ours} vs {theirs}")
    return problems


def test_parameters_registered_after_forward_as_torch_fsdp2() -> None:
    """A root given ``reshard_after_forward=True`` shows its sharded DTensors after forward (it
    kept the gathered plain tensors registered); False/None keep them, as FSDP2's."""
    for rank, problems in enumerate(run_distributed(_registration_cases, 2)):
        assert not problems, f"rank {rank}: {problems}"


# -- defect 5: HSDP (shard groups of one rank) with CPU offload, sync on the last micro-batch --


def _hsdp_offload(fully_shard, rank: int) -> dict:
    """Shard groups of one rank reduce in place: the main gradient is the un-reduced buffer while
    micro-batches accumulate without sync. It was sent to the host, and released at the next
    forward as if ``zero_grad`` had cleared it, before the replicas' average."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = _stack(2)
    for block in model[1:]:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(2):
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            losses.append(model(torch.randn(4, DIM, generator=generator)).sum())
            losses[-1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 0)
    return {"losses": torch.stack(losses).detach(), "params": {n: p.full_tensor() for n, p in model.named_parameters()}}


def _hsdp_offload_case(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    ours, theirs = _hsdp_offload(fully_shard, rank), _hsdp_offload(torch_fully_shard, rank)
    return run_differences(ours, theirs, "HSDP with CPU offload", RTOL)


def test_hsdp_cpu_offload_accumulation_matches_torch_fsdp2() -> None:
    for rank, problems in enumerate(run_distributed(_hsdp_offload_case, 2)):
        assert not problems, f"rank {rank}: {problems}"
