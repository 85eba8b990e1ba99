#!/usr/bin/env bash
# The trainer itself on the GPU machine: the embedded default, the GPU tests, and the 1.4b config's real loop.
# Usage (repo root, on the GPU machine): bash bench/gpu_smoke.sh OUT_DIR
# That machine has no package index: tomli-w, torchao, pytest-xdist and execnet come as carried wheels on PYTHONPATH
# (the tests run one at a time there, -n 0: two would share the GPU).
set -uo pipefail
out=${1:?output directory}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
s=$(date +%s); python3 -m holotrain.cli train --job.run_dir=/tmp/run-default --profile.progress=false > "$out/default.log" 2>&1
echo "default run: rc=$? $(( $(date +%s) - s )) s"; tail -3 "$out/default.log"; cp /tmp/run-default/metrics.jsonl "$out/default-metrics.jsonl"
python3 -m pytest -n 0 -q tests/test_gpu.py 2>&1 | tail -3
s=$(date +%s); python3 -m holotrain.cli train --config 1.4b --training.steps=60 --checkpoint.every=0 \
  --checkpoint.save_final=false --job.run_dir=/tmp/run-1.4b --profile.progress=false > "$out/1.4b.log" 2>&1
echo "1.4b run: rc=$? $(( $(date +%s) - s )) s"; tail -4 "$out/1.4b.log"; cp /tmp/run-1.4b/metrics.jsonl "$out/1.4b-metrics.jsonl"
