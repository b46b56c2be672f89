#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: a small character-level GPT trained with
# fully_shard on 2 CPU processes (gloo). Extra arguments go to examples/train_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc_per_node 2 examples/train_gpt.py "$@"
