#!/usr/bin/env bash
# Small real Megatron-LM checkpoints of a tiny Llama-style GPT, for the offline converter's tests
# (issue 63): 4 iterations of pretrain_gpt.py on every GPU of the machine, saved by
#   ddp_torch_dist/     megatron-core's DDP with the distributed optimizer, --ckpt-format torch_dist
#   ours_fsdp_dtensor/  megatron_fsdp (--use-megatron-fsdp, optim_grads_params), --ckpt-format fsdp_dtensor
# then Megatron-LM's own forward of each on fixed tokens (tests/gpu/megatron_lm_logits.py) in
# logits_<name>.pt, each run's argument list in args_<name>.txt and its log in <name>.log.
#
#   MEGATRON_LM_DIR=... bash scripts/megatron_lm_llama_checkpoints.sh OUT_DIR [MODEL FLAGS...]
#
# MODEL FLAGS are added to the tiny Llama's (e.g. `--num-experts 4 --moe-router-topk 2` for a
# Mixtral-style model with megatron-core's SequentialMLP experts).
#
# Needs CUDA, megatron-core and MEGATRON_LM_DIR (pretrain_gpt.py, gpt_builders.py, model_provider.py
# of the tag matching the wheel); megatron_fsdp importable (PYTHONPATH).
set -uo pipefail
out=$(realpath -m "${1:?give an output folder}")
shift
repo=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$repo:$MEGATRON_LM_DIR:${PYTHONPATH:-}"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
source "$repo/scripts/megatron_lm_tiny_llama.sh"
model+=("$@")
training=(--micro-batch-size 2 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
          --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --mock-data
          --no-gradient-accumulation-fusion --log-interval 1 --eval-iters 0 --eval-interval 1000 --train-iters 4 --save-interval 4)
declare -A formats=(
  [ddp_torch_dist]="--use-distributed-optimizer --ckpt-format torch_dist"
  [ours_fsdp_dtensor]="--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy optim_grads_params"
)

entry() {  # how pretrain_gpt.py-like scripts start for checkpoint $1
  if [ "$1" = ours_fsdp_dtensor ]; then echo "-m megatron_fsdp.integrations.launch"; fi
}

train() {
  local name=$1
  # shellcheck disable=SC2206
  local flags=("${model[@]}" "${training[@]}" ${formats[$name]} --save "$out/$name")
  printf '%s\n' "${flags[@]}" > "$out/args_$name.txt"
  # shellcheck disable=SC2046
  python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" --master-port "$2" $(entry "$name") \
    "$MEGATRON_LM_DIR/pretrain_gpt.py" "${flags[@]}" > "$out/$name.log" 2>&1
  echo "train $name: exit $?"
}

logits() {
  local name=$1
  # shellcheck disable=SC2206
  local flags=("${model[@]}" ${formats[$name]} --micro-batch-size 1 --load "$out/$name" --no-load-optim --no-load-rng
               --exit-on-missing-checkpoint --seed 1234 --no-gradient-accumulation-fusion --train-iters 4 --lr 3e-4)
  # shellcheck disable=SC2046
  python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" --master-port "$2" $(entry "$name") \
    "$repo/tests/gpu/megatron_lm_logits.py" --logits-out "$out/logits_$name.pt" "${flags[@]}" > "$out/logits_$name.log" 2>&1
  echo "logits $name: exit $?"
}

train ddp_torch_dist 29511 & train ours_fsdp_dtensor 29512 & wait
logits ddp_torch_dist 29513 & logits ours_fsdp_dtensor 29514 & wait
python3 - "$out" <<'EOF'
import sys, torch
from pathlib import Path
from torch.distributed.checkpoint import FileSystemReader
out = Path(sys.argv[1])
for name in ("ddp_torch_dist", "ours_fsdp_dtensor"):
    for step in sorted((out / name).glob("iter_*")):
        metadata = FileSystemReader(str(step)).read_metadata().state_dict_metadata
        with open(out / f"keys_{name}.txt", "w") as listing:
            for key, entry in sorted(metadata.items()):
                print(key, tuple(getattr(entry, "size", ())), getattr(getattr(entry, "properties", None), "dtype", ""), file=listing)
        print(name, step.name, len(metadata), "entries")
files = {name: out / f"logits_{name}.pt" for name in ("ddp_torch_dist", "ours_fsdp_dtensor")}
if all(f.exists() for f in files.values()):
    a, b = (torch.load(f)["logits"] for f in files.values())
    print("logits", tuple(a.shape), "max |ddp - ours|", (a - b).abs().max().item())
EOF
