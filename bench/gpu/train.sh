#!/usr/bin/env bash
# Training speed on one H200, against its peers and against older trees. One part per call.
# Usage (repo root, on the GPU machine): bash bench/gpu/train.sh OUT_DIR PART [ARGS...]
# Parts, one line each (the comment above each part_ function below gives the details and the environment knobs):
#   ab OLD_DIR [PARTS]            before/after of a change: OLD_DIR's tree against this one (PARTS: peers,b,a)
#   fp8 [FP8_STEPS] [BF16_STEPS]  the 1.4b, training.fp8=tensorwise (or RECIPE) against bf16, then auto (AUTO=0: not)
#   fp8_7b [STEPS] [PARTS]        the 7B without offload, bf16 against training.fp8=tensorwise (PARTS: bf16,fp8)
#   gap [STEPS]                   the trainer's FP8 step against bench/peers.py's, traced, GPU time by kernel family
#   head [STEPS] [RUNS]           the 1.4b at B=16: whole loss, fused head, pointwise, activation offload, bf16 moments
#   rows OLD_DIR [STEPS] [ORDER]  the 1.4b's FP8 job from this tree and from OLD_DIR's, and the float8 peer
#   profile                       hw probe, telemetry overhead and energy, the default run and a traced 1.4b run
#   smoke                         the embedded default, tests/test_gpu.py and 60 steps of the 1.4b
# Each part writes its logs, metrics (NAME.jsonl) and summaries into OUT_DIR (made if missing).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Before/after speed of a change on one H200, in one device call: the same benchmarks from an older checkout of
# holotrain (OLD_DIR, holding its holotrain/ and bench/) and from this one, alternating, so both see the same card
# in the same state. Measures the peers row (bench/peers.py holotrain, 1.4b, T=2048, B=8), offload (a) (1.4b,
# B=16, ratio 1.0, clipping on) and offload (b) (7b under a 24 GiB GPU cap, micro-batch 12, clipping on).
# OLD_DIR, made here and carried: git worktree add /tmp/old REV && mkdir .base && cp -r /tmp/old/{holotrain,bench} .base/
# (with /.base/ in .git/info/exclude).
part_ab() {
  local old=${1:?older checkout} parts=${2:-peers,b,a}
  export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  ab_run() {  # ab_run TREE NAME CAP SCRIPT ARGS...: one benchmark of one tree under a hard timeout, its log under OUT
    local tree=$1 name=$2 cap=$3 script=$4
    shift 4
    echo "== [$SECONDS s] $name ($tree)"
    timeout -k 5 "$cap" python3 "$tree/bench/$script" "$@" > "$out/$name.log" 2>&1
    echo "   rc $? after $SECONDS s"
  }
  for part in ${parts//,/ }; do
    for side in old new; do
      tree=$([[ $side == old ]] && echo "$old" || echo .)
      case $part in
        peers) ab_run "$tree" "peers_$side" 150 peers.py --variants holotrain --steps 20 --warmup 6 \
                 --out "$out/peers_$side.json" ;;
        a) ab_run "$tree" "a_$side" 100 offload.py --part a --batch 16 --variants offload --ratios 1.0 --clips 1.0 \
             --steps 6 --warmup 3 --timeout 90 --out "$out/a_$side.json" ;;
        b) ab_run "$tree" "b_$side" 120 offload.py --part b --sizes 7b --big-batch 12 --micro 12 --clips 1.0 \
             --steps 3 --warmup 2 --timeout 110 --out "$out/b_$side.json" ;;
      esac
    done
  done
  python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None
for part in ("peers", "a", "b"):
    got = {}
    for side in ("old", "new"):
        r = load(f"{part}_{side}")
        if r is None:
            continue
        rows = r["rows"] if part == "peers" else r.get("runs", [])
        vals = [x.get("tokens_per_s") for x in rows if x.get("tokens_per_s")]
        mfu = [x.get("mfu") for x in rows if x.get("mfu")]
        got[side] = (vals[-1] if vals else None, mfu[-1] if mfu else None)
    o, n = got.get("old", (None, None)), got.get("new", (None, None))
    ratio = n[0] / o[0] if o[0] and n[0] else None
    print(f"{part:6} old {o[0]} tok/s (mfu {o[1]}), new {n[0]} tok/s (mfu {n[1]}), new/old {ratio}")
PY
  echo "== [$SECONDS s] end"
}

