#!/usr/bin/env bash
# The fused output head through `holotrain train` on the shipped 1.4b config at B=16 (one H200; bf16, no
# activation checkpointing, compiled, clipping on, the embedded corpus): the whole loss at once
# (memory.loss_chunk_tokens=0) against the fused head in pieces of 8192 tokens, the fused head with FP8, and the
# fused head under "pointwise" activation checkpointing (its loss in pieces automatically); pw8 and pw8-whole:
# "pointwise" on 8 of the 24 blocks with the loss in pieces (automatic) and whole (one piece larger than the batch),
# which tells the pieces' share of "pointwise"'s cost; offload3: the fused head with the first 3 blocks' saved
# tensors in host memory (memory.activation_offload_blocks); offload3-whole: the same with the whole loss at once;
# moments: the whole loss with AdamW's moments in bf16 (memory.adamw_moments).
# Usage (repo root, on the GPU machine): bash bench/gpu_head.sh OUT_DIR [STEPS] [RUNS]
#   RUNS: space-separated names among whole fused fused-fp8 pointwise pw8 pw8-whole offload3 offload3-whole moments
#   (default: the first four)
set -uo pipefail
out=${1:?output directory}; steps=${2:-60}; runs=${3:-whole fused fused-fp8 pointwise}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
train=(python3 -m holotrain.cli train --config 1.4b --training.batch_size=16 --training.steps="$steps"
       --profile.progress=false --profile.report=false --profile.tensorboard=false --checkpoint.every=0
       --checkpoint.save_final=false)
tags=()
run() {  # name, extra args; a name given again is logged as NAME-2, NAME-3, ...
  local name=$1 i=2; shift
  local base=$name; while [ -e "$out/$name.jsonl" ]; do name=$base-$i; i=$(( i + 1 )); done
  tags+=("$name")
  s=$SECONDS
  timeout $(( 150 + steps )) "${train[@]}" --job.run_dir=/tmp/head-$name "$@" > "$out/$name.log" 2>&1
  echo "== $name: rc $? in $(( SECONDS - s )) s"; grep -i "error\|holotrain: fp8\|activation offload" "$out/$name.log" | head -3
  cp /tmp/head-$name/metrics.jsonl "$out/$name.jsonl"; rm -rf /tmp/head-$name
}
pw8=(--memory.activation_checkpointing=pointwise --memory.activation_checkpointing_blocks=8)
for name in $runs; do
  case $name in
    whole) run whole --memory.loss_chunk_tokens=0 ;;
    fused) run fused --memory.loss_chunk_tokens=8192 ;;
    fused-fp8) run fused-fp8 --memory.loss_chunk_tokens=8192 --training.fp8=tensorwise ;;
    pointwise) run pointwise --memory.activation_checkpointing=pointwise ;;
    pw8) run pw8 "${pw8[@]}" ;;
    pw8-whole) run pw8-whole "${pw8[@]}" --memory.loss_chunk_tokens=1000000 ;;
    offload3) run offload3 --memory.loss_chunk_tokens=8192 --memory.activation_offload_blocks=3 ;;
    offload3-whole) run offload3-whole --memory.loss_chunk_tokens=0 --memory.activation_offload_blocks=3 ;;
    moments) run moments --memory.loss_chunk_tokens=0 --memory.adamw_moments=bf16 ;;
    *) echo "unknown run $name"; exit 2 ;;
  esac
done
python3 - "$out" "${tags[@]}" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
for name in sys.argv[2:]:
    r = rows(out, name)
    if r:
        peak = max(x.get("mem.peak_gb") or 0 for x in r)
        reserved = max(x.get("mem.reserved_gb") or 0 for x in r)
        print(f"{name}: tokens/s over steps 21+ {training_rate(r, 20):,.0f}; peak {peak:.1f} GB (reserved "
              f"{reserved:.1f}); losses {[round(x['loss'], 4) for x in r]}")
PY
