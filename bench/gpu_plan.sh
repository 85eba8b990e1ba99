#!/usr/bin/env bash
# The planner on one GPU, through the real commands: `holotrain plan` on a shipped config (timed), then the planned
# setting and the shipped defaults trained for STEPS steps each through `holotrain train`, in the same call.
# Usage (repo root, on the GPU machine): [RUNS="planned default"] bash bench/gpu_plan.sh OUT_DIR [CONFIG] [STEPS] [overrides ...]
set -uo pipefail
out=${1:?output directory}; config=${2:-1.4b}; steps=${3:-60}; shift 3 2>/dev/null || shift $#
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
quiet=(--profile.progress=false --profile.tensorboard=false)
s=$SECONDS
timeout 400 python3 -m holotrain.cli plan --config "$config" --out "$out/plan" "${quiet[@]}" "$@" > "$out/plan.log" 2>&1
echo "== plan: rc $? in $(( SECONDS - s )) s"; tail -25 "$out/plan.log"
for run in ${RUNS:-planned default}; do
  s=$SECONDS
  extra=(); [ $run = planned ] && extra=(--plan "$out/plan/plan.toml")
  timeout 300 python3 -m holotrain.cli train --config "$config" "${extra[@]}" "${quiet[@]}" "$@" \
    --training.steps="$steps" --checkpoint.save_final=false --job.run_dir=/tmp/plan-$run > "$out/$run.log" 2>&1
  echo "== $run: rc $? in $(( SECONDS - s )) s"; grep holotrain: "$out/$run.log" | grep -v -i warn | tail -3
  cp /tmp/plan-$run/metrics.jsonl "$out/$run.jsonl"; cp /tmp/plan-$run/report.html "$out/$run-report.html" 2>/dev/null
  rm -rf /tmp/plan-$run
done
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
plan = json.loads((out / "plan" / "plan.json").read_text())
print(f"plan: {plan['seconds']} s; overlay {plan['overlay']}")
for c in plan["candidates"]:
    if c["measured"]:
        p, m, t = c["predicted"], c["measured"], c["predicted_at_trial"]
        print(f"  tried {c['label']}: step {t['step_s']:.3f} s predicted before / {p['step_s']:.3f} after / "
              f"{m['step_s'] or 0:.3f} measured; GPU {p['gpu_gb']:.1f} GB predicted / {m['peak_gb'] or 0:.1f} measured"
              f"{'  CHOSEN' if c['chosen'] else ''}{'  ' + m['error'] if m['error'] else ''}")
for name in ("planned", "default"):
    r = rows(out, name)
    if r:
        print(f"{name}: tokens/s over steps 11+ {training_rate(r, 10):,.0f}; mfu {r[-1].get('mfu')}; peak "
              f"{max(x.get('mem.peak_gb') or 0 for x in r):.1f} GB")
PY
