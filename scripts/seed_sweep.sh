#!/usr/bin/env bash
# The property tests (every test file that uses Hypothesis) drawn afresh under each of SEEDS seeds
# (default 50), outside CI, which draws the same examples on every run (tests/conftest.py's "ci"
# profile). One line per seed; a failing seed's whole output is kept in LOG_DIR/seed-N.log, and
# the script exits non-zero if any seed failed. Pin each failing draw with @example.
#   bash scripts/seed_sweep.sh [SEEDS] [LOG_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
seeds=${1:-50}
logs=${2:-seed_sweep_logs}
bash scripts/setup.sh > /dev/null
mkdir -p "$logs"
mapfile -t files < <(grep -l "^from hypothesis import" tests/test_*.py)
failed=0
for seed in $(seq 1 "$seeds"); do
  log="$logs/seed-$seed.log"
  if .venv/bin/python -m pytest -q -p no:cacheprovider --hypothesis-profile=seed-sweep \
      --hypothesis-seed="$seed" "${files[@]}" > "$log" 2>&1; then
    echo "seed $seed: passed ($(tail -1 "$log"))"
    rm "$log"
  else
    echo "seed $seed: FAILED, see $log"
    failed=$((failed + 1))
  fi
done
echo "$failed of $seeds seeds failed"
[ "$failed" -eq 0 ]
