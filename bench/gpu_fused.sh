#!/usr/bin/env bash
# The fused projections (q/k/v and gate/up as one GEMM each, model/llama.py: project) and the "pointwise"
# activation checkpointing on one H200, one part per call:
#   speed   bench/peers.py at the 1.4b, B=8: the compile + torchao float8 peer beside holotrain FP8 with the
#           projections separate ("unfused", as before), fused, and fused with the head in FP8 too; then
#           `holotrain train --config 1.4b --training.fp8=tensorwise` for STEPS steps (tokens/s and the run's J/token)
#   memory  `holotrain train --config 1.4b --training.batch_size=16` (bf16) for STEPS steps: no checkpointing with the
#           whole loss (the baseline), against "pointwise" (its loss in pieces of 8192 tokens: the fused head)
# Usage (repo root, on the GPU machine): bash bench/gpu_fused.sh OUT_DIR PART [STEPS]
set -uo pipefail
out=${1:?output directory}; part=${2:?speed or memory}; steps=${3:-60}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
train=(python3 -m holotrain.cli train --config 1.4b --training.steps="$steps" --profile.progress=false
       --profile.report=false --profile.tensorboard=false --checkpoint.every=0 --checkpoint.save_final=false)
run() {  # name, extra args
  local name=$1; shift
  s=$SECONDS
  timeout 240 "${train[@]}" --job.run_dir=/tmp/fused-$name "$@" > "$out/$name.log" 2>&1
  echo "== $name: rc $? in $(( SECONDS - s )) s"; grep -i "error\|holotrain: fp8\|checkpointing" "$out/$name.log" | head -3
  cp /tmp/fused-$name/metrics.jsonl "$out/$name.jsonl"; rm -rf /tmp/fused-$name
}
case $part in
  speed)
    timeout 330 python3 bench/peers.py --preset 1.4b --seq-len 2048 --batch 8 --out "$out/peers.json" \
      --variants compile-float8,holotrain-fp8-unfused,holotrain-fp8,holotrain-fp8-fp8head 2>&1 \
      | grep -v -i "warn" | tail -8
    run fp8 --training.fp8=tensorwise
    names=fp8 ;;
  memory)
    run whole --training.batch_size=16 --memory.loss_chunk_tokens=0
    run pointwise --training.batch_size=16 --memory.activation_checkpointing=pointwise
    names=whole,pointwise ;;
  *) echo "unknown part $part (speed or memory)"; exit 2 ;;
esac
python3 - "$out" "$names" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
for name in sys.argv[2].split(","):
    r = rows(out, name)
    if r:
        print(f"{name}: tokens/s over steps 21+ {training_rate(r, 20):,.0f}; peak {max(x.get('mem.peak_gb') or 0 for x in r):.1f}"
              f" GB (reserved {max(x.get('mem.reserved_gb') or 0 for x in r):.1f}); mfu (last row) {r[-1].get('mfu')}; "
              f"run J/1k tokens {(r[-1].get('energy.run_j_per_token') or 0) * 1e3:.2f}; "
              f"losses {[round(x['loss'], 4) for x in r]}")
PY
