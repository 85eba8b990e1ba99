#!/usr/bin/env bash
# Issue-5 figures on one H200 in one device call. The call may run 600 s; this script ends by BUDGET seconds
# (default 530): every stage gets a timeout of at most what is left, minus what the later stages need.
#   1. (a) 1.4b at B=16: no offload; offload with clipping off (a run whose norms stay under the threshold:
#          the CPU step speculates and overlaps backward) and at 1.0 (random tokens keep the norm above 1.0 for
#          these few steps: every step clips, so the CPU step waits for the norm: the worst case). ~45 s a trial.
#   2. (cpu) the CPU step's pieces on this host: memcpy and AdamW ceilings, landing/update before and after,
#          a thread sweep, the GIL test. ~20 s, no GPU.
#   3. (b) 7b under a 24 GiB GPU cap at batch 4 = micro-batch 4 (the plan: 18 GiB; micro 8 would plan 22.8 of
#          22.8 usable, too close for the one trial there is time for), without accumulation: an fp32 accumulator
#          puts a 7B at ~122 GB of host RAM, so the last session's (b), batch 16, found no micro-batch that fits,
#          fell back to 16 micro-batches of 1 and ran past the call's time. Hard-capped.
#   4. the table; 5. the GPU offload test; 6. (a) at B=8 (no offload; offload with clipping off) if time is
#      left, and the table again.
# FSDP2 CPUOffloadPolicy (B=8: 10,764 tokens/s, 2026-11-30) does not depend on this engine: not rerun.
# Usage (repo root, on the GPU machine): bash bench/gpu_offload.sh OUT_DIR [BUDGET_S]
set -uo pipefail
out=${1:?output directory}
budget=${2:-530}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
json="$out/offload.json"

# cap WANT RESERVE: WANT seconds, or less if fewer are left once RESERVE is kept for the later stages.
cap() {
  local want=$1 reserve=$2 left
  left=$(( budget - SECONDS - reserve ))
  (( left < want )) && want=$left
  (( want < 0 )) && want=0
  echo "$want"
}
# stage CAP_S NAME ARGS...: one bench command under a hard timeout, skipped when too little time is left.
stage() {
  local t=$1 name=$2
  shift 2
  if (( t < 30 )); then echo "== [$SECONDS s] $name: skipped (${t} s left for it)"; return; fi
  echo "== [$SECONDS s] $name (cap $t s)"
  timeout -k 5 "$t" python3 bench/offload.py "$@" --out "$json" 2>&1 | grep -v -i warn | tail -20
  echo "== [$SECONDS s] $name done (rc ${PIPESTATUS[0]})"
}
table() { python3 bench/offload.py --table "$json" 2>&1 | tail -40; }

stage "$(cap 200 250)" "(a) B=16" --part a --batch 16 --variants plain,offload --ratios 1.0 --clips 0,1.0 \
  --steps 6 --warmup 3 --timeout 110
stage "$(cap 45 210)" "(cpu)" --part cpu --cpu-params 128e6
t=$(cap 200 15)  # the trial's own timeout leaves the orchestrator time to write its row (an error row on timeout)
stage "$t" "(b) 7b" --part b --sizes 7b --big-batch 4 --clips 1.0 --steps 3 --warmup 2 --timeout $(( t - 15 ))
table
t=$(cap 110 0)
if (( t >= 60 )); then
  echo "== [$SECONDS s] GPU offload test (cap $t s)"
  timeout -k 5 "$t" python3 -m pytest -q -x tests/test_offload.py -m gpu -p no:cacheprovider 2>&1 | tail -5
  echo "gpu tests rc=${PIPESTATUS[0]}"
else
  echo "== [$SECONDS s] GPU offload test: skipped ($t s left)"
fi
t=$(cap 150 10)
if (( t >= 100 )); then
  stage "$t" "(a) B=8" --part a --batch 8 --variants plain,offload --ratios 1.0 --clips 0 --steps 6 --warmup 3 \
    --timeout 75
  table
fi
echo "== [$SECONDS s] end"
