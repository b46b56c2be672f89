#!/usr/bin/env bash
# Sets up everything from nothing: a venv in .venv, torch 2.13.0 (the CPU wheel on this machine's
# disk; a pinned version so pip never pulls a CUDA build), the test tools, and the C++ extension.
# Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q numpy ninja setuptools wheel pytest pytest-timeout tqdm safetensors matplotlib
# Transformers for examples/hf_llama.py; pinned, and it does not require torch, so ours stays.
.venv/bin/pip install -q "transformers==4.57.1"
# --no-build-isolation: build against the torch above instead of a fresh (CUDA) one.
.venv/bin/pip install -q --no-build-isolation --no-deps -e .
.venv/bin/python -c "import megatron_fsdp; print('megatron_fsdp', megatron_fsdp.__version__, 'ready')"
