#!/usr/bin/env bash
# Model families on one GPU, through `holotrain train` with the shipped configs and their defaults plus
# training.fp8=auto: the 1.4b (llama) and the Qwen3-1.7B shape (qwen3), 120 steps each in one call, each row's
# tokens/s and MFU in its metrics.jsonl (the median of the logged rows after step 30 is printed). Then the fp8 peer
# (compile + torchao float8, bench/peers.py) beside the 1.4b, and the planner's first prediction (before any trial)
# for both configs and for the 1.4b at T=8192, B=4 with hw.gpu_memory_gb=40, against the measured run.
# Usage (repo root, on the GPU machine): bash bench/gpu_families.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
median() {  # median tokens_per_s and mfu of the rows after step 30 of a metrics.jsonl
  python3 - "$1" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
rows = [r for r in rows if r.get("step", 0) > 30 and r.get("tokens_per_s")]
print(f"tokens/s {statistics.median(r['tokens_per_s'] for r in rows):,.0f}  "
      f"mfu {statistics.median(r['mfu'] for r in rows if r.get('mfu') is not None):.3f}  ({len(rows)} rows)")
PY
}
for job in "1.4b" "qwen3-1.7b" "1.4b --data.seq_len=8192 --training.batch_size=4 --hw.gpu_memory_gb=40"; do
  name=$(echo "$job" | tr ' =.' '___' | tr -s '_'); run=/tmp/run-$name; rm -rf "$run"
  python3 -m holotrain.cli plan --config $job > "$out/$name-plan.log" 2>&1
  echo "$job: plan rc=$? $(grep -m1 -iE 'predict|tokens/s' "$out/$name-plan.log")"
  python3 -m holotrain.cli train --config $job --training.fp8=auto --training.steps=120 --job.run_dir=$run \
    --checkpoint.save_final=false --profile.progress=false > "$out/$name.log" 2>&1
  echo "$job: train rc=$? $(median $run/metrics.jsonl)"; grep -E "fp8|checkpointing" "$out/$name.log" | head -3
  cp "$run/metrics.jsonl" "$out/$name-metrics.jsonl"
done
python3 bench/peers.py --variants compile-float8,holotrain-fp8 > "$out/peers-fp8.log" 2>&1; tail -5 "$out/peers-fp8.log"
