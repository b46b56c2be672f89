"""Shard a Hugging Face Transformers Llama with megatron_fsdp, train it, checkpoint it and
save it as a safetensors model directory that ``LlamaForCausalLM.from_pretrained`` loads.

    torchrun --standalone --nproc_per_node 2 examples/hf_llama.py --out runs/hf_llama
    torchrun --standalone --nproc_per_node 2 examples/hf_llama.py --out runs/again --pretrained runs/hf_llama/hf

The model is built from a small ``LlamaConfig`` with random weights (nothing is downloaded), or
with ``--pretrained DIR`` from a Hugging Face directory's config and weights, built on the meta
device and loaded into the shards (no rank holds the whole model), and learns the bytes of
examples/data/corpus.txt. CPU with gloo, or CUDA with NCCL when GPUs exist.
Written for Transformers 5 (scripts/setup.sh pins the version; tested with 5.17 and 5.23).
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import megatron_fsdp

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")
# An import path, so the class need not be imported here (a class object works too).
LLAMA_UNIT = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
VOCAB = 128  # ASCII bytes

logger = logging.getLogger(__name__)


def tiny_llama_config(tie_word_embeddings: bool = True) -> LlamaConfig:
    """A Llama small enough to train on a CPU in seconds. Tying is stated either way: the
    default differs between models, and a tied head is shared by the root unit's two modules."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
        use_cache=False,  # training: no key/value cache
        attn_implementation="sdpa",
    )


def build_model(config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """Random initial weights, the same on every rank for the same seed."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def apply_fsdp(
    model: LlamaForCausalLM, strategy: str, lr: float, on_meta_device: bool = False
) -> tuple[megatron_fsdp.MegatronFSDP, torch.optim.Optimizer]:
    """Every LlamaDecoderLayer is a unit; embeddings, final norm and head form the root unit.
    ``on_meta_device``: the model was built on the meta device; each unit gets its memory and
    Transformers' initialisation as it is sharded."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    return megatron_fsdp.fully_shard(
        model, optimizer, fsdp_unit_modules=[LLAMA_UNIT], zero_dp_strategy=strategy, init_model_with_meta_device=on_meta_device
    )


def pretrained_model(directory: str, strategy: str, lr: float) -> tuple[megatron_fsdp.MegatronFSDP, torch.optim.Optimizer]:
    """The Hugging Face model in ``directory``, sharded: built on the meta device from its
    config, then each rank reads its pieces of the weights (``megatron_fsdp.load_pretrained``)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(directory))
    model, optimizer = apply_fsdp(model, strategy, lr, on_meta_device=True)
    megatron_fsdp.load_pretrained(model, directory)
    return model, optimizer


def corpus_tokens(path: str = CORPUS) -> torch.Tensor:
    with open(path, "rb") as handle:
        return torch.tensor(list(handle.read()), dtype=torch.long)


def global_batch(tokens: torch.Tensor, step: int, rows: int, seq_len: int) -> torch.Tensor:
    """``rows`` windows of the corpus drawn from ``step`` alone: every rank (and a single-process
    reference) sees the same global batch and takes its own rows of it."""
    generator = torch.Generator().manual_seed(10_000 + step)
    starts = torch.randint(0, len(tokens) - seq_len, (rows,), generator=generator).tolist()
    return torch.stack([tokens[s : s + seq_len] for s in starts])


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    steps: int,
    rows_per_rank: int,
    seq_len: int,
    device: torch.device,
) -> list[float]:
    """A plain loop; returns the global mean loss of every step. Each rank has as many tokens
    as the others, so the mean of the ranks' mean losses is the global batch's mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        batch = global_batch(tokens, step, rows_per_rank * world, seq_len)
        input_ids = batch[rank * rows_per_rank : (rank + 1) * rows_per_rank].to(device)
        loss = model(input_ids=input_ids, labels=input_ids).loss  # HF shifts the labels itself
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def export_pretrained(model: megatron_fsdp.MegatronFSDP, out_dir: str) -> None:
    """A directory ``from_pretrained`` loads (safetensors, config.json), every rank writing its
    own pieces: nothing is gathered. A collective."""
    megatron_fsdp.save_pretrained(model, out_dir)


def setup_distributed() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        return torch.device("cuda")
    dist.init_process_group("gloo")
    return torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/hf_llama", help="checkpoints in OUT/checkpoints, the exported model in OUT/hf")
    parser.add_argument("--strategy", default="optim_grads_params", help="zero_dp_strategy: 0..3 or its name")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--untied", action="store_true", help="tie_word_embeddings=False")
    parser.add_argument("--pretrained", help="start from this Hugging Face directory (its config and weights)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = setup_distributed()

    if args.pretrained:
        model, optimizer = pretrained_model(args.pretrained, args.strategy, args.lr)
    else:
        model, optimizer = apply_fsdp(build_model(tiny_llama_config(not args.untied)).to(device), args.strategy, args.lr)
    tokens = corpus_tokens()
    losses = train(model, optimizer, tokens, args.steps, args.rows, args.seq_len, device)
    saved = megatron_fsdp.save_checkpoint(os.path.join(args.out, "checkpoints"), args.steps, model, optimizer)
    export_dir = os.path.join(args.out, "hf")
    export_pretrained(model, export_dir)

    # The exported model, loaded by plain Transformers, scores a batch as the sharded one does.
    batch = global_batch(tokens, args.steps, 2, args.seq_len).to(device)
    model.eval()
    with torch.no_grad():
        sharded_loss = model(input_ids=batch, labels=batch).loss.item()
    if dist.get_rank() == 0:
        # Transformers 5 loads the weights in the dtype they were exported in (fp32 here).
        loaded = LlamaForCausalLM.from_pretrained(export_dir).to(device).eval()
        with torch.no_grad():
            loaded_loss = loaded(input_ids=batch, labels=batch).loss.item()
        logger.info("loss %.3f -> %.3f over %d steps on %d ranks (%s)", losses[0], losses[-1], args.steps,
                    dist.get_world_size(), megatron_fsdp.ShardingStrategy.parse(args.strategy).label)
        logger.info("saved the sharded checkpoint in %s, exported to %s; held-out loss: sharded %.6f, from_pretrained %.6f",
                    saved, export_dir, sharded_loss, loaded_loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
