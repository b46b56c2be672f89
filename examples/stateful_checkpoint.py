"""Checkpoint a megatron_fsdp run the way torchtitan does: a ``Stateful`` that reads and writes
model and optimizer through torch's own state-dict helpers, saved with ``dcp.save`` and
restored with ``dcp.load``.

    torchrun --standalone --nproc_per_node 2 examples/stateful_checkpoint.py --steps 20 --stop-at 10
    torchrun --standalone --nproc_per_node 2 examples/stateful_checkpoint.py --steps 20

The first launch stops at step 10 after saving; the second finds the checkpoint and resumes. The
files hold plain tensors keyed by the original parameter FQNs, the layout torchtitan and FSDP2
write, so they load into any model of the same architecture (``megatron_fsdp.load_checkpoint``
reads them too). docs/checkpointing.md explains both ways.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import megatron_fsdp
from gpt_model import GPT, GPTConfig, TransformerBlock
from train_gpt import CORPUS, CharData, setup_distributed


class TrainingState(Stateful):
    """What a checkpoint holds: the model, the optimizer and the LR schedule, keyed by FQN."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 schedule: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.model, self.optimizer, self.schedule = model, optimizer, schedule

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state, "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optimizer"])
        self.schedule.load_state_dict(state_dict["schedule"])


def build(data: CharData, device: torch.device, seed: int = 0) -> TrainingState:
    """A 2-layer GPT whose blocks are sharded units, AdamW and a cosine schedule."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=len(data.chars), seq_len=data.seq_len, layers=2, hidden=64, heads=4, ffn=160))
    optimizer = torch.optim.AdamW(model.to(device).parameters(), lr=3e-3, weight_decay=0.1)
    model, optimizer = megatron_fsdp.fully_shard(model, optimizer, fsdp_unit_modules=[TransformerBlock])
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    return TrainingState(model, optimizer, schedule)


def train(state: TrainingState, data: CharData, steps: range, device: torch.device) -> list[float]:
    """Plain training steps; returns each step's loss on this rank."""
    losses = []
    for step in steps:
        inputs, targets = data.batch(8, step, 0, device)
        logits = state.model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), 1.0)
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.schedule.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stop-at", type=int, default=None, help="save and stop after this step (a time-limited job)")
    parser.add_argument("--checkpoint-dir", default="runs/stateful_checkpoint")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = setup_distributed()
    data = CharData(CORPUS, seq_len=32, seed=0, rank=dist.get_rank())
    state = build(data, device)

    start = 0
    marker = os.path.join(args.checkpoint_dir, "step")
    if os.path.exists(marker):
        with open(marker) as handle:
            start = int(handle.read())
        dcp.load({"app": state}, checkpoint_id=os.path.join(args.checkpoint_dir, f"step_{start}"))
        logging.info("rank %d resumed at step %d", dist.get_rank(), start)
    stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    losses = train(state, data, range(start, stop), device)
    dcp.save({"app": state}, checkpoint_id=os.path.join(args.checkpoint_dir, f"step_{stop}"))
    if dist.get_rank() == 0:
        with open(marker, "w") as handle:  # written after every rank finished saving
            handle.write(str(stop))
        logging.info("steps %d..%d, loss %.3f -> %.3f; saved step %d in %s", start, stop, losses[0], losses[-1], stop,
                     os.path.join(args.checkpoint_dir, f"step_{stop}"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
