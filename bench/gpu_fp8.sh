#!/usr/bin/env bash
# FP8 training through `holotrain train` on the shipped 1.4b config (one H200, its defaults otherwise: clipping on,
# the embedded corpus, B=8, T=2048, compiled): bf16 against training.fp8=tensorwise in the same call, and what
# training.fp8=auto decides. Usage (repo root, on the GPU machine): bash bench/gpu_fp8.sh OUT_DIR [FP8_STEPS] [BF16_STEPS]
# RECIPE=delayed trains the FP8 run with training.fp8 = delayed; BF16_STEPS=0 skips the bf16 run, AUTO=0 the auto one.
set -uo pipefail
out=${1:?output directory}; fp8_steps=${2:-300}; bf16_steps=${3:-150}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
train=(python3 -m holotrain.cli train --config 1.4b --profile.progress=false --profile.report=false
       --profile.tensorboard=false --checkpoint.every=0 --checkpoint.save_final=false)
run() {  # name, steps, extra args
  local name=$1 steps=$2; shift 2
  s=$SECONDS
  timeout 280 "${train[@]}" --training.steps="$steps" --job.run_dir=/tmp/fp8-$name "$@" > "$out/$name.log" 2>&1
  echo "== $name: rc $? in $(( SECONDS - s )) s"; grep -v -i "warn\|Failed to load" "$out/$name.log" | grep holotrain: | head -3
  cp /tmp/fp8-$name/metrics.jsonl "$out/$name.jsonl"; rm -rf /tmp/fp8-$name
}
recipe=${RECIPE:-tensorwise}
run fp8 "$fp8_steps" --training.fp8="$recipe"
[ "$bf16_steps" -gt 0 ] && run bf16 "$bf16_steps"
[ "${AUTO:-1}" = 1 ] && run auto 20 --training.fp8=auto
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
fp8, bf16 = rows(out, "fp8"), rows(out, "bf16")
for name, r in (("bf16", bf16), ("fp8", fp8)):
    if r:  # run totals for energy (the acceptance's measure); the last row's loss against bf16's 300-step 4.7587
        print(f"{name}: {training_rate(r, 20):,.0f} tokens/s over steps 21-{r[-1]['step']}; peak memory "
              f"{max(x.get('mem.peak_gb') or 0 for x in r):.1f} GB; MFU (last row) {r[-1].get('mfu')}; J per 1k "
              f"tokens (run) {r[-1]['energy.run_j_per_token'] * 1e3:.2f}; loss at {r[-1]['step']}: {r[-1]['loss']:.4f}")
if fp8 and bf16:
    a, b = training_rate(bf16, 20), training_rate(fp8, 20)
    print(f"tokens/s over steps 21+: bf16 {a:,.0f}; fp8 {b:,.0f}; ratio {b / a:.3f}")
    la = {r["step"]: r["loss"] for r in bf16}; lb = {r["step"]: r["loss"] for r in fp8}
    print("loss by step (bf16, fp8):", [(s, round(la[s], 4), round(lb[s], 4)) for s in sorted(la) if s in lb and s % 50 == 0])
PY
