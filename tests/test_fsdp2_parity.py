"""megatron_fsdp.fsdp2.fully_shard against torch's own FSDP2 and a single process: the same
TinyGPT (tied head, parameters straddling shard boundaries), sharded per block and then the root,
a plain torch AdamW built after sharding, the same data and seed, gloo world 2 (HSDP: world 4,
2 replicas x 2 shards).

Tolerances (fp32, relative to each tensor's largest entry). Against FSDP2: 1e-6. Both run the
same forward and backward on the same full weights and reduce-scatter the same sums; measured:
bit-identical without accumulation (also with bf16 compute and fp32 reduction), about 1e-7 with
no-sync accumulation and clipping (the accumulation order differs); under HSDP with the replicas'
all-reduce held back until the last micro-batch (set_requires_all_reduce), 0: bit-identical. Against one process: 1e-5, as tests/test_parity.py: it sums all rows
at once instead of per rank, and 4 AdamW steps amplify that to 1.5e-6 (FSDP2 measures the same
1.5e-6). A wrong shard, a missing average or a gradient counted twice is O(1).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from _dist import run_distributed
from models import make_batch, make_model

STEPS, ROWS, LR = 4, 2, 1e-2
RTOL = 1e-6
SINGLE_PROCESS_RTOL = 1e-5


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _train(
    fully_shard, rank: int, world: int, accumulate: int = 1, clip: bool = False, loop_variants: bool = False,
    all_reduce_last: bool = False, **model_options,
) -> dict:
    """Losses, gradient norms and full parameters after STEPS AdamW steps; with ``accumulate``
    micro-batches per step, the first ones with gradient sync off (``all_reduce_last``: with
    gradient sync on but HSDP's all-reduce off, ``set_requires_all_reduce``). ``loop_variants``: every
    micro-batch synchronises (the reduced gradients accumulate), the gradients are cleared in
    turn by ``optimizer.zero_grad(set_to_none=False)``, ``model.zero_grad()``, setting two
    parameters' ``.grad`` to None (the others accumulate into the next step) and
    ``optimizer.zero_grad()``, and an inference forward follows each step."""
    model = make_model(seed=0, **model_options)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    some = list(model.blocks[0].parameters())[:2]
    clear_grads = [
        lambda: optimizer.zero_grad(set_to_none=False),
        model.zero_grad,
        lambda: [setattr(param, "grad", None) for param in some],  # the rest accumulate on
        optimizer.zero_grad,
    ]
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(accumulate):
            if all_reduce_last:
                model.set_requires_all_reduce(micro == accumulate - 1)
            else:
                model.set_requires_gradient_sync(loop_variants or micro == accumulate - 1)
            tokens, targets = make_batch((step * accumulate + micro) * world + rank, ROWS)
            loss = model(tokens, targets) / accumulate
            loss.backward()
            losses.append(loss.detach())
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5).full_tensor())
        optimizer.step()
        (clear_grads[step % len(clear_grads)] if loop_variants else optimizer.zero_grad)()
        if loop_variants:
            with torch.no_grad():
                losses.append(model(*make_batch(1000 + rank, ROWS)))
    # FSDP2 leaves the root's parameters unsharded after an inference forward: plain tensors.
    params = {name: getattr(param, "full_tensor", param.detach)() for name, param in model.named_parameters()}
    return {"losses": torch.stack(losses), "norms": norms, "params": params, "model": model}


def _train_single_process(world: int) -> dict:
    model = make_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        batches = [make_batch(step * world + rank, ROWS) for rank in range(world)]
        tokens, targets = (torch.cat(parts) for parts in zip(*batches))
        model(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: param.detach() for name, param in model.named_parameters()}


def _compare(ours: dict, theirs: dict, what: str, rtol: float = RTOL) -> list[str]:
    problems = []
    error = _relative_error(ours["losses"], theirs["losses"])
    if error > rtol:
        problems.append(f"{what}: losses differ by {error:.2e} relative")
    for got, want in zip(ours["norms"], theirs["norms"]):
        if _relative_error(got, want) > rtol:
            problems.append(f"{what}: clip_grad_norm_ gave {got.item()} vs {want.item()}")
    for name, want in theirs["params"].items():
        error = _relative_error(ours["params"][name], want)
        if error > rtol:
            problems.append(f"{what}: {name} differs by {error:.2e} relative")
    return problems


# (what, fully_shard keywords, training options). bf16 compute with fp32 reduction: the same bf16
# forward and backward and fp32 sums as FSDP2, so the same 1e-6 (measured: bit-identical).
CASES = [
    ("fp32", {}, {}),
    ("fp32 no-sync accumulation, clipping", {}, {"accumulate": 2, "clip": True}),
    ("bf16 param_dtype, fp32 reduce_dtype", {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}, {}),
    ("frozen norms, untied head", {}, {"frozen": True, "tie": False}),
    # pin_memory=False: torch pins through an accelerator, which a CPU run has not.
    ("CPU offload", {"offload_policy": CPUOffloadPolicy(pin_memory=False)}, {"accumulate": 2}),
    ("every micro-batch synced, zero_grad forms, inference forwards", {}, {"accumulate": 2, "loop_variants": True}),
]


def _parity_with_fsdp2(rank: int, world: int) -> list[str]:
    from megatron_fsdp.fsdp2 import fully_shard

    problems = []
    for what, keywords, options in CASES:
        ours = _train(functools.partial(fully_shard, **keywords), rank, world, **options)
        theirs = _train(functools.partial(torch_fully_shard, **keywords), rank, world, **options)
        problems += _compare(ours, theirs, f"vs FSDP2, {what}")
        if what == "fp32":
            reference = _train_single_process(world)
            expected = {"losses": theirs["losses"], "norms": [], "params": reference}
            problems += _compare(ours, expected, "vs one process", SINGLE_PROCESS_RTOL)
    return problems


def test_training_matches_torch_fsdp2_and_single_process() -> None:
    for rank, problems in enumerate(run_distributed(_parity_with_fsdp2, 2)):
        assert not problems, f"rank {rank}: " + "; ".join(problems)


def _hsdp_parity_with_fsdp2(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_fsdp.fsdp2 import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    problems = []
    for what, options, rtol in (
        ("no-sync accumulation, clipping", {"accumulate": 2, "clip": True}, RTOL),
        # Reduce-scatters every micro-batch, one all-reduce per step: ours adds the micro-batches'
        # reduce-scatters into the main gradient, (a + b) + c, and averages that; FSDP2 adds its
        # held a + b to c and averages that: equal in IEEE arithmetic (x + y == y + x, and the
        # divisors are powers of two), so bit-identical (measured); a clip adds its norm's ~1e-7.
        ("all-reduce held back until the last micro-batch", {"accumulate": 3, "all_reduce_last": True}, 0.0),
    ):
        ours = _train(functools.partial(fully_shard, mesh=mesh), rank, world, **options)
        theirs = _train(functools.partial(torch_fully_shard, mesh=mesh), rank, world, **options)
        problems += _compare(ours, theirs, f"HSDP (2 replicas x 2 shards) vs FSDP2, {what}", rtol)
    return problems


def test_hsdp_over_a_2d_mesh_matches_torch_fsdp2() -> None:
    for rank, problems in enumerate(run_distributed(_hsdp_parity_with_fsdp2, 4)):
        assert not problems, f"rank {rank}: " + "; ".join(problems)
