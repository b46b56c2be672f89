"""Megatron-LM's own forward of a saved GPT checkpoint on fixed tokens, for comparing converted
checkpoints (issue 63) with what Megatron computes.

Run like ``pretrain_gpt.py`` (one torchrun; on megatron_fsdp through
``python -m megatron_fsdp.integrations.launch``) with the run's model flags, ``--load DIR`` and,
first, ``--logits-out FILE``. The model is built by Megatron-LM's ``model_provider`` with its
``gpt_builder`` (``MEGATRON_LM_DIR`` on ``sys.path``), wrapped as training wraps it when
``--use-megatron-fsdp`` is given (the ``fsdp_dtensor`` loader needs the wrapper) and plain
otherwise, loaded by Megatron-LM's ``load_checkpoint`` without optimizer, and run in eval mode
(no dropout). FILE gets ``{"tokens", "position_ids", "logits", "iteration"}``: tokens
``(7 * i + 3) % vocab`` for i in ``0 .. 2 * seq - 1`` as 2 rows, causal mask, fp32 logits
``[2, seq, padded vocab]``.
"""

from __future__ import annotations

import sys
from functools import partial

import torch


def _pop_option(argv: list[str], name: str) -> str:
    index = argv.index(name)
    value = argv[index + 1]
    del argv[index : index + 2]
    return value


def main() -> None:
    out = _pop_option(sys.argv, "--logits-out")
    from gpt_builders import gpt_builder
    from megatron.core.enums import ModelType
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model
    from model_provider import model_provider

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    initialize_megatron()
    model = get_model(partial(model_provider, gpt_builder), ModelType.encoder_or_decoder, wrap_with_ddp=args.use_megatron_fsdp)
    iteration, _ = load_checkpoint(model, None, None, strict=True)
    seq, vocab = args.seq_length, args.padded_vocab_size
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = ((torch.arange(2 * seq) * 7 + 3) % args.vocab_size).view(2, seq).to(device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(2, seq)
    mask = torch.tril(torch.ones(1, 1, seq, seq, device=device)) < 0.5  # True: masked out
    model[0].eval()
    with torch.no_grad():
        logits = model[0](tokens, position_ids, mask)
    assert logits.shape == (2, seq, vocab), logits.shape
    if torch.distributed.get_rank() == 0:
        torch.save(
            {"tokens": tokens.cpu(), "position_ids": position_ids.cpu(), "logits": logits.float().cpu(), "iteration": iteration},
            out,
        )
        print(f"logits {tuple(logits.shape)} of the checkpoint at iteration {iteration} -> {out}", flush=True)


if __name__ == "__main__":
    main()
