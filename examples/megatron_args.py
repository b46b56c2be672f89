"""Configure megatron_fsdp with Megatron-LM's command-line flags.

    torchrun --standalone --nproc_per_node 2 examples/megatron_args.py --use-megatron-fsdp \\
        --data-parallel-sharding-strategy optim_grads --megatron-fsdp-grad-comm-dtype bf16 \\
        --megatron-fsdp-main-grads-dtype fp32

    torchrun --standalone --nproc_per_node 2 examples/megatron_args.py --use-megatron-fsdp \\
        --num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim

The flags become a ``DistributedDataParallelConfig`` (validated: a contradiction stops the job
before anything runs), whose ``fully_shard_kwargs`` shard the GPT of examples/gpt_model.py.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_fsdp
from gpt_model import GPT, GPTConfig, TransformerBlock
from megatron_fsdp.integrations.megatron_lm import args_from_ddp_config

logger = logging.getLogger(__name__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    megatron_fsdp.add_megatron_fsdp_args(parser)
    parser.add_argument("--train-iters", type=int, default=20)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save", default=None, help="checkpoint directory (fsdp_dtensor format); none when omitted")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = megatron_fsdp.ddp_config_from_args(args)  # before any process starts talking

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    mesh = config.device_mesh(device.type)

    torch.manual_seed(0)
    model_config = GPTConfig(vocab_size=128, seq_len=32, layers=2, hidden=64, heads=4, ffn=160)
    model = GPT(model_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = megatron_fsdp.fully_shard(
        model, optimizer, fsdp_unit_modules=[TransformerBlock], **config.fully_shard_kwargs(mesh)
    )
    rank = dist.get_rank()
    if rank == 0:
        logger.info("effective flags: %s", " ".join(args_from_ddp_config(config)))

    # A learnable toy task: each sequence counts up from a random start (mod the vocabulary).
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.train_iters):
        starts = torch.randint(0, model_config.vocab_size, (args.micro_batch_size, 1), generator=generator)
        tokens = ((starts + torch.arange(model_config.seq_len + 1)) % model_config.vocab_size).to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        # Megatron-LM's --clip-grad: the global L2 norm, clipped when > 0.
        grad_norm = megatron_fsdp.clip_grad_norm_(model, args.clip_grad) if args.clip_grad > 0 else None
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.train_iters - 1):
            shown = f" | grad norm {grad_norm.item():.3f}" if grad_norm is not None else ""
            logger.info("iteration %d: lm loss %.4f%s", step, loss.item(), shown)
    if args.save:
        saved = megatron_fsdp.save_checkpoint(args.save, args.train_iters, model, optimizer)
        if rank == 0:
            logger.info("saved iteration %d in %s", args.train_iters, saved)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
