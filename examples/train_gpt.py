"""Train a small character-level GPT with megatron_fsdp.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py

Runs on CPU with gloo, or on CUDA with NCCL when GPUs are present (one per process). The corpus
is examples/data/corpus.txt (public-domain text shipped with the repo); nothing is downloaded.
Checkpoints go to --checkpoint-dir and a new launch resumes from the newest intact one (one
that fails verification is skipped and set aside); a finished run writes the loss curve there
(loss_curve.png) and logs a sample of generated text. Other options:
--strategy, --dp-outer / --outer-strategy (HSDP, HFSDP), --bf16 / --main-grads-dtype /
--grad-comm-dtype (mixed precision), --grad-accum (micro-batches per step).

Launched with ``torchrun --max-restarts N``, a job one of whose ranks dies restarts and resumes
from its last complete checkpoint, ending with the parameters an uninterrupted run would have
(batches and randomness depend only on seed, rank and step); --fail-at-step drills this, and
--fail-in-save-at-step drills a rank dying while a checkpoint is written. On CPU the ending is the
same bit for bit; on CUDA add --deterministic (deterministic kernels and cuBLAS workspace).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import megatron_fsdp
from gpt_model import GPT, GPTConfig, TransformerBlock

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "auto": None}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="optim_grads_params", help="zero_dp_strategy: 0..3 or its name")
    parser.add_argument("--dp-outer", type=int, default=1,
                        help="HSDP: ranks form a (dp_outer, world / dp_outer) mesh; shards are replicated dp_outer times")
    parser.add_argument("--outer-strategy", default="no_shard", choices=("no_shard", "optim"),
                        help="with --dp-outer > 1: replicate (HSDP) or also shard the optimizer state (HFSDP)")
    parser.add_argument("--steps", type=int, default=300,
                        help="total optimizer steps of the training run; resuming with another value (e.g. to extend a "
                             "finished run) rebuilds the one-cycle LR schedule for the new length from the resumed step on")
    parser.add_argument("--run-steps", type=int, default=None,
                        help="stop after this many steps in this launch (a time-limited job); the next launch resumes")
    parser.add_argument("--checkpoint-dir", default="runs/train_gpt", help="checkpoints go here; the newest is resumed")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per rank per micro-batch")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip-grad", type=float, default=1.0,
                        help="clip the global gradient norm to this (megatron_fsdp.clip_grad_norm_); 0 turns clipping off")
    parser.add_argument("--bf16", action="store_true", help="compute in bf16 (fp32 main weights stay in the optimizer)")
    parser.add_argument("--main-grads-dtype", choices=tuple(DTYPES), default="auto",
                        help="dtype gradients accumulate in; auto = the compute dtype")
    parser.add_argument("--grad-comm-dtype", choices=tuple(DTYPES), default="auto",
                        help="dtype gradients travel in; auto = the main-gradient dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-chars", type=int, default=200, help="characters of text to generate at the end")
    parser.add_argument("--fail-at-step", type=int, default=None,
                        help="fault drill: on torchrun's first attempt the last rank SIGKILLs itself at this step; "
                             "with --max-restarts the job resumes from its last checkpoint")
    parser.add_argument("--fail-in-save-at-step", type=int, default=None,
                        help="fault drill: on torchrun's first attempt the last rank SIGKILLs itself while the checkpoint of "
                             "this step (a multiple of --checkpoint-every, or --steps) is being written, after its own data "
                             "file exists and before the checkpoint is committed; with --max-restarts the job resumes from "
                             "the checkpoint before it")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True) and, on CUDA, CUBLAS_WORKSPACE_CONFIG=:4096:8 (unless "
                             "set): a run resumed from a checkpoint then ends bit for bit like an uninterrupted one on CUDA "
                             "too (on CPU it does without); slower, and an op without a deterministic kernel raises")
    args = parser.parse_args()
    save_step = args.fail_in_save_at_step
    if save_step is not None and save_step % args.checkpoint_every and save_step != args.steps:
        parser.error(f"--fail-in-save-at-step {save_step}: no checkpoint is saved at that step "
                     f"(one every --checkpoint-every {args.checkpoint_every} steps and at --steps {args.steps})")
    return args


def make_deterministic() -> None:
    """--deterministic, before any CUDA work: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it creates
    its handle, and without it a deterministic-mode matmul raises on CUDA >= 10.2. In this mode
    ops with a deterministic alternative take it (on CUDA: SDPA's flash and memory-efficient
    backward stop splitting over keys; index_add, scatter_add, index_select's backward), and an op
    without one raises instead of drifting silently (torch.use_deterministic_algorithms lists
    them; this job's, embedding backward and cross entropy over 2-D logits included, are not
    among them)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False  # no timing-based kernel choice (off by default; stated)


def setup_distributed() -> torch.device:
    backend, device = ("nccl", torch.device("cuda")) if torch.cuda.is_available() else ("gloo", torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return device
    # torchrun's workers share the agent's store across restarts, where the connection addresses
    # of the previous attempt's ranks linger and a restarted rank would connect to a dead one:
    # each attempt gets keys of its own.
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{restart}", agent_store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return device


def apply_fsdp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, args: argparse.Namespace,
               device: torch.device) -> tuple[megatron_fsdp.MegatronFSDP, torch.optim.Optimizer]:
    """Every TransformerBlock is a unit; with --dp-outer > 1 the ranks form a 2-D mesh (HSDP)."""
    mesh_arguments = {}
    if args.dp_outer > 1:
        mesh = init_device_mesh(device.type, (args.dp_outer, dist.get_world_size() // args.dp_outer),
                                mesh_dim_names=("dp_outer", "dp_shard"))
        mesh_arguments = dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                              outer_dp_sharding_strategy=args.outer_strategy)
    policy = megatron_fsdp.MixedPrecisionPolicy(
        main_params_dtype=torch.float32, main_grads_dtype=DTYPES[args.main_grads_dtype], grad_comm_dtype=DTYPES[args.grad_comm_dtype]
    )
    return megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=args.strategy,
                                     mixed_precision_policy=policy, **mesh_arguments)


