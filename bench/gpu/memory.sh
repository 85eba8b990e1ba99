#!/usr/bin/env bash
# Memory levers on one H200: the optimizer state in host memory (memory.offload) and long sequences. One part per call.
# Usage (repo root, on the GPU machine): bash bench/gpu/memory.sh OUT_DIR PART [ARGS...]
# Parts, one line each (the comment above each part_ function below gives the details and the environment knobs):
#   offload [BUDGET_S] [STAGES]   bench/offload.py's trials (a) 1.4b, (b) 7b under 24 GiB, (c) 14b, cpu, test, in 530 s
#   long_context [PARTS]          long T at batch 1, the plain compile loop beside it (holotrain,longdocs,7b,8b,peer)
#   attention [SHAPE] [TS]        bench/long_attention.py: causal attention's kernels at 32k-1M tokens, TFLOP/s each
# Each part writes its logs, metrics and summaries into OUT_DIR (made if missing).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Issue-5 figures on one H200 in one device call (at most 600 s). Every stage runs under a hard timeout of at
# most what is left of BUDGET seconds (default 530) once the later stages' reserve is kept, and is skipped when
# too little is left; the table is printed at the end.
# STAGES, comma-separated, in the order given (default a16,cpu,b,test,a8):
#   a16   (a) 1.4b at B=16: no offload; offload with clipping off (norms under the threshold: the CPU step
#         speculates and overlaps backward) and at 1.0 (random tokens keep the norm above 1.0 for these few
#         steps: every step clips and waits for the norm: the worst case). ~45 s a trial.
#   a16r  (a) B=16, clip 1.0 (the worst case) at offload_ratio 0.5: the first half of the model (in forward order)
#         keeps its optimizer on the GPU, so the next forward runs on it while the CPU finishes the rest.
#   a8    (a) B=8: no offload; offload at ratio 1.0 and 0.6, clipping off (the CPU step of all 1.36B, 264 ms at
#         best on 16 cores, exceeds this GPU step, 261 ms: the ratio moves work back to the GPU).
#   cpu   the CPU step's pieces on this host: memcpy and AdamW ceilings, loops before/after, threads, GIL. ~25 s.
#   b     (b) 7b under a 24 GiB GPU cap, micro-batch 8 (measured peak at micro 4: 17.3 GB, the plan's activation
#         estimate runs ~40% high) with clipping off, then micro 12. Without accumulation: an fp32 accumulator
#         would take the host to ~122 GB for a 7B. (Micro 12 needs expandable segments: see bmax.)
#   b8, b10  (b) one trial: micro-batch 8, or 10.
#   bmax  (b) micro-batch 12, else 10, with expandable segments (the loss in pieces of 8192 tokens: one piece's
#         logits alive instead of the micro-batch's).
#   bgil  (b) micro 12 at GIL switch intervals 5 ms (Python's) and 0.25 ms (the engine's default).
#   bthreads  (b) micro 12 on the default update thread count, then on 12.
#   c     (c) the whole machine: 14b at batch 4 with the smallest offload_ratio the memory plan fits.
#   test  the GPU offload test (tests/test_offload.py -m gpu), verbose with durations.
part_offload() {
  local budget=${1:-530} stages=${2:-a16,cpu,b,test,a8}
  export PYTHONUNBUFFERED=1
  local json="$out/offload.json"

  left() { echo $(( budget - SECONDS )); }
  # stage CAP_S NAME ARGS...: one bench command under a hard timeout (at most what is left), skipped below 30 s.
  stage() {
    local t=$1 name=$2
    shift 2
    (( t > $(left) )) && t=$(left)
    if (( t < 30 )); then echo "== [$SECONDS s] $name: skipped (${t} s left for it)"; return; fi
    echo "== [$SECONDS s] $name (cap $t s)"
    timeout -k 5 "$t" python3 bench/offload.py "$@" --out "$json" 2>&1 | grep -v -i warn | tail -20
    echo "== [$SECONDS s] $name done (rc ${PIPESTATUS[0]})"
  }

  for s in ${stages//,/ }; do
    case $s in
      a16) stage 200 "(a) B=16" --part a --batch 16 --variants plain,offload --ratios 1.0 --clips 0,1.0 \
             --steps 6 --warmup 3 --timeout 110 ;;
      a16r) stage 60 "(a) B=16, clipped, ratio 0.5" --part a --batch 16 --variants offload --ratios 0.5 --clips 1.0 \
             --steps 6 --warmup 3 --timeout 55 ;;
      a8) stage 150 "(a) B=8" --part a --batch 8 --variants plain,offload --ratios 1.0,0.6 --clips 0 --steps 6 \
            --warmup 3 --timeout 70 ;;
      cpu) stage 45 "(cpu)" --part cpu --cpu-params 128e6 ;;
      b) stage 110 "(b) 7b, micro 8" --part b --sizes 7b --big-batch 8 --micro 8 --clips 0 --steps 3 --warmup 2 \
           --timeout 100
         stage 110 "(b) 7b, micro 12" --part b --sizes 7b --big-batch 12 --micro 12 --clips 0 --steps 3 --warmup 2 \
           --timeout 100 ;;
      bmax) # the largest micro-batch that trains: 12, else 10 (expandable segments: without them the allocator's
            # fragmentation fails a 430 MiB request with 4.7 GB still under the cap)
            for m in 12 10; do
              PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True stage 100 "(b) 7b, micro $m" --part b --sizes 7b \
                --big-batch $m --micro $m --clips 0 --steps 3 --warmup 2 --timeout 95
              python3 -c "import json,sys; r=json.load(open('$json'))['runs'][-1]; sys.exit('error' in r)" && break
            done ;;
      bgil) # micro 12 at Python's 5 ms GIL switch interval, then at the engine's 0.25 ms (memory.offload_gil_switch_ms)
            PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True stage 200 "(b) 7b, micro 12, GIL 5 / 0.25 ms" --part b \
              --sizes 7b --big-batch 12 --micro 12 --clips 0 --steps 3 --warmup 2 --timeout 95 --gil-switch-ms 5,0.25 ;;
      bthreads) # micro 12 with the update on the default thread count (cores - 1), then on 12 (cores for the rest)
            PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True stage 200 "(b) 7b, micro 12, threads default / 12" --part b \
              --sizes 7b --big-batch 12 --micro 12 --clips 0 --steps 3 --warmup 2 --timeout 95 --offload-threads 0,12 ;;
      b8|b10) stage 110 "(b) 7b, micro ${s#b}" --part b --sizes 7b --big-batch ${s#b} --micro ${s#b} --clips 0 --steps 3 \
                --warmup 2 --timeout 100 ;;
      c) stage 200 "(c) 14b" --part c --sizes 14b --c-batch 4 --clips 0 --steps 3 --warmup 2 --timeout 190 ;;
      test) t=$(( $(left) < 150 ? $(left) : 150 ))
            if (( t >= 60 )); then
              echo "== [$SECONDS s] GPU offload test (cap $t s)"
              timeout -k 5 "$t" python3 -m pytest -n 0 -v -s -x tests/test_offload.py -m gpu -p no:cacheprovider \
                --durations=5 > "$out/gpu_test.log" 2>&1
              echo "gpu tests rc=$?"; tail -15 "$out/gpu_test.log"
            else
              echo "== [$SECONDS s] GPU offload test: skipped ($t s left)"
            fi ;;
      *) echo "unknown stage $s" ;;
    esac
  done
  python3 bench/offload.py --table "$json" 2>&1 | tail -40
  echo "== [$SECONDS s] end"
}

