#!/usr/bin/env bash
# On a CUDA machine whose python3 already holds a CUDA torch: build the extension with its CUDA
# kernels, run the GPU tests, the op bandwidth benchmark and a short main job, logging to $1.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-gpu_results}
mkdir -p "$results"
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$results/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$results/device.txt"
# The system compiler: a toolchain that links its own C++ runtime into _C.so crashes it when a
# kernel's error message formats a number.
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$results/build.log" 2>&1 || { tail -40 "$results/build.log"; exit 1; }
python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_ops.py 2>&1 | tee "$results/gpu_tests.log" | tail -25
python3 benchmarks/op_bandwidth.py --out "$results/op_bandwidth.json" | tee "$results/op_bandwidth.md"
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --steps 60 2>&1 | tail -8 | tee "$results/train_gpt.log"
fi
