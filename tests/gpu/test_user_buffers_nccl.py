"""nccl_ub: after the first optimizer step the pool's persistent buckets live in memory from
NCCL's allocator (ncclMemAlloc), registered with every communicator that carries them, and
training is bit-for-bit the run with fsdp_double_buffer alone (registration changes where
buckets live, never the arithmetic). NCCL, 2 GPUs; on one GPU, where no collective reaches
NCCL, nccl_ub falls back to double buffers with one log line."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

import megatron_fsdp
from _dist import free_port, nccl_world, run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="registration needs a group of two ranks: over one rank no collective reaches NCCL"
)
EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, EXAMPLES)
from gpt_model import GPT, GPTConfig, TransformerBlock  # noqa: E402

STEPS = 4


def _in_segments(address: int, segments: list[dict]) -> bool:
    return any(s["address"] <= address < s["address"] + s["total_size"] for s in segments)


class _Registrations(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "nccl_ub registered" in record.getMessage()


def _hsdp_mesh(world: int) -> DeviceMesh:
    """(dp_outer=1, dp_shard=world) over groups of their own: a mesh from init_device_mesh would
    reuse the default group for every dim spanning the whole world, one communicator for both."""
    outer, _ = dist.new_subgroups(group_size=1)
    shard = dist.new_group(list(range(world)))
    return DeviceMesh.from_group(
        [outer, shard], "cuda", mesh=torch.arange(world).view(1, world), mesh_dim_names=("dp_outer", "dp_shard")
    )


def _train(rank: int, world: int, strategy: int, comm: torch.dtype, nccl_ub: bool, hsdp: bool = False) -> dict:
    """With ``hsdp``: a (dp_outer=1, dp_shard=world) mesh, so buckets travel over two
    communicators, and communication switches from ``comm`` to bf16 after two steps, which
    adds buckets (the all-to-all's) that must be moved and registered after that step."""
    torch.manual_seed(0)
    registrations = _Registrations()
    logging.getLogger("megatron_fsdp").addHandler(registrations)
    logging.getLogger("megatron_fsdp").setLevel(logging.INFO)
    config = GPTConfig(vocab_size=1024, seq_len=128, layers=4, hidden=256, heads=4, ffn=704)
    model = GPT(config).cuda().to(torch.bfloat16)
    policy = megatron_fsdp.MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=comm)
    mesh = dict(device_mesh=_hsdp_mesh(world), dp_shard_dim="dp_shard", dp_outer_dim="dp_outer") if hsdp else {}
    model, optimizer = megatron_fsdp.fully_shard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), fsdp_unit_modules=[TransformerBlock],
        zero_dp_strategy=strategy, mixed_precision_policy=policy, fsdp_double_buffer=True, nccl_ub=nccl_ub, **mesh,
    )
    block = next(m for m in model.module.modules() if isinstance(m, TransformerBlock))
    gathered_at: list[int] = []
    # Registered after fully_shard's own pre-hook: sees the block's gathered weights.
    block.register_forward_pre_hook(lambda module, args: gathered_at.append(next(module.parameters()).data_ptr()))
    losses, reserved, segments_per_step = [], [], []
    generator = torch.Generator(device="cuda").manual_seed(rank)
    for step in range(STEPS):
        if hsdp and step == 2:
            model.mixed_precision_policy = dataclasses.replace(policy, grad_comm_dtype=torch.bfloat16)
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1), device="cuda", generator=generator)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        reserved.append(model.pool.bytes_reserved())
        if nccl_ub and model.user_buffers is not None:
            segments_per_step.append(model.user_buffers.mem_pool.snapshot())
    result = dict(losses=losses, reserved=reserved, params={n: p.cpu() for n, p in model.full_parameters().items()})
    if nccl_ub and model.user_buffers is None:
        result.update(registered=False)
    elif nccl_ub:
        segments = segments_per_step[-1]
        result.update(
            registered=model.user_buffers.registered,
            registrations=registrations.count,
            communicators=len(model.user_buffers.backends),
            nccl_memory=model.user_buffers.uses_nccl_memory,
            segment_bytes=[sum(s["total_size"] for s in step) for step in segments_per_step],
            weights_in_nccl_memory=[_in_segments(address, segments) for address in gathered_at],
        )
    return result


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="the one-GPU case")
def test_on_one_gpu_nccl_ub_has_nothing_to_register_and_trains_like_double_buffer() -> None:
    plain = run_distributed(_train, 1, 3, torch.float32, False, backend="nccl")[0]
    fallback = run_distributed(_train, 1, 3, torch.float32, True, backend="nccl")[0]
    assert not fallback["registered"]
    assert fallback["losses"] == plain["losses"] and fallback["reserved"] == plain["reserved"]
    for name, value in plain["params"].items():
        assert torch.equal(fallback["params"][name], value), name


