"""What megatron-core does around a model on megatron_fsdp, for tests without megatron-core:
its tensor- and sequence-parallel regions (autograd functions over a group), its gradient clip
for Megatron-FSDP, and the fsdp_dtensor state it saves and loads through DCP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import megatron_fsdp
from megatron_fsdp import uneven_dtensor
from megatron_fsdp.integrations.mcore_fsdp import MegatronCoreFSDP
from megatron_fsdp.integrations.mcore_gated_fc1 import split_gated_linear_fc1


class CopyToTensorParallel(torch.autograd.Function):
    """Forward: the same input on every tensor-parallel rank; backward: the sum of their grads."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = dist.get_rank(ctx.group) * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


class GatherSequence(torch.autograd.Function):
    """Sequence parallelism's gather before a column-parallel layer: each rank's slice of the
    sequence (dim 1) to the whole; backward sums the gradients and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return GatherLastDim.forward(ctx, x.transpose(1, 2), group).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """After a row-parallel layer: the sum over the tensor-parallel ranks, this rank's slice of
    the sequence; backward gathers the slices."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[1] // dist.get_world_size(group)
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=1), None


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    total = x.clone()
    dist.all_reduce(total, group=group)  # gloo has no reduce-scatter
    return total.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


def finalize_model_grads(adapter: nn.Module, tp_group: dist.ProcessGroup) -> None:
    """megatron-core's finalize_model_grads for Megatron-FSDP: the gradient sync, then the partial
    gradients of parameters marked ``sequence_parallel`` (each rank saw its slice of the sequence)
    summed over the tensor-parallel group in place, through the faces' local gradients (flattened
    into one all-reduce, as it does)."""
    adapter.module.finish_grad_sync()
    grads = [p.grad._local_tensor.data for p in adapter.parameters() if getattr(p, "sequence_parallel", False)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(summed.view_as(grad))


def megatron_core_clip(
    optimizer: torch.optim.Optimizer, max_norm: float, tp_group: dist.ProcessGroup | None = None,
    instance_group: dist.ProcessGroup | None = None,
) -> float:
    """megatron-core's clip for Megatron-FSDP: local gradients, each tensor-parallel block once
    and each duplicated parameter from tensor-parallel rank 0 only (without ``tp_group``: every
    parameter), a pipeline stage's copy of a weight tied across stages (``shared``) left out,
    one all-reduce of the squares, within one distributed-optimizer instance under HSDP
    (``instance_group``; without it, every rank)."""
    first_tp_rank = tp_group is None or dist.get_rank(tp_group) == 0
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    assert all(getattr(p, "__fsdp_param__", False) for p in params), "megatron-core clips Megatron-FSDP's faces"
    counted = [p for p in params if not getattr(p, "shared", False)]
    grads = [p.grad._local_tensor for p in counted if getattr(p, "tensor_model_parallel", False) or first_tp_rank]
    total = torch.stack([g.double().pow(2).sum() for g in grads]).sum()
    dist.all_reduce(total, group=instance_group)
    norm = total.sqrt().item()
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1:
        for p in params:
            p.grad._local_tensor.mul_(coefficient)
    return norm


def _same(name: str) -> str:
    return name


def fsdp_dtensor_state(
    adapter: nn.Module, optimizer: torch.optim.Optimizer, key: Callable[[str], str] = _same, gated: bool = False
) -> dict:
    """The fsdp_dtensor checkpoint as Megatron-LM writes it: the wrapped model's state dict and
    the optimizer state keyed by parameter name, with ``gated`` (``--swiglu``) each gated
    ``linear_fc1`` entry split into its ``_w`` and ``_v`` halves by the splitter ``install()`` puts
    in megatron-core, then each key passed through ``key`` (Megatron-LM renames local experts to
    their global index). The values are the model's and optimizer's own tensors (or views of
    them), so ``dcp.load`` into it loads them in place. An optimizer over several chunks
    (megatron-core's virtual pipeline stages) gives each chunk's state its own parameters'."""
    names = {p: n for n, p in adapter.named_parameters()}
    model_state = adapter.module.state_dict()
    optimizer_state = {"state": {names[p]: s for p, s in optimizer.state.items() if p in names}}
    if gated:
        model_state, optimizer_state = split_gated_linear_fc1(adapter, model_state, optimizer_state)
    state = {"model": model_state, "optimizer": optimizer_state}
    return _renamed(uneven_dtensor.preprocess_state_dict_for_uneven_dtensor(state), key)


def fsdp_dtensor_chunks_state(adapters: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict:
    """A rank's model chunks (megatron-core's virtual pipeline stages, one optimizer over all)
    in one checkpoint: chunk ``i``'s :func:`fsdp_dtensor_state` under ``chunk<i>``."""
    return {f"chunk{i}": fsdp_dtensor_state(adapter, optimizer) for i, adapter in enumerate(adapters)}


def load_fsdp_dtensor(
    adapter: nn.Module | list[nn.Module], optimizer: torch.optim.Optimizer, checkpoint_dir: str,
    key: Callable[[str], str] = _same, gated: bool = False,
) -> None:
    """As Megatron-LM loads fsdp_dtensor into fresh objects: a zero-gradient step materialises
    the optimizer state, DCP fills the (split and renamed) state's tensors in place, then the
    model loads its own state dict, taken before, under its own names, which megatron-core's
    adapter prefixes once more. A list of adapters: a rank's chunks, saved by
    :func:`fsdp_dtensor_chunks_state`."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()
    adapters = adapter if isinstance(adapter, list) else [adapter]
    raw = [a.module.state_dict() for a in adapters]
    prepared = [fsdp_dtensor_state(a, optimizer, key, gated) for a in adapters]
    chunks = {f"chunk{i}": state for i, state in enumerate(prepared)}
    dcp.load(chunks if isinstance(adapter, list) else prepared[0], checkpoint_id=checkpoint_dir)
    for a, state in zip(adapters, raw):
        a.module.load_state_dict({"module." + k: v for k, v in state.items()})


def fc1_at_save(state: dict, key: Callable[[str], str], row: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """From a wrapper's state dict: each ``linear_fc1`` weight and bias whole (under ``key`` of its
    name), and where in a row of ``row`` elements this rank's flat piece of each weight starts
    (0 for a piece that starts a row, or a whole tensor)."""
    fc1 = {k: v for k, v in state.items() if ".linear_fc1." in k}
    # A copy: a whole replicated piece's full_tensor() is the live weight itself.
    whole = {key(k.removeprefix("module.")): v.full_tensor().clone() for k, v in fc1.items()}
    starts = []
    for value in fc1.values():
        layout = getattr(value, "_flat_layout", None)
        if value.dim() == 2:
            starts.append(layout.mine(value.device_mesh)[0] % row if layout is not None else 0)
    return whole, starts


def assert_saved_as_gated_halves(checkpoint_dir: str, saved_fc1: dict[str, torch.Tensor]) -> None:
    """The checkpoint holds each gated ``linear_fc1`` tensor (``saved_fc1``: whole, as the state
    dict showed it at the save) as Megatron-LM's ``_w`` (gate rows) and ``_v`` (up rows), bit for bit."""
    halves = gated_halves_saved(checkpoint_dir)
    assert halves.keys() == {k + suffix for k in saved_fc1 for suffix in ("_w", "_v")}, sorted(halves)
    for name, whole in saved_fc1.items():
        gate, up = whole.chunk(2)
        assert torch.equal(halves[name + "_w"], gate) and torch.equal(halves[name + "_v"], up), name


def gated_halves_saved(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """Every ``_w``/``_v`` model tensor of an fsdp_dtensor checkpoint, whole, read in this one
    process (``model.`` and the wrapper's ``module.`` taken off the keys)."""
    metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    wanted = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in metadata.items()
        if name.startswith("model.") and name.endswith(("_w", "_v"))
    }
    dcp.load(wanted, checkpoint_id=checkpoint_dir, no_dist=True)
    return {name.removeprefix("model.").removeprefix("module."): value for name, value in wanted.items()}


def _renamed(state: dict, key: Callable[[str], str]) -> dict:
    return {
        "model": {key(k): v for k, v in state["model"].items()},
        "optimizer": {"state": {key(k): v for k, v in state["optimizer"]["state"].items()}},
    }


def tensor_parallel_block(full: torch.Tensor, param: nn.Parameter, size: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``rank`` of ``size``'s part of the whole ``full``, as megatron-core
    splits a master weight marked ``partition_dim``/``partition_stride``: into ``stride * size``
    equal blocks along that dim, the rank taking blocks ``rank, rank + size, ...``."""
    blocks = full.chunk(param.partition_stride * size, dim=param.partition_dim)
    return torch.cat(blocks[rank::size], dim=param.partition_dim)


def strided_split_refusal(model: nn.Module, index: megatron_fsdp.FSDPDistributedIndex, unit: type) -> str:
    """What wrapping ``model`` (one weight given ``partition_stride`` 2) raises, as megatron-core
    wraps it; "no error" if the wrap takes it."""
    try:
        MegatronCoreFSDP(model, index, megatron_fsdp.DistributedDataParallelConfig(), fsdp_unit_modules=[unit])
    except ValueError as error:
        return str(error)
    return "no error"


def one_process_run(
    model: nn.Module, optimizer: torch.optim.Optimizer, make_batch: Callable[[int], tuple], steps: int, max_norm: float = 0.5
) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """The reference: ``steps`` steps of ``model`` on each whole batch in one process, torch's clip
    at ``max_norm``; each step's loss and norm, and the parameters after the last."""
    history = []
    for step in range(steps):
        loss = model(*make_batch(step))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        optimizer.step()
        optimizer.zero_grad()
        history.append((loss.item(), norm))
    return history, {n: p.detach() for n, p in model.named_parameters()}
