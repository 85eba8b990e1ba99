#!/usr/bin/env bash
# Sourced by the GPU benchmark entry points (bench/gpu/*.sh); not run by itself. Each entry point is one area, run
# as `bash bench/gpu/AREA.sh OUT_DIR PART [ARGS...]` from the repository root on the GPU machine: it defines one
# function part_PART per part, then calls `dispatch "$@"`, which makes OUT_DIR and runs that part with ARGS.
# Here: the shared override groups, the trainer's environment, the logged-run helpers and the dispatcher.
set -uo pipefail

# The trainer's progress bar, report and tensorboard off; no checkpoints. In the order the drivers have always used.
QUIET=(--profile.progress=false --profile.report=false --profile.tensorboard=false)
NO_CKPT=(--checkpoint.every=0 --checkpoint.save_final=false)

# cache_env: the corpus and tokenizer cache under /tmp, Python's output unbuffered (every part that trains).
cache_env() { export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1; }

# logged LABEL LOG CAP CMD...: CMD under `timeout CAP`, its stdout and stderr into LOG, then the line
# "== LABEL: rc RC in S s". Returns CMD's exit code. A trainer answers timeout's SIGTERM by finishing its step and
# saving it, which for a large model outlasts any cap: SIGKILL follows 15 s later.
logged() {
  local label=$1 log=$2 cap=$3 s=$SECONDS rc
  shift 3
  timeout -k 15 "$cap" "$@" > "$log" 2>&1
  rc=$?
  echo "== $label: rc $rc in $(( SECONDS - s )) s"
  return $rc
}

# keep_metrics RUN_DIR NAME: RUN_DIR/metrics.jsonl kept as OUT_DIR/NAME.jsonl (nothing when the run wrote none),
# then RUN_DIR removed.
keep_metrics() { cp "$1/metrics.jsonl" "$out/$2.jsonl" 2>/dev/null; rm -rf "$1"; }

# usage: the calling entry point's header comment.
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" >&2; }

# dispatch OUT_DIR PART [ARGS...]: sets out (the output directory, made here), then runs part_PART ARGS...
dispatch() {
  if [ $# -lt 2 ]; then usage; exit 2; fi
  if ! declare -F "part_$2" > /dev/null; then
    echo "unknown part '$2'; the parts: $(declare -F | sed -n 's/^declare -f part_//p' | tr '\n' ' ')" >&2
    usage
    exit 2
  fi
  out=$1
  local part=$2
  shift 2
  mkdir -p "$out"
  "part_$part" "$@"
}