def lr_schedule(optimizer: torch.optim.Optimizer, args: argparse.Namespace,
                resumed_step: int = 0) -> torch.optim.lr_scheduler.OneCycleLR:
    """One cycle over --steps, positioned at ``resumed_step``: a run resumed with another --steps
    follows the schedule of the new length from there on (the LR moves to that schedule's value)."""
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.1,
                                               last_epoch=resumed_step - 1)


def plot_losses(losses: list[float], path: str) -> None:
    """The loss of every step as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(range(1, len(losses) + 1), losses, linewidth=1)
    axes.set(xlabel="step", ylabel="training loss", title="train_gpt.py")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


class CharData:
    """The corpus as character ids. A batch depends only on (seed, rank, step, micro-batch), so
    a resumed run draws exactly the batches the interrupted one would have."""

    def __init__(self, path: str, seq_len: int, seed: int, rank: int) -> None:
        with open(path, encoding="ascii") as handle:
            text = handle.read()
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index[c] for c in text], dtype=torch.long)
        self.seq_len = seq_len
        self.seed, self.rank = seed, rank

    def batch(self, rows: int, step: int, micro: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(((self.seed * 1009 + self.rank) * 1000003 + step) * 101 + micro)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (rows,), generator=generator)
        window = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()])
        return window[:, :-1].to(device), window[:, 1:].to(device)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


@torch.no_grad()
def generate(model: torch.nn.Module, data: CharData, prompt: str, length: int, device: torch.device) -> str:
    """Sampling runs on every rank in lockstep: a sharded model's forward is a collective."""
    generator = torch.Generator(device=device).manual_seed(1234)
    ids = [data.index[c] for c in prompt]
    for _ in range(length):
        context = torch.tensor([ids[-data.seq_len :]], device=device)
        logits = model(context)[0, -1].float()
        probs = F.softmax(logits / 0.8, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return data.decode(ids)


def kill_this_rank_once(args: argparse.Namespace, step: int, rank: int, world: int) -> None:
    """--fail-at-step: a rank dies as a crashed host would, only on the first attempt, so the
    restarted job (TORCHELASTIC_RESTART_COUNT > 0) runs through."""
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if step == args.fail_at_step and rank == world - 1 and first_attempt:
        logging.info("rank %d: --fail-at-step %d: killing this process", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def killed_in_save_once(args: argparse.Namespace, step: int, rank: int, world: int):
    """--fail-in-save-at-step: around the save of checkpoint ``step``, on torchrun's first attempt,
    the last rank SIGKILLs itself at its first ``dist.gather_object`` after its own DCP data file
    (``__<rank>_<n>.distcp``) exists in the step's ``.partial`` directory.

    That call is DCP's gather of the ranks' write results (``_DistWrapper.all_reduce("write")`` in
    torch/distributed/checkpoint: every rank writes its files, then the coordinator gathers all
    results before ``finish`` writes ``.metadata``); the plan's gather comes before any file
    exists. So the rank dies with its data on disk, before reporting it. The commit cannot follow:
    rank 0 writes the manifest and renames ``.partial`` only after ``dcp.save`` returned and
    ``save_checkpoint`` gathered every rank's checksums, and both gathers need this rank. A
    thread polling for the file would race the rank itself, which goes on to report its writes
    and send its checksums (a tiny model's checkpoint was committed some 60 ms after its last
    data file was written, 4 ranks on 2 CPU cores): a poller that wakes late lets the checkpoint
    through. This call runs in the dying rank's own thread, so the kill lands at the same point
    every time."""
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if step != args.fail_in_save_at_step or rank != world - 1 or not first_attempt:
        yield
        return
    partial = os.path.join(args.checkpoint_dir, f"step_{step:08d}.partial")
    gather_object = dist.gather_object

    def gather_or_die(*arguments, **keywords):
        written = glob.glob(os.path.join(partial, f"__{rank}_*.distcp"))
        if written:
            logging.info("rank %d: --fail-in-save-at-step %d: killing this process, %s written, not yet committed",
                         rank, step, os.path.basename(written[0]))
            os.kill(os.getpid(), signal.SIGKILL)
        return gather_object(*arguments, **keywords)

    dist.gather_object = gather_or_die
    try:
        yield
    finally:
        dist.gather_object = gather_object
    logging.error("rank %d: --fail-in-save-at-step %d: the save finished without the kill", rank, step)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.deterministic:
        make_deterministic()
    device = setup_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    data = CharData(CORPUS, args.seq_len, seed=args.seed, rank=rank)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = GPTConfig(vocab_size=len(data.chars), seq_len=args.seq_len, layers=args.layers, hidden=args.hidden,
                       heads=args.heads, ffn=int(args.hidden * 8 / 3) // 16 * 16)
    model = GPT(config).to(device, torch.bfloat16 if args.bf16 else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, optimizer = apply_fsdp(model, optimizer, args, device)
    schedule = lr_schedule(optimizer, args)

    start_step, losses = 0, []
    resumed = megatron_fsdp.load_checkpoint(args.checkpoint_dir, model, optimizer, fallback=True)
    if resumed is not None:
        start_step, extra = resumed
        saved_steps = extra["schedule"]["total_steps"]
        if saved_steps == args.steps or start_step >= args.steps:
            schedule.load_state_dict(extra["schedule"])
        else:
            schedule = lr_schedule(optimizer, args, resumed_step=start_step)
            if rank == 0:
                logging.info("--steps %d, the checkpoint's run had %d: LR schedule rebuilt for %d steps", args.steps, saved_steps, args.steps)
        losses = extra["losses"]
        if rank == 0:
            logging.info("resumed from %s at step %d", args.checkpoint_dir, start_step)
    end_step = args.steps if args.run_steps is None else min(args.steps, start_step + args.run_steps)

    tokens_per_step = world * args.grad_accum * args.micro_batch * args.seq_len
    progress = tqdm(range(start_step, end_step), initial=start_step, total=args.steps, disable=rank != 0, desc="train", unit="step")
    first_loss = last_loss = None
    for step in progress:
        kill_this_rank_once(args, step, rank, world)
        started = time.perf_counter()
        # Anything random in a step (dropout, sampling) draws from (seed, rank, step), like the
        # data: a resumed run repeats it exactly without saving RNG states.
        torch.manual_seed(((args.seed * 1009 + rank) * 1000003 + step) * 7 + 1)
        loss_sum = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            inputs, targets = data.batch(args.micro_batch, step, micro, device)
            logits = model(inputs)
            loss = F.cross_entropy(logits.float().view(-1, config.vocab_size), targets.reshape(-1))
            (loss / args.grad_accum).backward()
            loss_sum += loss.detach()
        grad_norm = megatron_fsdp.clip_grad_norm_(model, args.clip_grad) if args.clip_grad > 0 else None
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        dist.all_reduce(loss_sum)
        last_loss = loss_sum.item() / (world * args.grad_accum)
        first_loss = first_loss if first_loss is not None else last_loss
        losses.append(last_loss)
        shown = {"loss": f"{last_loss:.3f}", "tok_s": f"{tokens_per_step / (time.perf_counter() - started):,.0f}"}
        if grad_norm is not None:
            shown["grad_norm"] = f"{grad_norm.item():.3f}"
        progress.set_postfix(shown)
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == end_step:
            with killed_in_save_once(args, step + 1, rank, world):
                megatron_fsdp.save_checkpoint(args.checkpoint_dir, step + 1, model, optimizer,
                                              extra_state={"schedule": schedule.state_dict(), "losses": losses}, keep_last=2)

    if end_step < args.steps:
        if rank == 0:
            logging.info("stopped at step %d of %d (loss %.3f), saved in %s; launch again to resume", end_step, args.steps,
                         last_loss, args.checkpoint_dir)
        dist.destroy_process_group()
        return
    model.eval()
    sample = generate(model, data, "Shall I compare thee", args.sample_chars, device)
    if rank == 0 and last_loss is not None:
        logging.info("loss %.3f -> %.3f over steps %d..%d (%s, %d ranks); checkpoints of the last steps in %s",
                     first_loss, last_loss, start_step, end_step, megatron_fsdp.ShardingStrategy.parse(args.strategy).label,
                     world, args.checkpoint_dir)
        logging.info("sample:\n%s", sample)
        plot_path = os.path.join(args.checkpoint_dir, "loss_curve.png")
        plot_losses(losses, plot_path)
        logging.info("loss curve of steps 1..%d: %s", len(losses), plot_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
