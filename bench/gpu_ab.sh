#!/usr/bin/env bash
# Before/after speed of a change on one H200, in one device call: the same benchmarks from an older checkout of
# holotrain (OLD_DIR, holding its holotrain/ and bench/) and from this one, alternating, so both see the same card
# in the same state. Measures the peers row (bench/peers.py holotrain, 1.4b, T=2048, B=8), offload (a) (1.4b,
# B=16, ratio 1.0, clipping on) and offload (b) (7b under a 24 GiB GPU cap, micro-batch 12, clipping on).
# Usage (repo root, on the GPU machine): bash bench/gpu_ab.sh OLD_DIR OUT_DIR [PARTS]   PARTS: peers,b,a
# OLD_DIR, made here and carried: git worktree add /tmp/old REV && mkdir .base && cp -r /tmp/old/{holotrain,bench} .base/
# (with /.base/ in .git/info/exclude).
set -uo pipefail
old=${1:?older checkout}
out=${2:?output directory}
parts=${3:-peers,b,a}
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p "$out"

run() {  # run TREE NAME CAP ARGS...: one benchmark of one tree under a hard timeout, its log under OUT
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
      peers) run "$tree" "peers_$side" 150 peers.py --variants holotrain --steps 20 --warmup 6 --out "$out/peers_$side.json" ;;
      a) run "$tree" "a_$side" 100 offload.py --part a --batch 16 --variants offload --ratios 1.0 --clips 1.0 \
           --steps 6 --warmup 3 --timeout 90 --out "$out/a_$side.json" ;;
      b) run "$tree" "b_$side" 120 offload.py --part b --sizes 7b --big-batch 12 --micro 12 --clips 1.0 --steps 3 \
           --warmup 2 --timeout 110 --out "$out/b_$side.json" ;;
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