@needs_two_gpus
@pytest.mark.parametrize("strategy,comm", [(3, torch.float32), (3, torch.bfloat16), (2, torch.float32)])
def test_nccl_ub_registers_the_buckets_and_trains_exactly_like_double_buffer(strategy: int, comm: torch.dtype) -> None:
    world = nccl_world()
    plain = run_distributed(_train, world, strategy, comm, False, backend="nccl")
    registered = run_distributed(_train, world, strategy, comm, True, backend="nccl")
    for rank, (reference, result) in enumerate(zip(plain, registered)):
        assert result["registered"], f"rank {rank}: the pool was never registered with NCCL"
        assert result["nccl_memory"], "NCCL 2.19+ is loaded: the buckets must come from ncclMemAlloc"
        assert result["losses"] == reference["losses"], f"rank {rank}: losses differ"
        for name, value in reference["params"].items():
            assert torch.equal(result["params"][name], value), f"rank {rank}: {name} differs after {STEPS} steps"
        assert result["reserved"] == reference["reserved"], "moving into NCCL memory must not change the pool's size"
        assert len(set(result["segment_bytes"])) == 1, f"NCCL memory grew after the first step: {result['segment_bytes']}"
        assert result["segment_bytes"][0] >= result["reserved"][0], "every pool block must fit in NCCL memory"
        if strategy == 3:  # weights are pooled buckets only under optim_grads_params
            in_nccl = result["weights_in_nccl_memory"]
            assert not in_nccl[0] and all(in_nccl[1:]), f"gathered weights in NCCL memory, per step: {in_nccl}"


@needs_two_gpus
def test_nccl_ub_registers_with_every_group_and_again_when_a_step_adds_buckets() -> None:
    world = nccl_world()
    plain = run_distributed(_train, world, 3, torch.float32, False, True, backend="nccl")
    registered = run_distributed(_train, world, 3, torch.float32, True, True, backend="nccl")
    for rank, (reference, result) in enumerate(zip(plain, registered)):
        assert result["communicators"] == 2, "dp_shard and dp_outer each carry buckets"
        assert result["registrations"] == 2, "after step 1, and after the step that first sent bf16 gradients"
        assert result["losses"] == reference["losses"], f"rank {rank}: losses differ"
        for name, value in reference["params"].items():
            assert torch.equal(result["params"][name], value), f"rank {rank}: {name} differs after {STEPS} steps"
        after_switch = result["segment_bytes"][2:]
        assert len(set(after_switch)) == 1, f"NCCL memory grew after the step that added buckets: {after_switch}"


_TRAIN_THEN_DESTROY = """
import os
import torch, torch.distributed as dist, torch.nn.functional as F
import megatron_fsdp
from gpt_model import GPT, GPTConfig, TransformerBlock
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
config = GPTConfig(vocab_size=256, seq_len=64, layers=2, hidden=128, heads=2, ffn=352)
model = GPT(config).cuda().to(torch.bfloat16)
model, optimizer = megatron_fsdp.fully_shard(
    model, torch.optim.AdamW(model.parameters()), fsdp_unit_modules=[TransformerBlock], nccl_ub=True
)
for _ in range(2):
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1), device="cuda")
    F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
assert model.user_buffers.registered
dist.destroy_process_group()
print("trained")
"""


@needs_two_gpus
def test_a_process_that_destroys_its_process_group_first_still_exits_cleanly(tmp_path) -> None:
    # The registered pool outlives the communicators here: freeing it then would abort.
    script = tmp_path / "train_then_destroy.py"
    script.write_text(_TRAIN_THEN_DESTROY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([EXAMPLES, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr[-3000:]
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
