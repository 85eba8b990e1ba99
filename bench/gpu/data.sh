#!/usr/bin/env bash
# The data plane on the GPU machine. One part per call.
# Usage (repo root, on the GPU machine): bash bench/gpu/data.sh OUT_DIR PART [ARGS...]
# Parts, one line each (the comment above each part_ function below gives the details):
#   data                          the 1.4b's data wait with the plane feeding it; bench/data.py's throughput and memory
# Each part writes its logs, metrics and summaries into OUT_DIR (made if missing).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Data plane on the GPU machine: (b) the 1.4b trainer's data wait with the plane feeding it, then bench/data.py
# ((a) loader throughput at 1-8 workers, (c) proportional memory at 1-4 ranks against DataLoader).
part_data() {
  cache_env
  s=$(date +%s)
  timeout 230 python3 -m holotrain.cli train --config 1.4b --training.steps=50 "${NO_CKPT[@]}" \
    --data.workers=8 --job.run_dir=/tmp/run-1.4b --profile.progress=false > "$out/1.4b.log" 2>&1
  echo "1.4b run: rc=$? $(( $(date +%s) - s )) s"; tail -4 "$out/1.4b.log"; cp /tmp/run-1.4b/metrics.jsonl "$out/1.4b-metrics.jsonl"
  timeout 170 python3 bench/data.py --workers 1,2,4,8 --seconds 5 --ranks 1,2,4 --mem-steps 10 --out "$out/data.json" 2>&1 | grep "{"
}

dispatch "$@"
