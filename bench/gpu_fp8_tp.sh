#!/usr/bin/env bash
# FP8 under tensor parallelism on 2 GPUs (nvidia-h200-x2), through `holotrain train` on the shipped 1.4b-tp2
# config (TP=2, tp_overlap none, eager blocks, B=8, T=2048, clipping on, the embedded corpus): bf16 against
# training.fp8=tensorwise, and tensorwise with compiled blocks, in the same call.
# Usage (repo root): bash bench/gpu_fp8_tp.sh OUT_DIR [STEPS]
set -uo pipefail
out=${1:?output directory}; steps=${2:-40}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1
train=(torchrun --standalone --nproc_per_node=2 -m holotrain.cli train --config 1.4b-tp2 --profile.progress=false
       --profile.report=false --profile.tensorboard=false --checkpoint.every=0 --checkpoint.save_final=false
       --training.log_every=5 --training.steps="$steps")
for part in bf16 fp8 fp8-compiled; do
  s=$SECONDS
  case $part in
    bf16) extra=() ;;
    fp8) extra=(--training.fp8=tensorwise) ;;
    fp8-compiled) extra=(--training.fp8=tensorwise --training.compile=true) ;;
  esac
  timeout 200 "${train[@]}" "${extra[@]}" --job.run_dir=/tmp/fp8-tp-$part > "$out/tp-$part.log" 2>&1
  echo "== tp2 $part: rc $? in $(( SECONDS - s )) s"; grep -v -i "warn\|Failed to load" "$out/tp-$part.log" | grep holotrain: | head -3
  cp /tmp/fp8-tp-$part/metrics.jsonl "$out/tp-$part.jsonl" 2>/dev/null; rm -rf /tmp/fp8-tp-$part
done
python3 - "$out" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
for name in ("tp-bf16", "tp-fp8", "tp-fp8-compiled"):
    r = rows(out, name)
    if r:
        print(f"{name}: tokens/s over steps 11+ {training_rate(r, 10):,.0f}; mfu (last row) {r[-1].get('mfu')}; "
              f"peak memory {max(x.get('mem.peak_gb') or 0 for x in r):.1f} GB; loss {[round(x['loss'], 3) for x in r]}")
PY
