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
# Pinned: Hypothesis's fixed draws (tests/conftest.py) are the same only under one version of it.
.venv/bin/pip install -q "numpy==2.4.6" "ninja==1.13.2" "setuptools==84.2.1" "wheel==0.48.0" "pytest==9.2.0" \
  "pytest-timeout==2.4.0" "hypothesis==6.170.17" "tqdm==4.70.1" "safetensors==0.8.0" "matplotlib==3.11.2"
# Transformers for examples/hf_llama.py: 5.23.0 is the newest 5.x that installs beside torch 2.13.0 (it needs no torch).
.venv/bin/pip install -q "transformers==5.23.0"
# Accelerate for tests/test_failed_steps.py (its find_executable_batch_size around a sharded model).
.venv/bin/pip install -q "accelerate==1.15.0"
# torchao for float8 training (tests/test_float8.py); --no-deps: it needs nothing beyond torch.
.venv/bin/pip install -q --no-deps "torchao==0.18.0"
# torch.testing._internal (scripts/fsdp2_upstream_tests.py) imports expecttest.
.venv/bin/pip install -q --no-deps "expecttest==0.3.0"
# torchtitan 0.3.0 for tests/test_torchtitan.py (its trainer over megatron_fsdp.integrations.torchtitan),
# --no-deps so nothing touches torch or transformers; then, pinned, what its trainer path imports.
.venv/bin/pip install -q --no-deps "torchtitan==0.3.0" "tyro==1.0.17" "docstring_parser==0.18.0" "typeguard==4.6.1" \
  "spmd_types==0.2.3" "torchdata==0.11.0" "torch_checkpointing==0.1.1" "einops==0.8.2" \
  "tensorboard==2.21.0" "protobuf==7.34.1" "absl-py==2.3.1" \
  "datasets==4.7.0" "pyarrow==25.0.1" "pandas==3.0.6" "dill==0.4.0" "multiprocess==0.70.18" "xxhash==4.0.1" \
  "httpx==0.28.1" "httpcore==1.0.9" "certifi==2025.10.5" "requests==2.32.5" "urllib3==2.5.0" "charset_normalizer==3.4.4"
# --no-build-isolation: build against the torch above instead of a fresh (CUDA) one. Skipped
# when the installed extension imports and no C++ source or build file is newer than it.
root=$(pwd)
built=$(ls megatron_fsdp/_C*.so 2>/dev/null | head -1 || true)
# (Imported from / so the check sees the installed package, not this directory.)
if [ -z "$built" ] || ! (cd / && "$root/.venv/bin/python" -c "import megatron_fsdp._C") 2>/dev/null \
    || [ -n "$(find csrc setup.py pyproject.toml -newer "$built" -type f | head -1)" ]; then
  .venv/bin/pip install -q --no-build-isolation --no-deps -e .
fi
.venv/bin/python -c "import megatron_fsdp; print('megatron_fsdp', megatron_fsdp.__version__, 'ready')"
