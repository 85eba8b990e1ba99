#!/usr/bin/env bash
# Long sequences on one H200, in one device call per part:
#  holotrain  `holotrain train --config 1.4b --data.seq_len=T --training.batch_size=1` at each T of TS (shipped
#             defaults otherwise: compiled, clipping on, the embedded corpus, activation checkpointing "auto"),
#             STEPS steps; tokens/s, MFU and peak memory from metrics.jsonl past the first (compiling) interval.
#  longdocs   the same at LONG_TS (32768) on long documents (the standard library's files joined into ~300k-token
#             documents), so that attention spans whole rows as in the peer, rather than the corpus's files.
#  peer       bench/peers.py's plain torch.compile + SDPA loop of the same model (batch 1, random tokens) at each T of
#             PEER_TS, each in its own process; a T whose process fails (out of memory) is reported as not fitting.
#  7b         `holotrain train --config 1.4b --model.preset=7b --data.seq_len=32768 --training.batch_size=1`.
# Usage (repo root, on the GPU machine): bash bench/gpu_long_context.sh OUT_DIR PARTS
#   env: TS="8192 32768 131072" STEPS=12 PEER_TS="8192 32768 49152 65536" LONG_TS="32768" EXTRA="" (more train arguments)
set -uo pipefail
out=${1:?output directory}; parts=${2:-holotrain,peer}
steps=${STEPS:-12}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
mkdir -p "$out"
train=(python3 -m holotrain.cli train --config 1.4b --training.batch_size=1 --training.steps="$steps"
       --training.log_every=3 --profile.progress=false --profile.report=false --profile.tensorboard=false
       --checkpoint.every=0 --checkpoint.save_final=false)
run() {  # name, extra args
  local name=$1; shift
  local s=$SECONDS
  timeout 420 "${train[@]}" --job.run_dir=/tmp/lc-$name "$@" > "$out/$name.log" 2>&1
  echo "== $name: rc $? in $(( SECONDS - s )) s"; grep "auto ->\|rror\|context" "$out/$name.log" | head -4
  cp /tmp/lc-$name/metrics.jsonl "$out/$name.jsonl" 2>/dev/null; rm -rf /tmp/lc-$name
}
if [[ $parts == *holotrain* ]]; then
  for T in ${TS:-8192 32768 131072}; do run "hl-$T" --data.seq_len="$T" ${EXTRA:-}; done
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
  for T in ${LONG_TS:-32768}; do run "long-$T" --config /tmp/lc-long/1.4b-long.toml --data.seq_len="$T" ${EXTRA:-}; done
fi
if [[ $parts == *7b* ]]; then
  run 7b-32768 --model.preset=7b --data.seq_len=32768
fi
if [[ $parts == *peer* ]]; then
  for T in ${PEER_TS:-8192 32768 49152 65536}; do
    s=$SECONDS
    timeout 300 python3 bench/peers.py --preset 1.4b --seq-len "$T" --batch 1 --steps 6 --warmup 3 \
      --variants compile --out "$out/peer-$T.json" > "$out/peer-$T.log" 2>&1
    echo "== peer $T: rc $? in $(( SECONDS - s )) s"; grep -i "out of memory" "$out/peer-$T.log" | head -1 | cut -c1-160
  done
fi
python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':16} {'tokens/s':>9} {'MFU':>6} {'peak GB':>8} {'step s':>7}  first/last loss")
for p in sorted(out.glob("*.jsonl"), key=lambda p: (p.stem.split("-")[0], int(p.stem.split("-")[-1]))):
    rows = [json.loads(l) for l in p.read_text().splitlines()]
    timed = rows[1:] or rows
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    mfu = statistics.median(r["mfu"] or 0 for r in timed)
    print(f"{p.stem:16} {tps:>9,.0f} {mfu:>6.3f} {max(r['mem.peak_gb'] or 0 for r in rows):>8.1f} "
          f"{statistics.median(r['step_s'] for r in timed):>7.2f}  {rows[0]['loss']:.3f}/{rows[-1]['loss']:.3f}")
for p in sorted(out.glob("peer-*.json"), key=lambda p: int(p.stem.split("-")[1])):
    r = json.loads(p.read_text())["rows"][0]
    print(f"{p.stem:16} {r['tokens_per_s']:>9,.0f} {r['mfu']:>6.3f} {r['peak_mem_gb']:>8.1f} {r['step_ms'] / 1e3:>7.2f}")
PY
