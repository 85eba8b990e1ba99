#!/usr/bin/env bash
# The fused output head through `holotrain train` on the shipped 1.4b config at B=16 (one H200; bf16, no
# activation checkpointing, compiled, clipping on, the embedded corpus): the whole loss at once
# (memory.loss_chunk_tokens=0) against the fused head in pieces of 8192 tokens, the fused head with FP8, and the
# fused head under "pointwise" activation checkpointing (its loss in pieces automatically).
# Usage (repo root, on the GPU machine): bash bench/gpu_head.sh OUT_DIR [STEPS]
set -uo pipefail
out=${1:?output directory}; steps=${2:-60}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
train=(python3 -m holotrain.cli train --config 1.4b --training.batch_size=16 --training.steps="$steps"
       --profile.progress=false --profile.report=false --profile.tensorboard=false --checkpoint.every=0
       --checkpoint.save_final=false)
run() {  # name, extra args
  local name=$1; shift
  s=$SECONDS
  timeout 200 "${train[@]}" --job.run_dir=/tmp/head-$name "$@" > "$out/$name.log" 2>&1
  echo "== $name: rc $? in $(( SECONDS - s )) s"; grep -i "error\|holotrain: fp8" "$out/$name.log" | head -3
  cp /tmp/head-$name/metrics.jsonl "$out/$name.jsonl"; rm -rf /tmp/head-$name
}
run whole --memory.loss_chunk_tokens=0
run fused --memory.loss_chunk_tokens=8192
run fused-fp8 --memory.loss_chunk_tokens=8192 --training.fp8=tensorwise
run pointwise --memory.activation_checkpointing=pointwise
python3 - "$out" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
for name in ("whole", "fused", "fused-fp8", "pointwise"):
    r = rows(out, name)
    if r:
        print(f"{name}: tokens/s over steps 21+ {training_rate(r, 20):,.0f}; peak {max(x.get('mem.peak_gb') or 0 for x in r):.1f} GB"
              f" (reserved {max(x.get('mem.reserved_gb') or 0 for x in r):.1f}); losses {[round(x['loss'], 4) for x in r]}")
PY
