#!/usr/bin/env bash
# On a CUDA machine whose python3 already holds a CUDA torch: build the extension with its CUDA
# kernels, then run one part of the GPU suite, logging to RESULTS_DIR (default gpu_results).
#
#   bash scripts/gpu_suite.sh PART [RESULTS_DIR]
#
# Parts (each sized to finish within 8 minutes on one H100, the build included):
#   ops           the op tests on CUDA (tests/gpu/test_ops_cuda.py, tests/test_ops.py) and the op
#                 bandwidth benchmark
#   engine        parity, mixed precision, state dicts, Muon (its owner exchanges), user buffers, memory (steady state, the
#                 plan against the allocator, out-of-memory recovery) over NCCL
#   faults        a rank killed, silent or out of memory mid-step (tests/gpu/test_faults_nccl.py,
#                 about 45 s a case at world 4) and restarts after a killed rank
#                 (tests/gpu/test_restart_nccl.py: train_gpt.py under torchrun, 105 s at world 4)
#   megatron-core megatron-core's DDP face (tests/gpu/test_megatron_core.py; needs megatron-core)
#   megatron-lm-1 .. megatron-lm-7
#                 Megatron-LM's own pretrain_gpt.py against the bundled copy
#                 (tests/gpu/test_megatron_lm_pretrain.py; needs megatron-core and MEGATRON_LM_DIR),
#                 three tests per part in the file's order; the last part runs the rest of the file.
#                 Each test runs ours and the bundled copy side by side.
#   train         the main job on 2 GPUs (skipped with fewer)
#   all           every part above, one after another
#
# World size: every part runs on all the machine's GPUs. Tests that need 2 or more skip on one:
# the user-buffer registrations (engine), faults (all of it; up to 4 GPUs), the model-parallel
# pretrain_gpt.py runs (TP2, EP2 and the TP2 checkpoint), train. Tests that need 4 skip on fewer:
# pretrain_gpt.py at EP2 x ETP2, PP2 x DP2 and PP2 x DP2 interleaved (the last parts of
# megatron-lm). At world 4 the model-parallel runs are TP2 x DP2 and EP2 x DP2
# (benchmarks/results/2026-11-27_h100x4_gpu_suite_world4.txt, 2026-11-28_h200x4_gpu_calls.txt).
# Timed on one H100, the build (65-105 s, logged as "build") not included: ops 18 s of tests
# (2026-11-27), engine 255 s (2026-11-25), megatron-core 79 s (2026-11-27), megatron-lm-1 to -5
# 170, 170, 187, 171 and 130 s (2026-11-27); at world 4 the model-parallel pretrain_gpt.py tests take
# about 100 s each (4 x H200, 2026-11-28). Every part ends within about 6 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS="ops engine faults megatron-core megatron-lm-1 megatron-lm-2 megatron-lm-3 megatron-lm-4 megatron-lm-5 megatron-lm-6 megatron-lm-7 train"
MEGATRON_LM_TESTS_PER_PART=3
LAST_MEGATRON_LM_PART=7
part=${1:?give a part: ${PARTS// /, } or all}
results=${2:-gpu_results}
mkdir -p "$results"
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

build() {
  local start=$SECONDS
  nvidia-smi -L | tee "$results/device.txt"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$results/device.txt"
  # The system compiler: a toolchain that links its own C++ runtime into _C.so crashes it when a
  # kernel's error message formats a number.
  if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
  MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$results/build.log" 2>&1 || { tail -40 "$results/build.log"; exit 1; }
  echo "build: $((SECONDS - start)) s" | tee -a "$results/part_times.txt"
}

# The test ids of megatron-lm-N: its slice of the file's tests; the last part takes the rest, so
# a test added to the file always runs somewhere.
megatron_lm_slice() {
  local n=$1 first last
  first=$(( (n - 1) * MEGATRON_LM_TESTS_PER_PART + 1 ))
  last=$(( n == LAST_MEGATRON_LM_PART ? 1000000 : n * MEGATRON_LM_TESTS_PER_PART ))
  python3 -m pytest -q --collect-only -p no:cacheprovider tests/gpu/test_megatron_lm_pretrain.py 2>/dev/null \
    | grep '::' | sed -n "${first},${last}p"
}

run_part() {
  local name=$1 start=$SECONDS
  case "$name" in
    ops)
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ops_cuda.py tests/test_ops.py 2>&1 | tee "$results/ops_tests.log" | tail -5
      python3 benchmarks/op_bandwidth.py --out "$results/op_bandwidth.json" | tee "$results/op_bandwidth.md" ;;
    engine)
      python3 -m pytest -q -p no:cacheprovider tests/gpu --ignore=tests/gpu/test_ops_cuda.py \
        --ignore=tests/gpu/test_megatron_core.py --ignore=tests/gpu/test_megatron_lm_pretrain.py \
        --ignore=tests/gpu/test_faults_nccl.py --ignore=tests/gpu/test_restart_nccl.py 2>&1 \
        | tee "$results/engine_tests.log" | tail -15 ;;
    faults)
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_faults_nccl.py tests/gpu/test_restart_nccl.py 2>&1 \
        | tee "$results/faults_tests.log" | tail -8 ;;
    megatron-core)
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_megatron_core.py 2>&1 | tee "$results/megatron_core_tests.log" | tail -8 ;;
    megatron-lm-*)
      local ids
      ids=$(megatron_lm_slice "${name#megatron-lm-}")
      if [ -z "$ids" ]; then
        echo "$name: no tests in its slice"  # pytest given no ids would run every test
      else
        # One argument per test id (ids hold no spaces).
        # shellcheck disable=SC2086
        python3 -m pytest -q -p no:cacheprovider $ids 2>&1 | tee "$results/${name//-/_}_tests.log" | tail -8
      fi ;;
    train)
      if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --steps 60 2>&1 | tail -8 | tee "$results/train_gpt.log"
      else
        echo "train: needs 2 GPUs, skipped"
      fi ;;
  esac
  echo "part $name: $((SECONDS - start)) s" | tee -a "$results/part_times.txt"
}

case " $PARTS all " in
  *" $part "*) ;;
  *) echo "unknown part '$part': ${PARTS// /, } or all" >&2; exit 2 ;;
esac
build
if [ "$part" = all ]; then
  for name in $PARTS; do run_part "$name"; done
else
  run_part "$part"
fi
