#!/usr/bin/env bash
# The 7B on one H200 without offload, bf16 against training.fp8=tensorwise, through `holotrain train` on the shipped
# 7B config (configs/offload.toml: every block recomputed, B=8, T=2048, clipping on, the embedded corpus) with
# memory.offload switched off. Usage (repo root, GPU machine): bash bench/gpu_fp8_7b.sh OUT_DIR [STEPS] [PARTS]
set -uo pipefail
out=${1:?output directory}; steps=${2:-30}; parts=${3:-bf16,fp8}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
train=(python3 -m holotrain.cli train --config offload --memory.offload=false --profile.progress=false
       --profile.report=false --profile.tensorboard=false --checkpoint.every=0 --checkpoint.save_final=false
       --training.log_every=5 --training.steps="$steps")
for part in ${parts//,/ }; do
  s=$SECONDS
  extra=(); [ "$part" = fp8 ] && extra=(--training.fp8=tensorwise)
  timeout 280 "${train[@]}" "${extra[@]}" --job.run_dir=/tmp/fp8-7b-$part > "$out/7b-$part.log" 2>&1
  echo "== 7b $part: rc $? in $(( SECONDS - s )) s"; grep -v -i "warn\|Failed to load" "$out/7b-$part.log" | tail -2
  cp /tmp/fp8-7b-$part/metrics.jsonl "$out/7b-$part.jsonl" 2>/dev/null; rm -rf /tmp/fp8-7b-$part
done
python3 - "$out" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, run_line
out = Path(sys.argv[1])
for name in ("7b-bf16", "7b-fp8"):
    if r := rows(out, name):
        print(run_line(name, r, 10) + f"; losses {[round(x['loss'], 3) for x in r]}")
PY
