#!/usr/bin/env bash
# Model families on one GPU, through `holotrain train` on the shipped configs (one call, two parts):
#   mfu    the 1.4b (llama) and the Qwen3-1.7B shape (qwen3) with their defaults plus training.fp8=auto, STEPS steps
#          each: the median tokens/s and MFU of the logged rows after step 30
#   plan   the planner's first prediction (plan.trials=0: before any trial) against the planned setting trained
#          (`holotrain train --plan auto`), for the 1.4b, the Qwen3 shape and the 1.4b at T=8192, B=4 under
#          hw.gpu_memory_gb=40
#   peer   the fp8 peer (compile + torchao float8, bench/peers.py) beside holotrain's fp8 step, in one process
# Usage (repo root, on the GPU machine): bash bench/gpu_families.sh OUT_DIR [PARTS] [STEPS]   (PARTS: "mfu plan peer";
# PLANS="1.4b qwen3 1.4b-8k" picks the plan part's jobs)
set -uo pipefail
out=${1:?output directory}; parts=${2:-mfu plan peer}; steps=${3:-100}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
quiet=(--profile.progress=false --profile.tensorboard=false --checkpoint.save_final=false)
train() {  # name, args...
  local name=$1; shift; local s=$SECONDS
  timeout 300 python3 -m holotrain.cli train "$@" --training.steps="$steps" --job.run_dir=/tmp/fam-$name "${quiet[@]}" \
    > "$out/$name.log" 2>&1
  echo "== $name: rc $? in $(( SECONDS - s )) s"; grep -E "^holotrain: .*(fp8|checkpointing|goodput)" "$out/$name.log" | head -4
  cp /tmp/fam-$name/metrics.jsonl "$out/$name.jsonl"; cp /tmp/fam-$name/plan.json "$out/$name-plan.json" 2>/dev/null
  rm -rf /tmp/fam-$name
}
for part in $parts; do case $part in
  mfu) train llama-1.4b --config 1.4b --training.fp8=auto
       train qwen3-1.7b --config qwen3-1.7b --training.fp8=auto ;;
  plan) for job in ${PLANS:-1.4b qwen3 1.4b-8k}; do case $job in
          1.4b) train plan-1.4b --config 1.4b --plan auto --plan.trials=0 ;;
          qwen3) train plan-qwen3 --config qwen3-1.7b --plan auto --plan.trials=0 ;;
          qwen3-only)  # the plan alone (its prediction against the mfu part's run, where the settings agree)
            timeout 200 python3 -m holotrain.cli plan --config qwen3-1.7b --plan.trials=0 --out "$out/plan-qwen3-only" \
              > "$out/plan-qwen3-only.log" 2>&1; echo "== plan qwen3-only: rc $?"; tail -4 "$out/plan-qwen3-only.log" ;;
          1.4b-8k) train plan-1.4b-8k --config 1.4b --data.seq_len=8192 --training.batch_size=4 \
                     --hw.gpu_memory_gb=40 --plan auto --plan.trials=0 ;;
        esac; done ;;
  peer) timeout 400 python3 bench/peers.py --variants compile-float8,holotrain-fp8 > "$out/peers-fp8.log" 2>&1
        echo "== peers: rc $?"; tail -6 "$out/peers-fp8.log" ;;
esac; done
python3 bench/families_summary.py "$out"
