#!/usr/bin/env bash
# Checkpoints that do not stop training, measured through `holotrain train` on the shipped 1.4b config (one H200,
# its defaults: clipping on, the embedded corpus):
#   nockpt   300 steps without checkpoints: the reference tokens/s
#   every100 300 steps, checkpoint.every=100 (saves at 100, 200, 300, written in the background, one kept): the
#            blocking part of each save (time.checkpoint) and tokens/s over the training steps against nockpt
#   memkill  in-memory snapshots every 10 steps; the trainer is SIGKILLed after step 65 and the same command run
#            again: process start to the first new step, and the steps lost
#   offload  memory.offload = true (states in host memory), 60 steps, a disk save every 30
#   offnone  the same without checkpoints: the reference tokens/s for offload
#   offmem   offload with a disk save every 30 and an in-memory snapshot every 10
#   mem50    300 steps with an in-memory snapshot every 50 (one rank: no replica), against nockpt
# Usage (repo root, on the GPU machine): bash bench/gpu_checkpoint.sh OUT_DIR [PARTS]
set -uo pipefail
out=${1:?output directory}
parts=${2:-nockpt,every100,memkill,offload}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
common=(--config 1.4b --profile.progress=false --profile.report=false --profile.tensorboard=false)
train=(python3 -m holotrain.cli train "${common[@]}")
for part in ${parts//,/ }; do
  s=$SECONDS
  case $part in
    nockpt) timeout 280 "${train[@]}" --training.steps=300 --checkpoint.every=0 --checkpoint.save_final=false \
              --job.run_dir=/tmp/ck-nockpt > "$out/nockpt.log" 2>&1
            cp /tmp/ck-nockpt/metrics.jsonl "$out/nockpt.jsonl" ;;
    mem50) timeout 300 "${train[@]}" --training.steps=300 --checkpoint.every=0 --checkpoint.save_final=false \
              --checkpoint.memory_every=50 --job.run_dir=/tmp/ck-mem50 > "$out/mem50.log" 2>&1
            cp /tmp/ck-mem50/metrics.jsonl "$out/mem50.jsonl"; rm -rf /tmp/ck-mem50 ;;
    every100) timeout 300 "${train[@]}" --training.steps=300 --checkpoint.every=100 --checkpoint.keep=1 \
              --job.run_dir=/tmp/ck-every > "$out/every100.log" 2>&1
            cp /tmp/ck-every/metrics.jsonl "$out/every100.jsonl"; rm -rf /tmp/ck-every ;;
    memkill) args=(--training.steps=90 --training.log_every=1 --checkpoint.every=0 --checkpoint.save_final=false
                   --checkpoint.memory_every=10 --job.run_dir=/tmp/ck-mem)
            "${train[@]}" "${args[@]}" > "$out/memkill.log" 2>&1 & pid=$!
            python3 - "$pid" <<'PY'
import json, os, signal, sys, time
from pathlib import Path
metrics, deadline = Path("/tmp/ck-mem/metrics.jsonl"), time.time() + 200
while time.time() < deadline:
    rows = metrics.read_text().splitlines() if metrics.is_file() else []
    if rows and json.loads(rows[-1])["step"] >= 65:
        os.kill(int(sys.argv[1]), signal.SIGKILL)
        break
    time.sleep(0.01)
PY
            wait $pid; echo "killed: rc $?"
            cp /tmp/ck-mem/metrics.jsonl "$out/memkill-before.jsonl"; ls -la /dev/shm > "$out/memkill-shm.txt"
            date +%s.%N > "$out/memkill.start"
            timeout 200 "${train[@]}" "${args[@]}" > "$out/memkill-resume.log" 2>&1
            cp /tmp/ck-mem/metrics.jsonl "$out/memkill.jsonl"; rm -rf /tmp/ck-mem ;;
    offload|offnone|offmem)
            case $part in
              offload) ck=(--checkpoint.every=30) ;;
              offnone) ck=(--checkpoint.every=0 --checkpoint.save_final=false) ;;
              offmem) ck=(--checkpoint.every=30 --checkpoint.memory_every=10) ;;
            esac
            timeout 240 "${train[@]}" --memory.offload=true --training.steps=60 --training.log_every=1 \
              --checkpoint.keep=1 "${ck[@]}" --job.run_dir=/tmp/ck-$part > "$out/$part.log" 2>&1
            cp /tmp/ck-$part/metrics.jsonl "$out/$part.jsonl"; rm -rf /tmp/ck-$part ;;
  esac
  echo "== $part: rc $? in $(( SECONDS - s )) s"; grep -v -i warn "$out/$part.log" | tail -3
done
python3 bench/checkpoint_summary.py "$out"
