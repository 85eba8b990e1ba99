#!/usr/bin/env bash
# Tensor parallelism on the 2-GPU machine (nvidia-h200-x2), NVLink multicast off. One part per call.
# Usage (repo root, on the 2-GPU machine): bash bench/gpu/parallel.sh OUT_DIR PART [ARGS...]
# Parts, one line each (the comment above each part_ function below gives the details and the environment knobs):
#   tp [STEPS]                    fused TP kernels (bench/overlap.py): GPU tests, kernels, rounds, diag, 1.4b TP=2 e2e
#   fp8_tp [STEPS]                the shipped 1.4b-tp2 through `holotrain train`: bf16, FP8, FP8 with compiled blocks
# Each part writes its logs, tables and summaries into OUT_DIR (made if missing).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Tensor parallelism with fused compute/communication on the 2-GPU machine (nvidia-h200-x2), in one go:
#   1. the GPU kernel tests (tests/gpu_tp_worker.py), in three processes so that a lost CUDA context or a hang
#      ends only its own group: basic (symmetric-memory self-test stress, Triton GEMM alone, M=8192 and an odd
#      shape, queued calls, autograd), large (M=16384 and K=8192 shapes), model (TP=2 Llama in every mode).
#      Every case prints RUN before it starts and PASS / FAIL after, the ranks agreeing on the outcome; a failure
#      prints each failing rank's error and every rank's DIAG line (fused state: calls, workspaces, counters, error
#      word), and the fused workspaces are rebuilt before the next case.
#   2. bench/overlap.py --part kernels (the AG+GEMM / GEMM+RS table with the e2e model's op shapes, fused tiles
#      tried, efficiency, vs async-TP)
#   3. bench/overlap.py --part e2e (1.4b TP=2 tokens/s and host enqueue time for tp_overlap none / async_tp / fused,
#      one profiled step per mode)
# Each step under its own timeout, logging into OUT_DIR; a step that fails or hangs does not stop the next one.
# Short waits: ranks out of step fail within seconds (symmetric-memory barrier 20 s instead of the config's 120 s,
# spin loops 2^25 polls instead of 2^26: BARRIER_MS, SPIN_LIMIT below), and a test case that hangs is ended after
# HOLOTRAIN_TEST_CASE_S.
# Budget: about 6 minutes; at most ~9.3 (timeouts 100 + 80 + 60 + 170, e2e what is left of 560 s, 60..150).
#   4. (diag) bench/overlap.py --part diag: the SM clock per variant on the large shape, and the GPU timeline of one
#      fused / async-TP call per direction (where a fused call's time goes).
# E2E_COMPILE=0,1 runs every e2e mode both eager and with the blocks compiled (default 0: eager only); E2E_S caps
# the e2e step (default 150 s).
# STEPS: comma list of basic, large, model, kernels, e2e, diag, rounds (default basic,large,model,kernels,e2e).
# rounds: the large shape in ROUNDS (8) interleaved rounds, each variant in its power steady state; ROUNDS_ALT: comma
# list of other fused tiles measured beside (e.g. ...-c1); ROUNDS_DIAG=1: also the all-gather without waits / without
# communication, and steady-state timelines. TUNE_S: the kernels step's tile-tuning budget (default 60 s).
# BARRIER_MS, SPIN_LIMIT, PIECE_MB: the fused path's parallel.tp_barrier_ms, tp_spin_limit, tp_piece_mb, passed to
# every step as options (defaults 20000, 2^25 and the config's 4).
part_tp() {
  local steps=",${1:-basic,large,model,kernels,e2e},"
  want() { [[ $steps == *",$1,"* ]]; }
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/holotrain-triton-cache}
  local knobs="--barrier-ms ${BARRIER_MS:-20000} --spin-limit ${SPIN_LIMIT:-33554432}${PIECE_MB:+ --piece-mb $PIECE_MB}"
  local run="python3 -m torch.distributed.run --standalone --nproc_per_node=2"
  local t0=$(date +%s)
  step() { echo "== $1: rc=$2, $(( $(date +%s) - $3 )) s (total $(( $(date +%s) - t0 )) s)"; }
  errors() {  # the lines that say what went wrong, outside the per-case lines
    grep -E "\[FATAL\]|Error|error:|Timeout \(|Fatal Python|Traceback|Signal|exitcode" "$1" | grep -vE "^\[rank [0-9]\] (PASS|RUN|FAIL|DIAG)" \
      | sed -E 's/pid [0-9]+/pid N/; s/^\[rank[0-9]\]:/[rankN]:/' | sort | uniq -c | sort -rn | head -${2:-10} | cut -c1-300
  }

  { nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; nvidia-smi topo -m;
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  } > "$out/machine.txt" 2>&1
  head -4 "$out/machine.txt"; tail -1 "$out/machine.txt"

  tests() {  # group, timeout (s), per-case watchdog (s)
    local g=$1 t=$2 c=$3 s log="$out/gpu_tests_$1.log"
    s=$(date +%s)
    HOLOTRAIN_TEST_CASE_S=$c timeout "$t" $run tests/gpu_tp_worker.py --groups "$g" $knobs > "$log" 2>&1
    step "GPU tests, group $g (log gpu_tests_$g.log)" $? "$s"
    grep -E "^\[rank [0-9]\] (PASS|FAIL|DIAG|GPU TP CHECKS|torch|triton)" "$log" | cut -c1-600
    grep -q "GPU TP CHECKS" "$log" || echo "   (ended early; last case started: $(grep -E '^\[rank 0\] RUN' "$log" | tail -1 | cut -c1-200))"
    errors "$log" 8
  }
  want basic && tests basic 100 45
  want large && tests large 80 45
  want model && tests model 60 45

  if want kernels; then
  s=$(date +%s)
  timeout 170 $run bench/overlap.py --part kernels --tune-budget ${TUNE_S:-60} --watchdog 160 $knobs \
    --out "$out/kernels.json" > "$out/kernels.log" 2>&1
  step "kernel benchmark (bench/overlap.py --part kernels, log kernels.log)" $? "$s"
  [ -f "$out/kernels.md" ] && cat "$out/kernels.md"
  grep -E "^\[rank [0-9]\] DIAG" "$out/kernels.log" | cut -c1-600 | head -6
  errors "$out/kernels.log" 10
  fi
  best=$(python3 -c "import json; print(json.load(open('$out/kernels.json')).get('best_tiles', ''))" 2>/dev/null)
  best=${best:-128x256x64-s3-w8-x1}  # without a kernels step: the best tiles in bench/RESULTS.md

  if want diag; then
  s=$(date +%s)
  timeout 120 $run bench/overlap.py --part diag --e2e-tiles "$best" --watchdog 110 $knobs --out "$out/diag.json" \
    > "$out/diag.log" 2>&1
  step "diagnostics (bench/overlap.py --part diag, log diag.log)" $? "$s"
  grep -vE "^\[rank|^W[0-9]|warn" "$out/diag.log" | cut -c1-300 | head -120
  errors "$out/diag.log" 10
  fi

  if want rounds; then  # the large shape's targets in interleaved rounds (drift falls on every variant alike)
  s=$(date +%s)
  timeout 220 $run bench/overlap.py --part rounds --rounds ${ROUNDS:-8} --e2e-tiles "$best" --watchdog 210 $knobs \
    --rounds-alt "${ROUNDS_ALT:-}" --rounds-diag ${ROUNDS_DIAG:-0} \
    --out "$out/rounds.json" > "$out/rounds.log" 2>&1
  step "interleaved rounds (bench/overlap.py --part rounds, log rounds.log)" $? "$s"
  [ -f "$out/rounds.md" ] && grep -A14 "interleaved rounds" "$out/rounds.md"
  grep -A40 "steady timeline" "$out/rounds.log" | grep -v "^\[rank" | cut -c1-90 | head -150
  errors "$out/rounds.log" 10
  fi

  if want e2e; then
  s=$(date +%s)
  cap=${E2E_S:-150}  # the e2e step's cap in seconds (compiled modes need more: E2E_S=300)
  left=$(( 560 - ($(date +%s) - t0) )); [ $left -gt $cap ] && left=$cap; [ $left -lt 60 ] && left=60
  timeout $left $run bench/overlap.py --part e2e --e2e-compile "${E2E_COMPILE:-0}" --e2e-tiles "$best" --watchdog $(( left - 10 )) $knobs \
    --out "$out/e2e.json" > "$out/e2e.log" 2>&1
  step "end to end (bench/overlap.py --part e2e, log e2e.log, tiles '$best')" $? "$s"
  [ -f "$out/e2e.md" ] && cat "$out/e2e.md"
  grep -E "^\[rank [0-9]\] DIAG" "$out/e2e.log" | cut -c1-600 | head -6
  errors "$out/e2e.log" 10
  fi
  echo "== done in $(( $(date +%s) - t0 )) s; results in $out (gpu_tests_*.log, kernels.json/.md/.log, e2e.json/.md/.log)"
}

