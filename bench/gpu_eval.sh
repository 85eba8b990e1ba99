#!/usr/bin/env bash
# Validation's cost and generation's speed on one GPU, through the real commands:
#   cost  the 1.4b with training.fp8=auto, STEPS steps, an eval of 10 batches (of the embedded corpus's two sources,
#         from a 5% hold-out) every 100 steps, against eval.every=0, one after the other
#   gen   the eval run's final checkpoint exported (`holotrain export`), then bench/generate_speed.py: 256 new tokens at
#         batch 1, holotrain generate against transformers' generate() on the export
# Usage (repo root, on the GPU machine): bash bench/gpu_eval.sh OUT_DIR [PARTS] [STEPS]   (PARTS: "cost gen")
set -uo pipefail
out=${1:?output directory}; parts=${2:-cost gen}; steps=${3:-300}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
train=(python3 -m holotrain.cli train --config 1.4b --training.fp8=auto --training.steps="$steps" --checkpoint.every=0
       --profile.progress=false --profile.tensorboard=false --eval.holdout=0.05)
for part in $parts; do case $part in
  cost) for run in eval noeval; do
          extra=(--eval.every=100 --eval.batches=10 --checkpoint.save_final=true)
          [ $run = noeval ] && extra=(--eval.every=0 --checkpoint.save_final=false)
          s=$SECONDS; timeout 280 "${train[@]}" "${extra[@]}" --job.run_dir=/tmp/eval-$run > "$out/$run.log" 2>&1
          echo "== $run: rc $? in $(( SECONDS - s )) s"; grep -E "^holotrain: (eval|goodput)" "$out/$run.log"
          cp /tmp/eval-$run/metrics.jsonl "$out/$run.jsonl"
        done
        python3 bench/eval_summary.py "$out" ;;
  gen) python3 -m holotrain.cli export /tmp/eval-eval /tmp/eval-hf > "$out/export.log" 2>&1; echo "== export: rc $?"
       timeout 300 python3 bench/generate_speed.py /tmp/eval-eval /tmp/eval-hf ${STATIC:+--static} 2>&1 \
         | grep -v -i warn | tee "$out/generate.log" ;;
esac; done
