#!/usr/bin/env bash
# Data plane on the GPU machine: (b) the 1.4b trainer's data wait with the plane feeding it, then bench/data.py.
# Usage (repo root, on the GPU machine): bash bench/gpu_data.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
s=$(date +%s)
timeout 230 python3 -m holotrain.cli train --config 1.4b --training.steps=50 --checkpoint.every=0 \
  --checkpoint.save_final=false --data.workers=8 --job.run_dir=/tmp/run-1.4b --profile.progress=false > "$out/1.4b.log" 2>&1
echo "1.4b run: rc=$? $(( $(date +%s) - s )) s"; tail -4 "$out/1.4b.log"; cp /tmp/run-1.4b/metrics.jsonl "$out/1.4b-metrics.jsonl"
timeout 170 python3 bench/data.py --workers 1,2,4,8 --seconds 5 --ranks 1,2,4 --mem-steps 10 --out "$out/data.json" 2>&1 | grep "{"
