#!/usr/bin/env bash
# Checkpoints that do not stop training, measured through `holotrain train` on the shipped 1.4b config (one H200):
#   plain    200 steps, checkpoint.every=100: the blocking part of each save (time.checkpoint) and tokens/s while
#            a save is written in the background (steps 101-200) against before it (steps 21-100)
#   offload  the same model with memory.offload = true (states in host memory), 40 steps, a save every 20
#   resume   the plain run continued for 10 steps after its step-200 checkpoint: process start to first new step
# Usage (repo root, on the GPU machine): bash bench/gpu_checkpoint.sh OUT_DIR [PARTS]   PARTS: plain,offload,resume
set -uo pipefail
out=${1:?output directory}
parts=${2:-plain,offload,resume}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
common=(--config 1.4b --profile.progress=false --profile.report=false --profile.tensorboard=false)
for part in ${parts//,/ }; do
  s=$SECONDS
  case $part in
    plain) timeout 300 python3 -m holotrain.cli train "${common[@]}" --training.steps=200 --checkpoint.every=100 \
             --job.run_dir=/tmp/ck-plain > "$out/plain.log" 2>&1
           cp /tmp/ck-plain/metrics.jsonl "$out/plain.jsonl" ;;
    offload) rm -rf /tmp/ck-plain/checkpoints/step-100  # disk: two 1.4b checkpoints are 34 GB
           timeout 240 python3 -m holotrain.cli train "${common[@]}" --memory.offload=true --training.steps=40 \
             --checkpoint.every=20 --checkpoint.keep=1 --job.run_dir=/tmp/ck-offload > "$out/offload.log" 2>&1
           cp /tmp/ck-offload/metrics.jsonl "$out/offload.jsonl"; rm -rf /tmp/ck-offload ;;
    resume) date +%s.%N > "$out/resume.start"
           timeout 200 python3 -m holotrain.cli train "${common[@]}" --training.steps=210 --training.log_every=1 \
             --checkpoint.every=100 --checkpoint.save_final=false --job.run_dir=/tmp/ck-plain > "$out/resume.log" 2>&1
           tail -n 10 /tmp/ck-plain/metrics.jsonl > "$out/resume.jsonl" ;;
  esac
  echo "== $part: rc $? in $(( SECONDS - s )) s"; grep -v -i warn "$out/$part.log" | tail -3
done
python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def rows(name):
    p = out / f"{name}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()] if p.is_file() else []
for name, every in (("plain", 100), ("offload", 20)):
    r = rows(name)
    if not r:
        continue
    log = r[1]["step"] - r[0]["step"] if len(r) > 1 else 1
    saves = [(x["step"], x["time.checkpoint"] * log, x.get("checkpoint.write_s")) for x in r if x.get("time.checkpoint")]
    print(f"{name}: blocking per save (s, in the row after it) {[(s, round(b, 3)) for s, b, _ in saves]}; "
          f"background writes (s) {[w for *_, w in saves if w]}")
    before = [x["tokens_per_s"] for x in r if 2 * log < x["step"] <= every]
    during = [x["tokens_per_s"] for x in r if every < x["step"] <= 2 * every]
    if before and during:
        print(f"{name}: tokens/s median, steps {2 * log + 1}-{every}: {statistics.median(before):,.0f}; steps "
              f"{every + 1}-{2 * every} (a save written in the background): {statistics.median(during):,.0f}; "
              f"ratio {statistics.median(during) / statistics.median(before):.3f}")
r = rows("resume")
start = out / "resume.start"
if r and start.is_file():
    print(f"resume: process start to step {r[0]['step']} logged: {r[0]['wall_time'] - float(start.read_text()):.1f} s")
PY