# FP8 training through `holotrain train` on the shipped 1.4b config (one H200, its defaults otherwise: clipping on,
# the embedded corpus, B=8, T=2048, compiled): bf16 against training.fp8=tensorwise in the same call, and what
# training.fp8=auto decides. RECIPE=delayed trains the FP8 run with training.fp8 = delayed; BF16_STEPS=0 (the second
# argument) skips the bf16 run, AUTO=0 the auto one. Defaults: 300 FP8 steps, 150 bf16 steps.
part_fp8() {
  local fp8_steps=${1:-300} bf16_steps=${2:-150}
  cache_env
  local train=(python3 -m holotrain.cli train --config 1.4b "${QUIET[@]}" "${NO_CKPT[@]}")
  fp8_run() {  # name, steps, extra args
    local name=$1 steps=$2
    shift 2
    logged "$name" "$out/$name.log" 280 "${train[@]}" --training.steps="$steps" --job.run_dir=/tmp/fp8-$name "$@"
    grep -v -i "warn\|Failed to load" "$out/$name.log" | grep holotrain: | head -3
    keep_metrics /tmp/fp8-$name "$name"
  }
  local recipe=${RECIPE:-tensorwise}
  fp8_run fp8 "$fp8_steps" --training.fp8="$recipe"
  [ "$bf16_steps" -gt 0 ] && fp8_run bf16 "$bf16_steps"
  [ "${AUTO:-1}" = 1 ] && fp8_run auto 20 --training.fp8=auto
  python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
fp8, bf16 = rows(out, "fp8"), rows(out, "bf16")
for name, r in (("bf16", bf16), ("fp8", fp8)):
    if r:  # run totals for energy (the acceptance's measure); the last row's loss against bf16's 300-step 4.7587
        print(f"{name}: {training_rate(r, 20):,.0f} tokens/s over steps 21-{r[-1]['step']}; peak memory "
              f"{max(x.get('mem.peak_gb') or 0 for x in r):.1f} GB; MFU (last row) {r[-1].get('mfu')}; J per 1k "
              f"tokens (run) {r[-1]['energy.run_j_per_token'] * 1e3:.2f}; loss at {r[-1]['step']}: {r[-1]['loss']:.4f}")
if fp8 and bf16:
    a, b = training_rate(bf16, 20), training_rate(fp8, 20)
    print(f"tokens/s over steps 21+: bf16 {a:,.0f}; fp8 {b:,.0f}; ratio {b / a:.3f}")
    la = {r["step"]: r["loss"] for r in bf16}; lb = {r["step"]: r["loss"] for r in fp8}
    print("loss by step (bf16, fp8):", [(s, round(la[s], 4), round(lb[s], 4)) for s in sorted(la) if s in lb and s % 50 == 0])
PY
}

