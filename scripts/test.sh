#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite; GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# --hypothesis-profile=ci: property tests draw the same examples every run (tests/conftest.py).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --hypothesis-profile=ci tests "$@"
