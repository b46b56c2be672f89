"""Train a Hugging Face Transformers Llama with Transformers' Trainer on megatron_fsdp, checkpoint
and resume it, and save it for ``from_pretrained``.

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --out runs/hf_trainer

A Trainer script changes in two places, marked ``megatron_fsdp:`` below: the model is sharded by
``fully_shard`` before Trainer sees it, and ``MegatronFSDPTrainer`` takes Trainer's place with the
same arguments (docs/hugging_face.md says why). The model is examples/hf_llama.py's small Llama
with random weights, learning the bytes of examples/data/corpus.txt; CPU with gloo, or CUDA.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM, TrainingArguments

import megatron_fsdp
from hf_llama import LLAMA_UNIT, build_model, corpus_tokens, global_batch, tiny_llama_config
from megatron_fsdp.integrations.hugging_face import MegatronFSDPTrainer

logger = logging.getLogger(__name__)


def dataset(rows: int, seq_len: int) -> list[dict]:
    """``rows`` windows of the corpus, with a column the model's forward does not take
    (Trainer's ``remove_unused_columns`` drops it)."""
    batch = global_batch(corpus_tokens(), 0, rows, seq_len)
    return [{"input_ids": row, "labels": row, "row_number": index} for index, row in enumerate(batch)]


def training_arguments(output_dir: str, rows_per_device: int, steps: int, lr: float, accumulation: int) -> TrainingArguments:
    """Trainer's defaults but for the run's size: AdamW, a linear schedule, gradient clipping at
    1.0 and a checkpoint every half of the run."""
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=rows_per_device,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=lr,
        weight_decay=0.1,
        save_steps=max(steps // 2, 1),
        logging_steps=1,
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )


def shard(model: torch.nn.Module) -> megatron_fsdp.MegatronFSDP:
    """megatron_fsdp: every LlamaDecoderLayer is a unit; Trainer builds the optimizer itself."""
    sharded, _ = megatron_fsdp.fully_shard(model, fsdp_unit_modules=[LLAMA_UNIT])
    return sharded


def build_trainer(model: megatron_fsdp.MegatronFSDP, arguments: TrainingArguments, rows: int, seq_len: int) -> MegatronFSDPTrainer:
    # megatron_fsdp: MegatronFSDPTrainer in Trainer's place, with Trainer's arguments.
    return MegatronFSDPTrainer(model=model, args=arguments, train_dataset=dataset(rows, seq_len))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/hf_trainer", help="checkpoints in OUT/run, the saved model in OUT/model")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=4, help="sequences per rank per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # fully_shard needs the process group before Trainer (whose Accelerate then uses it).
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    rows = args.steps * args.accumulation * world * args.rows

    run_dir = os.path.join(args.out, "run")
    arguments = training_arguments(run_dir, args.rows, args.steps, args.lr, args.accumulation)
    trainer = build_trainer(shard(build_model(tiny_llama_config())), arguments, rows, args.seq_len)
    trainer.train()
    model_dir = os.path.join(args.out, "model")
    trainer.save_model(model_dir)

    # A new run resumed from the middle checkpoint ends where this one did.
    resumed = build_trainer(shard(build_model(tiny_llama_config(), seed=1)), arguments, rows, args.seq_len)
    resumed.train(resume_from_checkpoint=os.path.join(run_dir, f"checkpoint-{arguments.save_steps}"))
    finished, resumed_params = trainer.model.full_parameters(), resumed.model.full_parameters()
    if dist.get_rank() == 0:
        exact = all(torch.equal(finished[name], resumed_params[name]) for name in finished)
        loaded = LlamaForCausalLM.from_pretrained(model_dir)
        same = all(torch.equal(p.detach().cpu(), finished[name].cpu()) for name, p in loaded.named_parameters())
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        logger.info("loss %.3f -> %.3f over %d steps on %d ranks", losses[0], losses[-1], args.steps, world)
        logger.info("resumed from the middle checkpoint: %s; from_pretrained(%s) holds the trained weights: %s",
                    "the same weights" if exact else "OTHER WEIGHTS", model_dir, same)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
