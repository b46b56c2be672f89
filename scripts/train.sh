#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: a small character-level GPT trained with
# fully_shard on 2 CPU processes (gloo) for 300 steps, launched twice: the first launch stops
# at step 150 (as a time-limited job would), the second resumes from its checkpoint.
# Extra arguments go to examples/train_gpt.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
checkpoints=runs/train_gpt
rm -rf "$checkpoints"
run() { .venv/bin/torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --checkpoint-dir "$checkpoints" "$@"; }
run --run-steps 150 "$@"
run "$@"
