"""transformers.Trainer's own throughput on a Llama: megatron_fsdp against FSDP2, the same Trainer.

    python benchmarks/hf_trainer_speed.py --nproc-per-node 1 --out results.json

Rows, each in its own ``torchrun`` (so neither inherits the other's memory or Accelerate state):

- ``megatron_fsdp``: the model built in bf16, ``fully_shard(model, fsdp_unit_modules=
  [LlamaDecoderLayer])`` (fp32 main weights, bf16 gradients), ``MegatronFSDPTrainer`` with the
  arguments below (docs/hugging_face.md);
- ``FSDP2``: the model built in fp32, plain ``Trainer`` with ``fsdp="full_shard"`` and
  ``fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}``:
  Accelerate applies torch's ``fully_shard`` per decoder layer with its bf16 mixed precision.

Both: ``TrainingArguments(bf16=True, per_device_train_batch_size=--micro-batch, max_steps=
--steps, learning_rate=1e-4, save_strategy="no")``, AdamW (Trainer's default), random tokens.
Reported: Trainer's own ``train_samples_per_second`` (over the whole run, warm-up included) and
the median step time after ``--warmup`` steps (a callback synchronising the device at each step's
end), peak allocated memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROWS = ("megatron_fsdp", "FSDP2")
# A 1.1B-parameter Llama (TinyLlama's shape).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=256)


def _dataset(rows: int, seq_len: int, vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


def _step_timer(warmup: int):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """The wall time of each optimizer step, the device synchronised at its end."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._last = None

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self._last is not None and state.global_step > warmup:
                self.times.append(now - self._last)
            self._last = now

    return StepTimer()


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    shape = TINY if args.tiny else LLAMA_1B
    config = LlamaConfig(**shape, tie_word_embeddings=False, use_cache=False)
    dataset = _dataset(args.steps * args.micro_batch * world, args.seq_len, config.vocab_size)
    common = dict(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
        learning_rate=1e-4, bf16=cuda, save_strategy="no", logging_steps=args.steps, report_to="none",
        use_cpu=not cuda, seed=0, dataloader_num_workers=0,
    )
    timer = _step_timer(args.warmup)
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    if args.worker == "megatron_fsdp":
        import megatron_fsdp
        from megatron_fsdp.integrations.hugging_face import MegatronFSDPTrainer

        with device:
            model = LlamaForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)
        parameters = sum(p.numel() for p in model.parameters())
        model, _ = megatron_fsdp.fully_shard(model, fsdp_unit_modules=[LlamaDecoderLayer])
        trainer = MegatronFSDPTrainer(model=model, args=TrainingArguments(**common), train_dataset=dataset, callbacks=[timer])
    else:
        with device:
            model = LlamaForCausalLM(config)
        parameters = sum(p.numel() for p in model.parameters())
        arguments = TrainingArguments(
            **common, fsdp="full_shard",
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True},
        )
        trainer = Trainer(model=model, args=arguments, train_dataset=dataset, callbacks=[timer])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    metrics = trainer.train().metrics
    if dist.get_rank() == 0:
        row = {
            "row": args.worker, "world": world, "parameters_b": parameters / 1e9,
            "train_samples_per_second": metrics["train_samples_per_second"],
            "median_step_ms": 1000 * statistics.median(timer.times) if timer.times else None,
            "tokens_per_s_per_gpu": args.micro_batch * args.seq_len / statistics.median(timer.times) if timer.times else None,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "train_loss": metrics["train_loss"],
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        }
        with open(args.row_out, "w") as handle:
            json.dump(row, handle)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--tiny", action="store_true", help="a 2-layer Llama (a CPU check of the script)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    results = []
    for row in args.rows.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as row_out:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc_per_node}",
                       __file__, "--worker", row, "--row-out", row_out.name, "--micro-batch", str(args.micro_batch),
                       "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            command += ["--tiny"] if args.tiny else []
            finished = subprocess.run(command, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])})
            if finished.returncode != 0:
                print(f"{row}: failed (exit {finished.returncode})", file=sys.stderr)
                continue
            with open(row_out.name) as handle:
                results.append(json.load(handle))
    print("| row | world | samples/s (Trainer) | median step ms | tokens/s/GPU | peak allocated GiB | train loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['row']} | {r['world']} | {r['train_samples_per_second']:.2f} | {r['median_step_ms'] or 0:.1f} | "
              f"{r['tokens_per_s_per_gpu'] or 0:,.0f} | {r['peak_allocated_gib'] or 0:.1f} | {r['train_loss']:.4f} |")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"rows": results, "settings": vars(args), "date": time.strftime("%Y-%m-%d")}, handle, indent=2)


if __name__ == "__main__":
    main()