# The 7B on one H200 without offload, bf16 against training.fp8=tensorwise, through `holotrain train` on the shipped
# 7B config (configs/offload.toml: every block recomputed, B=8, T=2048, clipping on, the embedded corpus) with
# memory.offload switched off. Defaults: 30 steps, PARTS bf16,fp8.
part_fp8_7b() {
  local steps=${1:-30} parts=${2:-bf16,fp8}
  cache_env
  local train=(python3 -m holotrain.cli train --config offload --memory.offload=false "${QUIET[@]}" "${NO_CKPT[@]}"
               --training.log_every=5 --training.steps="$steps")
  for part in ${parts//,/ }; do
    extra=(); [ "$part" = fp8 ] && extra=(--training.fp8=tensorwise)
    logged "7b $part" "$out/7b-$part.log" 280 "${train[@]}" "${extra[@]}" --job.run_dir=/tmp/fp8-7b-$part
    grep -v -i "warn\|Failed to load" "$out/7b-$part.log" | tail -2
    keep_metrics /tmp/fp8-7b-$part "7b-$part"
  done
  python3 - "$out" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, run_line
out = Path(sys.argv[1])
for name in ("7b-bf16", "7b-fp8"):
    if r := rows(out, name):
        print(run_line(name, r, 10) + f"; losses {[round(x['loss'], 3) for x in r]}")
PY
}

# Where the trainer's FP8 step loses against bench/peers.py's holotrain-fp8 variant (random tokens, causal attention):
# the peers with a kernel table each, then `holotrain train --config 1.4b --training.fp8=tensorwise` with a trace of
# two steps, and each trace's GPU time by kernel family. Default: 60 steps.
# PEERS=0 skips the peers; PROFILE=1 adds their kernel tables; RECIPE=delayed trains (and times the holotrain peer)
# with training.fp8 = delayed in place of tensorwise, and TENSORWISE_STEPS=N adds a tensorwise run of N steps;
# BF16_STEPS=N adds the shipped default (bf16) for N steps.
part_gap() {
  local steps=${1:-60}
  cache_env
  local recipe=${RECIPE:-tensorwise}
  local ours=holotrain-fp8$([ "$recipe" = delayed ] && echo -delayed)
  [ "${PEERS:-1}" = 1 ] && timeout 300 python3 bench/peers.py --preset 1.4b --seq-len 2048 --batch 8 \
    --variants compile-float8,holotrain-fp8$([ "$recipe" = delayed ] && echo ",$ours") \
    ${PROFILE:+--profile compile-float8,$ours} --out "$out/peers.json" > "$out/peers.log" 2>&1
  echo "== peers rc $?"; grep -v -i "warn" "$out/peers.log" | tail -6
  local t=$(( steps - 19 )),$(( steps - 18 ))
  timeout 280 python3 -m holotrain.cli train --config 1.4b --training.fp8="$recipe" --training.steps="$steps" \
    "${QUIET[@]}" "${NO_CKPT[@]}" --job.run_dir=/tmp/gap --profile.trace_steps="$t" > "$out/train.log" 2>&1
  echo "== train rc $?"; grep holotrain: "$out/train.log" | grep -v -i warn | head -3
  cp /tmp/gap/metrics.jsonl "$out/train.jsonl"; cp /tmp/gap/traces/*.json.gz "$out/" 2>/dev/null
  python3 bench/trace_families.py /tmp/gap/traces/*.json.gz
  if [ "${TENSORWISE_STEPS:-0}" -gt 0 ]; then  # torchao's tensorwise beside holotrain's delayed scaling
    timeout 250 python3 -m holotrain.cli train --config 1.4b --training.fp8=tensorwise --training.steps="$TENSORWISE_STEPS" \
      "${QUIET[@]}" "${NO_CKPT[@]}" --job.run_dir=/tmp/gap-tw > "$out/tensorwise.log" 2>&1
    echo "== tensorwise rc $?"; cp /tmp/gap-tw/metrics.jsonl "$out/tensorwise.jsonl"
  fi
  if [ "${BF16_STEPS:-0}" -gt 0 ]; then  # the shipped default (bf16) beside it
    timeout 250 python3 -m holotrain.cli train --config 1.4b --training.steps="$BF16_STEPS" \
      "${QUIET[@]}" "${NO_CKPT[@]}" --job.run_dir=/tmp/gap-bf16 > "$out/bf16.log" 2>&1
    echo "== bf16 rc $?"; cp /tmp/gap-bf16/metrics.jsonl "$out/bf16.jsonl"
  fi
  python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
peers = json.loads((out / "peers.json").read_text())["rows"] if (out / "peers.json").is_file() else []
peer = next((r["tokens_per_s"] for r in peers if r["variant"] == "compile-float8"), None)
for name in ("train", "tensorwise", "bf16"):
    r = rows(out, name)
    if not r:
        continue
    rate = training_rate(r, 20)
    last = r[-1]
    print(f"{name}: {rate:,.0f} tokens/s over steps 21-{last['step']}" + (f" = {rate / peer:.3f}x the peer" if peer else "")
          + f"; MFU (last row) {last['mfu']:.3f}; run J per 1k tokens {last['energy.run_j_per_token'] * 1e3:.2f}; "
          f"peak {max(x['mem.peak_gb'] for x in r):.1f} GB; micro-batches masked {last['data.doc_masked_share']:.2f}; "
          f"loss at {last['step']}: {last['loss']:.4f}")
PY
}

# The fused output head through `holotrain train` on the shipped 1.4b config at B=16 (one H200; bf16, no
# activation checkpointing, compiled, clipping on, the embedded corpus): the whole loss at once
# (memory.loss_chunk_tokens=0) against the fused head in pieces of 8192 tokens, the fused head with FP8, and the
# fused head under "pointwise" activation checkpointing (its loss in pieces automatically); pw8 and pw8-whole:
# "pointwise" on 8 of the 24 blocks with the loss in pieces (automatic) and whole (one piece larger than the batch),
# which tells the pieces' share of "pointwise"'s cost; offload3: the fused head with the first 3 blocks' saved
# tensors in host memory (memory.activation_offload_blocks); offload3-whole: the same with the whole loss at once;
# moments: the whole loss with AdamW's moments in bf16 (memory.adamw_moments).
# Default: 60 steps; RUNS, space-separated, among whole fused fused-fp8 pointwise pw8 pw8-whole offload3
# offload3-whole moments (default: the first four). A name given again is logged as NAME-2, NAME-3, ...
part_head() {
  local steps=${1:-60} runs=${2:-whole fused fused-fp8 pointwise}
  cache_env
  local train=(python3 -m holotrain.cli train --config 1.4b --training.batch_size=16 --training.steps="$steps"
               "${QUIET[@]}" "${NO_CKPT[@]}")
  local tags=()
  head_run() {  # name, extra args
    local name=$1 i=2
    shift
    local base=$name; while [ -e "$out/$name.jsonl" ]; do name=$base-$i; i=$(( i + 1 )); done
    tags+=("$name")
    logged "$name" "$out/$name.log" $(( 150 + steps )) "${train[@]}" --job.run_dir=/tmp/head-$name "$@"
    grep -i "error\|holotrain: fp8\|activation offload" "$out/$name.log" | head -3
    keep_metrics /tmp/head-$name "$name"
  }
  local pw8=(--memory.activation_checkpointing=pointwise --memory.activation_checkpointing_blocks=8)
  for name in $runs; do
    case $name in
      whole) head_run whole --memory.loss_chunk_tokens=0 ;;
      fused) head_run fused --memory.loss_chunk_tokens=8192 ;;
      fused-fp8) head_run fused-fp8 --memory.loss_chunk_tokens=8192 --training.fp8=tensorwise ;;
      pointwise) head_run pointwise --memory.activation_checkpointing=pointwise ;;
      pw8) head_run pw8 "${pw8[@]}" ;;
      pw8-whole) head_run pw8-whole "${pw8[@]}" --memory.loss_chunk_tokens=1000000 ;;
      offload3) head_run offload3 --memory.loss_chunk_tokens=8192 --memory.activation_offload_blocks=3 ;;
      offload3-whole) head_run offload3-whole --memory.loss_chunk_tokens=0 --memory.activation_offload_blocks=3 ;;
      moments) head_run moments --memory.loss_chunk_tokens=0 --memory.adamw_moments=bf16 ;;
      *) echo "unknown run $name"; exit 2 ;;
    esac
  done
  python3 - "$out" "${tags[@]}" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
for name in sys.argv[2:]:
    r = rows(out, name)
    if r:
        peak = max(x.get("mem.peak_gb") or 0 for x in r)
        reserved = max(x.get("mem.reserved_gb") or 0 for x in r)
        print(f"{name}: tokens/s over steps 21+ {training_rate(r, 20):,.0f}; peak {peak:.1f} GB (reserved "
              f"{reserved:.1f}); losses {[round(x['loss'], 4) for x in r]}")
PY
}

# A change to the trainer's FP8 job, before and after, in one call: `holotrain train --config 1.4b
# --training.fp8=RECIPE` (default tensorwise) from this checkout ("new", logging dynamo's recompilations; "new0" the
# same with evaluation off) and from an older one (OLD_DIR, holding its holotrain/: "old", on a corpus cache of its
# own), then the compile + torchao float8 peer (bench/peers.py, random tokens, causal attention). First used for the
# row split of masked micro-batches (bbbf6b0, reverted).
# Default: 100 steps; ORDER: the runs, space-separated, among old new new0 peer bf16 (default: "new old peer").
part_rows() {
  local old steps=${2:-100} order=${3:-new old peer}
  old=$(realpath "${1:?older checkout}"); out=$(realpath "$out")
  cache_env
  local args=(--config 1.4b --training.steps="$steps" "${QUIET[@]}" "${NO_CKPT[@]}")
  rows_train() {  # name, tree, extra args
    local name=$1 tree=$2
    shift 2
    s=$SECONDS
    (cd "$tree" && timeout 300 python3 -m holotrain.cli train "${args[@]}" --job.run_dir=/tmp/rows-$name "$@") \
      > "$out/$name.log" 2>&1
    echo "== $name: rc $? in $(( SECONDS - s )) s; recompilations logged: $(grep -c 'Recompiling function' "$out/$name.log")"
    keep_metrics /tmp/rows-$name "$name"
  }
  local recipe=${RECIPE:-tensorwise}
  for name in $order; do
    case $name in
      new) TORCH_LOGS=recompiles rows_train new . --training.fp8="$recipe" ;;
      new0) rows_train new0 . --training.fp8="$recipe" --eval.every=0 ;;
      old) HOLOTRAIN_CACHE=/tmp/holotrain-cache-old rows_train old "$old" --training.fp8="$recipe" ;;
      bf16) rows_train bf16 . ;;
      peer) timeout 290 python3 bench/peers.py --preset 1.4b --seq-len 2048 --batch 8 --variants compile-float8 \
              --out "$out/peers.json" > "$out/peers.log" 2>&1; echo "== peer rc $?" ;;
    esac
  done
  python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
peers = json.loads((out / "peers.json").read_text())["rows"] if (out / "peers.json").is_file() else []
peer = next((r["tokens_per_s"] for r in peers if r["variant"] == "compile-float8"), None)
if peer:
    print(f"peer compile-float8: {peer:,.0f} tokens/s")
for name in ("new", "new0", "old", "bf16"):
    r = rows(out, name)
    if not r:
        continue
    rate, last = training_rate(r, 20), r[-1]
    mid = statistics.median(x["tokens_per_s"] for x in r if x["step"] > 20)  # an interval holding an eval is slower
    print(f"{name}: median logged interval after step 20 {mid:,.0f} tokens/s"
          + (f" = {mid / peer:.3f}x the peer" if peer else "")
          + "; forward / backward ms (median) "
          + " / ".join(f"{statistics.median(x[k] for x in r if x['step'] > 20 and x.get(k)) * 1e3:.1f}"
                       for k in ("time.forward", "time.backward") if any(x.get(k) for x in r))
          + f"; host.gc_s {[round(x.get('host.gc_s') or 0, 3) for x in r]}")
    print(f"{name}: {rate:,.0f} tokens/s over steps 21-{last['step']}" + (f" = {rate / peer:.3f}x the peer" if peer else "")
          + f"; MFU {last['mfu']:.3f}; run J per 1k tokens {last['energy.run_j_per_token'] * 1e3:.2f}; "
          f"peak {max(x['mem.peak_gb'] for x in r):.1f} GB; masked micro-batches {last['data.doc_masked_share']:.2f}; "
          f"loss at {last['step']}: {last['loss']:.4f}; "
          f"per-row rates {[round(x['tokens_per_s']) for x in r]}")
PY
}

# Issue-4 figures on the GPU machine: hw probe, profiler/telemetry overhead and energy checks (bench/telemetry.py),
# the default run and a 1.4b trainer run with traces, each ending with its report.html.
part_profile() {
  cache_env
  s=$(date +%s); python3 -m holotrain.cli hw probe --out "$out/hw_probe.json" 2>&1 | tail -2
  echo "probe: $(( $(date +%s) - s )) s"
  s=$(date +%s); timeout 330 python3 bench/telemetry.py --out "$out/telemetry.json" 2>&1 | grep -v Warning | tail -8
  echo "bench/telemetry.py: $(( $(date +%s) - s )) s"
  s=$(date +%s); python3 -m holotrain.cli train --job.run_dir=/tmp/run-default --profile.progress=false > /tmp/default.log 2>&1
  echo "default run: rc=$? $(( $(date +%s) - s )) s"; tail -2 /tmp/default.log
  cp /tmp/run-default/report.html "$out/report-default.html"; tail -1 /tmp/run-default/metrics.jsonl
  s=$(date +%s); timeout 200 python3 -m holotrain.cli train --config 1.4b --training.steps=40 "${NO_CKPT[@]}" \
    --job.run_dir=/tmp/run-1.4b --profile.progress=false --profile.trace_steps=21,22 > /tmp/1.4b.log 2>&1
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
}

# The trainer itself on the GPU machine: the embedded default, the GPU tests, and the 1.4b config's real loop (60
# steps). That machine has no package index: tomli-w, torchao, pytest-xdist and execnet come as carried wheels on
# PYTHONPATH (the tests run one at a time there, -n 0: two would share the GPU).
part_smoke() {
  cache_env
  s=$(date +%s); python3 -m holotrain.cli train --job.run_dir=/tmp/run-default --profile.progress=false > "$out/default.log" 2>&1
  echo "default run: rc=$? $(( $(date +%s) - s )) s"; tail -3 "$out/default.log"; cp /tmp/run-default/metrics.jsonl "$out/default-metrics.jsonl"
  python3 -m pytest -n 0 -q tests/test_gpu.py 2>&1 | tail -3
  s=$(date +%s); python3 -m holotrain.cli train --config 1.4b --training.steps=60 "${NO_CKPT[@]}" \
    --job.run_dir=/tmp/run-1.4b --profile.progress=false > "$out/1.4b.log" 2>&1
  echo "1.4b run: rc=$? $(( $(date +%s) - s )) s"; tail -4 "$out/1.4b.log"; cp /tmp/run-1.4b/metrics.jsonl "$out/1.4b-metrics.jsonl"
}

dispatch "$@"
