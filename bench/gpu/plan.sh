#!/usr/bin/env bash
# The planner on one GPU, through the real commands. One part per call.
# Usage (repo root, on the GPU machine): bash bench/gpu/plan.sh OUT_DIR PART [ARGS...]
# Parts, one line each (the comment above each part_ function below gives the details and the environment knobs):
#   plan [CONFIG] [STEPS] [overrides ...]  `holotrain plan` on a shipped config, then planned and default trained
#   plan_cases CASE [WHERE] [STEPS]        one case of the planner's choice checked (CASE: a, b, c, off16 or bd)
# Each part writes its logs, plans, metrics and summaries into OUT_DIR (made if missing).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# The planner on one GPU, through the real commands: `holotrain plan` on a shipped config (timed), then the planned
# setting and the shipped defaults trained for STEPS steps each through `holotrain train`, in the same call.
# Defaults: CONFIG 1.4b, STEPS 60; overrides go to both `holotrain plan` and `holotrain train`;
# RUNS="planned default" picks the trained runs.
part_plan() {
  local config=${1:-1.4b} steps=${2:-60}
  shift 2 2>/dev/null || shift $#
  cache_env
  local quiet=(--profile.progress=false --profile.tensorboard=false)
  logged plan "$out/plan.log" 400 python3 -m holotrain.cli plan --config "$config" --out "$out/plan" "${quiet[@]}" "$@"
  tail -25 "$out/plan.log"
  for run in ${RUNS:-planned default}; do
    extra=(); [ $run = planned ] && extra=(--plan "$out/plan/plan.toml")
    logged "$run" "$out/$run.log" 300 python3 -m holotrain.cli train --config "$config" "${extra[@]}" "${quiet[@]}" "$@" \
      --training.steps="$steps" --checkpoint.save_final=false --job.run_dir=/tmp/plan-$run
    grep holotrain: "$out/$run.log" | grep -v -i warn | tail -3
    cp /tmp/plan-$run/report.html "$out/$run-report.html" 2>/dev/null
    keep_metrics /tmp/plan-$run "$run"
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
}

# The planner's choice on one H200 for the cases beyond the 1.4b, through the real commands, one case per call
# (each fits the device's 10-minute call):
#   a      the 1.4b: `holotrain plan` timed, then every setting one change away from the planned one
#          (bench/plan.py exhaustive --neighbours: each other value of each key the plan chose)
#   b      the 7B (configs/offload.toml) under hw.gpu_memory_gb=24: `holotrain plan` timed, then every fitting
#          compiled setting trained (bench/plan.py exhaustive); WHERE narrows it further (k=v,k=v)
#   c      the 14B (configs/14b.toml): the same
#   off16  the 1.4b at B=16 with memory.offload=true held, so the plan chooses the ratio: the planned setting, and
#          the same setting with offload switched off (the command line wins over the plan), STEPS steps each (the
#          target: >= 0.90x of no offload)
#   bd     the 7B under hw.gpu_memory_gb=24 with memory.offload_delayed_update=true: planned, then the planned
#          setting trained STEPS steps with and without the delayed update (the target: >= 40% MFU); BATCH=12
#          sets the batch (the shipped config's is 8); RUNS picks the runs among "delayed ordinary bf16" (bf16:
#          the delayed update with training.fp8=none, the planned setting's bf16 neighbour)
# Default STEPS: 40.
part_plan_cases() {
  local part=${1:?a, b, c, off16 or bd} where=${2:-} steps=${3:-40}
  cache_env
  local filters=(--where training.compile=true)
  for w in ${where//,/ }; do filters+=(--where "$w"); done
  local quiet=(--profile.progress=false --profile.tensorboard=false --profile.report=false)
  case $part in
    a) python3 bench/plan.py exhaustive --config 1.4b --neighbours --out "$out/a" ;;
    b) python3 bench/plan.py exhaustive --config offload "${filters[@]}" --out "$out/b" --hw.gpu_memory_gb=24 ;;
    c) python3 bench/plan.py exhaustive --config 14b "${filters[@]}" --out "$out/c" ;;
    off16)
      job=(--config 1.4b --training.batch_size=16)
      s=$SECONDS
      python3 -m holotrain.cli plan "${job[@]}" --memory.offload=true --out "$out/off16-plan" "${quiet[@]}" \
        > "$out/off16-plan.log" 2>&1
      echo "== plan: rc $? in $(( SECONDS - s )) s"; grep -v -i warn "$out/off16-plan.log" | tail -4
      for run in planned nooffload; do
        extra=(--plan "$out/off16-plan/plan.toml"); [ $run = nooffload ] && extra+=(--memory.offload=false)
        python3 -m holotrain.cli train "${job[@]}" "${extra[@]}" "${quiet[@]}" --training.steps="$steps" \
          --checkpoint.save_final=false --job.run_dir=/tmp/off16-$run > "$out/off16-$run.log" 2>&1
        echo "== $run: rc $?"; cp /tmp/off16-$run/metrics.jsonl "$out/off16-$run.jsonl"; rm -rf /tmp/off16-$run
      done
      python3 - "$out" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
rates = {name: training_rate(rows(out, name), 10) for name in ("off16-planned", "off16-nooffload")}
print(f"tokens/s over steps 11+: planned (offload held) {rates['off16-planned']:,.0f}, no offload "
      f"{rates['off16-nooffload']:,.0f}: {rates['off16-planned'] / rates['off16-nooffload']:.3f}x")
PY
      ;;
    bd)
      job=(--config offload --hw.gpu_memory_gb=24 ${BATCH:+--training.batch_size=$BATCH})
      s=$SECONDS
      python3 -m holotrain.cli plan "${job[@]}" --memory.offload_delayed_update=true --out "$out/bd-plan" \
        "${quiet[@]}" > "$out/bd-plan.log" 2>&1
      echo "== plan: rc $? in $(( SECONDS - s )) s"; grep -v -i warn "$out/bd-plan.log" | tail -4
      for run in ${RUNS:-delayed ordinary}; do
        on=true; [ $run = ordinary ] && on=false
        fp8=(); [ $run = bf16 ] && fp8=(--training.fp8=none)
        python3 -m holotrain.cli train "${job[@]}" --plan "$out/bd-plan/plan.toml" --memory.offload_delayed_update=$on \
          "${fp8[@]}" \
          "${quiet[@]}" --training.steps="$steps" --checkpoint.save_final=false --job.run_dir=/tmp/bd-$run \
          > "$out/bd-$run.log" 2>&1
        echo "== $run: rc $?"; cp /tmp/bd-$run/metrics.jsonl "$out/bd-$run.jsonl"; rm -rf /tmp/bd-$run
      done
      python3 - "$out" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, run_line
out = Path(sys.argv[1])
for name in ("bd-delayed", "bd-ordinary", "bd-bf16"):
    if r := rows(out, name):
        print(run_line(name, r, 10, "time.offload_wait", "offload.release_wait_s", "offload.cpu_step_s"))
PY
      ;;
    *) echo "unknown part $part (a, b, c, off16 or bd)"; exit 2 ;;
  esac
}

dispatch "$@"
