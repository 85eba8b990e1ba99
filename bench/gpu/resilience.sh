#!/usr/bin/env bash
# Checkpoints and interrupts on one H200, through `holotrain train` on the shipped 1.4b config. One part per call.
# Usage (repo root, on the GPU machine): bash bench/gpu/resilience.sh OUT_DIR PART [ARGS...]
# Parts, one line each (the comment above each part_ function below gives the details):
#   checkpoint [RUNS]             disk saves, RAM snapshots, kill -9 and restart, offload's saves (RUNS: see below)
#   interrupt                     SIGTERM mid-run, its checkpoint and resume; the embedded default; the GPU tests
# Each part writes its logs, metrics and summaries into OUT_DIR (made if missing).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Checkpoints that do not stop training, measured through `holotrain train` on the shipped 1.4b config (one H200,
# its defaults: clipping on, the embedded corpus). RUNS, comma-separated (default nockpt,every100,memkill,offload):
#   nockpt   300 steps without checkpoints: the reference tokens/s
#   every100 300 steps, checkpoint.every=100 (saves at 100, 200, 300, written in the background, one kept): the
#            blocking part of each save (time.checkpoint) and tokens/s over the training steps against nockpt
#   memkill  in-memory snapshots every 10 steps; the trainer is SIGKILLed after step 65 and the same command run
#            again: process start to the first new step, and the steps lost
#   offload  memory.offload = true (states in host memory), 60 steps, a disk save every 30
#   offnone  the same without checkpoints: the reference tokens/s for offload
#   offmem   offload with a disk save every 30 and an in-memory snapshot every 10
#   mem50    300 steps with an in-memory snapshot every 50 (one rank: no replica), against nockpt
part_checkpoint() {
  local parts=${1:-nockpt,every100,memkill,offload}
  cache_env
  local common=(--config 1.4b "${QUIET[@]}")
  local train=(python3 -m holotrain.cli train "${common[@]}")
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
}

# Interrupts that save, on the GPU with the 1.4b config: SIGTERM mid-run (as a scheduler preempts), the time from the
# signal to the process's exit (finishing the step, the checkpoint's copy behind the step and its write), the exit
# code, the checkpoint of the stopped step, and a resume from it. Then the embedded default job and the GPU tests.
part_interrupt() {
  cache_env
  local run=/tmp/run-1.4b
  rm -rf "$run"
  setsid python3 -m holotrain.cli train --config 1.4b --training.steps=400 --job.run_dir=$run \
    --profile.progress=false > "$out/1.4b-interrupted.log" 2>&1 &
  pid=$!
  # Wait for 5 logged rows (the 1.4b logs every 10 steps), then SIGTERM the trainer alone, as a scheduler would.
  until [ "$(wc -l < $run/metrics.jsonl 2>/dev/null || echo 0)" -ge 5 ] || ! kill -0 $pid 2>/dev/null; do sleep 0.2; done
  t0=$(date +%s.%N); kill -TERM $pid; wait $pid; rc=$?; t1=$(date +%s.%N)
  echo "1.4b SIGTERM: rc=$rc, signal to exit $(python3 -c "print(f'{$t1 - $t0:.1f}')") s"
  tail -3 "$out/1.4b-interrupted.log"
  ls $run/checkpoints; du -sh $run/checkpoints/* 2>/dev/null
  last=$(ls $run/checkpoints | sed -n 's/^step-//p' | sort -n | tail -1)
  s=$(date +%s); python3 -m holotrain.cli train --config 1.4b --training.steps=$((last + 20)) --job.run_dir=$run \
    --checkpoint.save_final=false --profile.progress=false > "$out/1.4b-resumed.log" 2>&1
  echo "1.4b resume to step $((last + 20)): rc=$? $(( $(date +%s) - s )) s"; grep -E "resuming|schedule" "$out/1.4b-resumed.log"
  tail -2 "$out/1.4b-resumed.log"; cp $run/metrics.jsonl "$out/1.4b-metrics.jsonl"
  s=$(date +%s); python3 -m holotrain.cli train --job.run_dir=/tmp/run-default --profile.progress=false > "$out/default.log" 2>&1
  echo "default run: rc=$? $(( $(date +%s) - s )) s"; tail -2 "$out/default.log"
  python3 -m pytest -n 0 -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -3
}

dispatch "$@"
