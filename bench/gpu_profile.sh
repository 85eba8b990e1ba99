#!/usr/bin/env bash
# Issue-4 figures on the GPU machine: hw probe, profiler/telemetry overhead and energy checks (bench/telemetry.py),
# the default run and a 1.4b trainer run with traces, each ending with its report.html.
# Usage (repo root, on the GPU machine): bash bench/gpu_profile.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
s=$(date +%s); python3 -m holotrain.cli hw probe --out "$out/hw_probe.json" 2>&1 | tail -2
echo "probe: $(( $(date +%s) - s )) s"
s=$(date +%s); timeout 330 python3 bench/telemetry.py --out "$out/telemetry.json" 2>&1 | grep -v Warning | tail -8
echo "bench/telemetry.py: $(( $(date +%s) - s )) s"
s=$(date +%s); python3 -m holotrain.cli train --job.run_dir=/tmp/run-default --profile.progress=false > /tmp/default.log 2>&1
echo "default run: rc=$? $(( $(date +%s) - s )) s"; tail -2 /tmp/default.log
cp /tmp/run-default/report.html "$out/report-default.html"; tail -1 /tmp/run-default/metrics.jsonl
s=$(date +%s); timeout 200 python3 -m holotrain.cli train --config 1.4b --training.steps=40 --checkpoint.every=0 \
  --checkpoint.save_final=false --job.run_dir=/tmp/run-1.4b --profile.progress=false --profile.trace_steps=21,22 > /tmp/1.4b.log 2>&1
echo "1.4b run: rc=$? $(( $(date +%s) - s )) s"; tail -3 /tmp/1.4b.log
cp /tmp/run-1.4b/metrics.jsonl "$out/1.4b-metrics.jsonl"; cp /tmp/run-1.4b/report.html "$out/report-1.4b.html"
ls -la /tmp/run-1.4b/traces; wc -l /tmp/run-1.4b/telemetry.jsonl
python3 - <<'PY'
from holotrain.hw.dvfs import analyze, load_telemetry, summarize
from holotrain.jsonl import read_jsonl
r = analyze(load_telemetry("/tmp/run-1.4b/telemetry.jsonl"), read_jsonl("/tmp/run-1.4b/metrics.jsonl"))
print("\n".join(summarize(r)))
print({k: r.get(k) for k in ("energy_j", "energy_j_integrated", "sustained_clock_mhz", "burst_clock_mhz", "clock_loss_frac", "clock_normalized_mfu")})
PY
python3 -m pytest -n 0 -q tests/test_gpu.py tests/test_telemetry.py 2>&1 | tail -3