# FP8 under tensor parallelism on 2 GPUs (nvidia-h200-x2), through `holotrain train` on the shipped 1.4b-tp2
# config (TP=2, tp_overlap none, eager blocks, B=8, T=2048, clipping on, the embedded corpus): bf16 against
# training.fp8=tensorwise, and tensorwise with compiled blocks, in the same call. Default: 40 steps each.
part_fp8_tp() {
  local steps=${1:-40}
  cache_env
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  local train=(torchrun --standalone --nproc_per_node=2 -m holotrain.cli train --config 1.4b-tp2 "${QUIET[@]}"
               "${NO_CKPT[@]}" --training.log_every=5 --training.steps="$steps")
  for part in bf16 fp8 fp8-compiled; do
    case $part in
      bf16) extra=() ;;
      fp8) extra=(--training.fp8=tensorwise) ;;
      fp8-compiled) extra=(--training.fp8=tensorwise --training.compile=true) ;;
    esac
    logged "tp2 $part" "$out/tp-$part.log" 200 "${train[@]}" "${extra[@]}" --job.run_dir=/tmp/fp8-tp-$part
    grep -v -i "warn\|Failed to load" "$out/tp-$part.log" | grep holotrain: | head -3
    keep_metrics /tmp/fp8-tp-$part "tp-$part"
  done
  python3 - "$out" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
for name in ("tp-bf16", "tp-fp8", "tp-fp8-compiled"):
    r = rows(out, name)
    if r:
        print(f"{name}: tokens/s over steps 11+ {training_rate(r, 10):,.0f}; mfu (last row) {r[-1].get('mfu')}; "
              f"peak memory {max(x.get('mem.peak_gb') or 0 for x in r):.1f} GB; loss {[round(x['loss'], 3) for x in r]}")
PY
}

dispatch "$@"
