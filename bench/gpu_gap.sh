#!/usr/bin/env bash
# Where the trainer's FP8 step loses against bench/peers.py's holotrain-fp8 variant (random tokens, causal attention):
# the peers with a kernel table each, then `holotrain train --config 1.4b --training.fp8=tensorwise` with a trace of
# two steps, and each trace's GPU time by kernel family. Usage (repo root, GPU machine): bash bench/gpu_gap.sh OUT [STEPS]
# PEERS=0 skips the peers; PROFILE=1 adds their kernel tables; RECIPE=delayed trains (and times the holotrain peer)
# with training.fp8 = delayed in place of tensorwise, and TENSORWISE_STEPS=N adds a tensorwise run of N steps.
set -uo pipefail
out=${1:?output directory}; steps=${2:-60}
export HOLOTRAIN_CACHE=/tmp/holotrain-cache PYTHONUNBUFFERED=1
recipe=${RECIPE:-tensorwise}
ours=holotrain-fp8$([ "$recipe" = delayed ] && echo -delayed)
[ "${PEERS:-1}" = 1 ] && timeout 300 python3 bench/peers.py --preset 1.4b --seq-len 2048 --batch 8 \
  --variants compile-float8,holotrain-fp8$([ "$recipe" = delayed ] && echo ",$ours") \
  ${PROFILE:+--profile compile-float8,$ours} --out "$out/peers.json" > "$out/peers.log" 2>&1
echo "== peers rc $?"; grep -v -i "warn" "$out/peers.log" | tail -6
t=$(( steps - 19 )),$(( steps - 18 ))
timeout 280 python3 -m holotrain.cli train --config 1.4b --training.fp8="$recipe" --training.steps="$steps" \
  --profile.progress=false --profile.report=false --profile.tensorboard=false --checkpoint.every=0 \
  --checkpoint.save_final=false --job.run_dir=/tmp/gap --profile.trace_steps="$t" > "$out/train.log" 2>&1
echo "== train rc $?"; grep holotrain: "$out/train.log" | grep -v -i warn | head -3
cp /tmp/gap/metrics.jsonl "$out/train.jsonl"; cp /tmp/gap/traces/*.json.gz "$out/" 2>/dev/null
python3 bench/trace_families.py /tmp/gap/traces/*.json.gz
if [ "${TENSORWISE_STEPS:-0}" -gt 0 ]; then  # torchao's tensorwise beside holotrain's delayed scaling
  timeout 250 python3 -m holotrain.cli train --config 1.4b --training.fp8=tensorwise --training.steps="$TENSORWISE_STEPS" \
    --profile.progress=false --profile.report=false --profile.tensorboard=false --checkpoint.every=0 \
    --checkpoint.save_final=false --job.run_dir=/tmp/gap-tw > "$out/tensorwise.log" 2>&1
  echo "== tensorwise rc $?"; cp /tmp/gap-tw/metrics.jsonl "$out/tensorwise.jsonl"
fi
if [ "${BF16_STEPS:-0}" -gt 0 ]; then  # the shipped default (bf16) beside it
  timeout 250 python3 -m holotrain.cli train --config 1.4b --training.steps="$BF16_STEPS" --profile.progress=false \
    --profile.report=false --profile.tensorboard=false --checkpoint.every=0 --checkpoint.save_final=false \
    --job.run_dir=/tmp/gap-bf16 > "$out/bf16.log" 2>&1
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
