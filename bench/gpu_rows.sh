#!/usr/bin/env bash
# A change to the trainer's FP8 job, before and after, in one call: `holotrain train --config 1.4b
# --training.fp8=tensorwise` from this checkout ("new", logging dynamo's recompilations) and from an older one
# (OLD_DIR, holding its holotrain/: "old"), then the compile + torchao float8 peer (bench/peers.py, random tokens,
# causal attention). First used for the row split of masked micro-batches (bbbf6b0, reverted).
# Usage (repo root, on the GPU machine): bash bench/gpu_rows.sh OLD_DIR OUT_DIR [STEPS] [ORDER]
#   ORDER: the runs, space-separated, among old new peer bf16 (default: "new old peer")
set -uo pipefail
old=$(realpath "${1:?older checkout}"); out=$(realpath "${2:?output directory}"); steps=${3:-100}
order=${4:-new old peer}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
args=(--config 1.4b --training.steps="$steps" --profile.progress=false --profile.report=false
      --profile.tensorboard=false --checkpoint.every=0 --checkpoint.save_final=false)
train() {  # name, tree, extra args
  local name=$1 tree=$2; shift 2
  s=$SECONDS
  (cd "$tree" && timeout 300 python3 -m holotrain.cli train "${args[@]}" --job.run_dir=/tmp/rows-$name "$@") \
    > "$out/$name.log" 2>&1
  echo "== $name: rc $? in $(( SECONDS - s )) s; recompilations logged: $(grep -c 'Recompiling function' "$out/$name.log")"
  cp /tmp/rows-$name/metrics.jsonl "$out/$name.jsonl"; rm -rf /tmp/rows-$name
}
for name in $order; do
  case $name in
    new) TORCH_LOGS=recompiles train new . --training.fp8=tensorwise ;;
    old) train old "$old" --training.fp8=tensorwise ;;
    bf16) train bf16 . ;;
    peer) timeout 290 python3 bench/peers.py --preset 1.4b --seq-len 2048 --batch 8 --variants compile-float8 \
            --out "$out/peers.json" > "$out/peers.log" 2>&1; echo "== peer rc $?" ;;
  esac
done
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from checkpoint_summary import rows, training_rate
out = Path(sys.argv[1])
peers = json.loads((out / "peers.json").read_text())["rows"] if (out / "peers.json").is_file() else []
peer = next((r["tokens_per_s"] for r in peers if r["variant"] == "compile-float8"), None)
if peer:
    print(f"peer compile-float8: {peer:,.0f} tokens/s")
for name in ("new", "old", "bf16"):
    r = rows(out, name)
    if not r:
        continue
    rate, last = training_rate(r, 20), r[-1]
    print(f"{name}: {rate:,.0f} tokens/s over steps 21-{last['step']}" + (f" = {rate / peer:.3f}x the peer" if peer else "")
          + f"; MFU {last['mfu']:.3f}; run J per 1k tokens {last['energy.run_j_per_token'] * 1e3:.2f}; "
          f"peak {max(x['mem.peak_gb'] for x in r):.1f} GB; masked micro-batches {last['data.doc_masked_share']:.2f}; "
          f"loss at {last['step']}: {last['loss']:.4f}; "
          f"per-row rates {[round(x['tokens_per_s']) for x in r]}")
PY
