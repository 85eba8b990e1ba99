#!/usr/bin/env bash
# Interrupts that save, on the GPU with the 1.4b config: SIGTERM mid-run (as a scheduler preempts), the time from the
# signal to the process's exit (finishing the step, the checkpoint's copy behind the step and its write), the exit
# code, the checkpoint of the stopped step, and a resume from it. Then the embedded default job and the GPU tests.
# Usage (repo root, on the GPU machine): bash bench/gpu_interrupt.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
run=/tmp/run-1.4b
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