# Long sequences on one H200, in one device call per part:
#  holotrain  `holotrain train --config 1.4b --data.seq_len=T --training.batch_size=1` at each T of TS (shipped
#             defaults otherwise: compiled, clipping on, the embedded corpus, activation checkpointing "auto"),
#             STEPS steps; tokens/s, MFU and peak memory from metrics.jsonl past the first (compiling) interval.
#  longdocs   the same at LONG_TS (32768) on long documents (the standard library's files joined into ~300k-token
#             documents), so that attention spans whole rows as in the peer, rather than the corpus's files.
#  peer       bench/peers.py's plain torch.compile + SDPA loop of the same model (batch 1, random tokens) at each T of
#             PEER_TS, each in its own process; a T whose process fails (out of memory) is reported as not fitting.
#             PEER=compile-ac: the same loop with every block checkpointed (torch.utils.checkpoint), the fair peer at
#             long T (PEER=compile, the default, keeps the loop without checkpointing).
#  7b         `holotrain train --config 1.4b --model.preset=7b --data.seq_len=32768 --training.batch_size=1`.
#  8b         the Llama 3 8B shape (--config llama3-8b: optimizer state offloaded) at each T of TS_8B (262144 524288),
#             the memory levers "auto" picks (tiled feed-forwards, block inputs on the host where "full" does not fit).
# PARTS, comma-separated (default holotrain,peer).
#   env: TS="8192 32768 131072" STEPS=12 PEER_TS="8192 32768 49152 65536" LONG_TS="32768" EXTRA="" (more train arguments)
#   LC_CAP=420 (seconds a training run may take)
part_long_context() {
  local parts=${1:-holotrain,peer}
  local steps=${STEPS:-12}
  cache_env
  local train=(python3 -m holotrain.cli train --config 1.4b --training.batch_size=1 --training.steps="$steps"
               --training.log_every=3 "${QUIET[@]}" "${NO_CKPT[@]}")
  lc_run() {  # name, extra args
    local name=$1
    shift
    logged "$name" "$out/$name.log" "${LC_CAP:-420}" "${train[@]}" --job.run_dir=/tmp/lc-$name "$@"
    grep "auto ->\|rror\|context" "$out/$name.log" | head -4
    keep_metrics /tmp/lc-$name "$name"
  }
  if [[ $parts == *holotrain* ]]; then
    for T in ${TS:-8192 32768 131072}; do lc_run "hl-$T" --data.seq_len="$T" ${EXTRA:-}; done
  fi
  if [[ $parts == *longdocs* ]]; then
    # Long documents: the standard library's files joined, in order, into documents of about 1.2 MB of text (about
    # 300k tokens), so that a row holds one document's piece and attention spans the whole row.
    mkdir -p /tmp/lc-long
    python3 - <<'PY'
import json, sysconfig
from pathlib import Path
lib = Path(sysconfig.get_paths()["stdlib"])
docs, doc = [], []
for p in sorted(lib.rglob("*.py")):
    if "site-packages" in p.parts:
        continue
    try:
        doc.append(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        continue
    if sum(map(len, doc)) > 1_200_000:
        docs.append("\n\n".join(doc)); doc = []
with open("/tmp/lc-long/long.jsonl", "w") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
print(f"{len(docs)} long documents, {sum(map(len, docs)) / 1e6:.0f} MB")
PY
    { cat holotrain/configs/1.4b.toml; printf '\n[[data.sources]]\nname = "stdlib_long"\npath = "/tmp/lc-long/long.jsonl"\n'; } \
      > /tmp/lc-long/1.4b-long.toml
    for T in ${LONG_TS:-32768}; do lc_run "long-$T" --config /tmp/lc-long/1.4b-long.toml --data.seq_len="$T" ${EXTRA:-}; done
  fi
  if [[ $parts == *7b* ]]; then
    lc_run 7b-32768 --model.preset=7b --data.seq_len=32768
  fi
  if [[ $parts == *8b* ]]; then
    for T in ${TS_8B:-262144 524288}; do lc_run "8b-$T" --config llama3-8b --data.seq_len="$T" ${EXTRA:-}; done
  fi
  if [[ $parts == *peer* ]]; then
    for T in ${PEER_TS:-8192 32768 49152 65536}; do
      logged "peer $T" "$out/peer-$T.log" 300 python3 bench/peers.py --preset 1.4b --seq-len "$T" --batch 1 --steps 6 \
        --warmup 3 --variants "${PEER:-compile}" --out "$out/peer-$T.json"
      grep -i "out of memory" "$out/peer-$T.log" | head -1 | cut -c1-160
    done
  fi
  python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':16} {'tokens/s':>9} {'MFU':>6} {'peak GB':>8} {'host GB':>8} {'step s':>7}  first/last loss")
for p in sorted(out.glob("*.jsonl"), key=lambda p: (p.stem.split("-")[0], int(p.stem.split("-")[-1]))):
    rows = [json.loads(l) for l in p.read_text().splitlines()]
    timed = rows[1:] or rows
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    mfu = statistics.median(r["mfu"] or 0 for r in timed)
    host = max(r.get("mem.host_rss_gb") or 0 for r in rows)  # the process's RSS at its logged steps
    print(f"{p.stem:16} {tps:>9,.0f} {mfu:>6.3f} {max(r['mem.peak_gb'] or 0 for r in rows):>8.1f} {host:>8.1f} "
          f"{statistics.median(r['step_s'] for r in timed):>7.2f}  {rows[0]['loss']:.3f}/{rows[-1]['loss']:.3f}")
for p in sorted(out.glob("peer-*.json"), key=lambda p: int(p.stem.split("-")[1])):
    r = json.loads(p.read_text())["rows"][0]
    print(f"{p.stem:16} {r['tokens_per_s']:>9,.0f} {r['mfu']:>6.3f} {r['peak_mem_gb']:>8.1f} {r['step_ms'] / 1e3:>7.2f}")
PY
}

# Causal attention over one long sequence by kernel (flash, cuDNN, memory-efficient, flex, flex with TMA loads),
# forward and forward + backward, TFLOP/s by the causal count; SHAPE 1.4b (16/16 heads) or 8b (32/8), TS
# comma-separated (default 32768,131072,524288,1048576; a kernel past 60 s a step is not tried longer).
part_attention() {
  local shape=${1:-1.4b} ts=${2:-32768,131072,524288,1048576}
  cache_env
  logged "attention $shape" "$out/attention-$shape.log" 560 python3 bench/long_attention.py --shape "$shape" \
    --ts "$ts" --out "$out/attention-$shape.json"
  grep "^long_attention" "$out/attention-$shape.log"
}

dispatch "$@"
