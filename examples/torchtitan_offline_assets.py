"""Writes what torchtitan's llama3 debug config reads from disk, for machines without network:
a word-level tokenizer at ``tests/assets/tokenizer`` and a small text dataset at
``tests/assets/c4_test`` (the default ``hf_assets_path`` and the ``c4_test`` dataset's path,
both relative to the directory torchtitan runs in). The text is made of a fixed vocabulary with
a seeded generator, so every run reads the same tokens.

    python examples/torchtitan_offline_assets.py RUN_DIR    # then run torchtitan in RUN_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_offline_assets(run_dir: str | Path, *, vocab_words: int = 1000, documents: int = 400, seed: int = 0) -> Path:
    """Writes the tokenizer and dataset under ``run_dir``; returns ``run_dir``. The vocabulary
    (``vocab_words`` words and 3 special tokens) fits the debug model's 2048."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    run_dir = Path(run_dir)
    words = [f"w{i}" for i in range(vocab_words)]
    vocab = {token: index for index, token in enumerate([BOS, EOS, "<unk>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([BOS, EOS])
    tokenizer_dir = run_dir / "tests" / "assets" / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True})
    )

    rng = random.Random(seed)
    dataset_dir = run_dir / "tests" / "assets" / "c4_test"
    dataset_dir.mkdir(parents=True, exist_ok=True)
    with open(dataset_dir / "c4-train.00000-of-00001.json", "w") as out:
        for _ in range(documents):
            # Zipf-like word frequencies, so the loss has something to learn in a few steps.
            text = " ".join(words[min(int(rng.paretovariate(1.2)) - 1, vocab_words - 1)] for _ in range(rng.randint(50, 400)))
            out.write(json.dumps({"text": text}) + "\n")
    return run_dir


if __name__ == "__main__":
    print(write_offline_assets(sys.argv[1] if len(sys.argv) > 1 else "."))
