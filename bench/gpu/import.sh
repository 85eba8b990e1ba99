#!/usr/bin/env bash
# Starting from a Hugging Face model on one H200 (`model.init_from`). One part per call.
# Usage (repo root, on the GPU machine): bash bench/gpu/import.sh OUT_DIR PART [ARGS...]
# Parts, one line each (the comment above each part_ function below gives the details and the environment knobs):
#   hf_import [STEPS] [PARTS]     init_from against random init (1.4b), a 7B's import timed, the 7B under offload
# Each part writes its logs, metrics and summaries into OUT_DIR (made if missing).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Starting from a Hugging Face model on one H200, in one device call:
#  1. a 1.4b-shape Llama made with transformers (random weights, bf16 safetensors) and holotrain's tokenizer;
#  2. `holotrain train --config 1.4b` (shipped defaults: compiled, clipping on, the embedded corpus) from
#     --model.init_from=that directory against the same config from random init, alternating (init, seed, seed,
#     init), STEPS steps each; tokens/s from metrics.jsonl past the first logged interval;
#  3. a 7b-shape checkpoint (about 13.5 GB) made the same way, and its import timed in a fresh process
#     (bench/hf_import.py time: init_from against seeded, peak host memory);
#  4. (part offload) that 7b under the offload engine on a 24 GB GPU cap (`--config offload`, host master weights
#     read from the shards): init_from against random init, OFFLOAD_STEPS (20) steps each, OFFLOAD_ORDER (init:
#     init_from first, seed: random init first).
# Defaults: 60 steps, PARTS train,7b (1-2 and 3 above; 4 is the part offload).
part_hf_import() {
  local steps=${1:-60} parts=${2:-train,7b}
  cache_env
  local train=(python3 -m holotrain.cli train --config 1.4b --training.steps="$steps" "${QUIET[@]}" "${NO_CKPT[@]}")
  hf_run() {  # name, extra args; its cap: 150 s + steps
    local name=$1
    shift
    logged "$name" "$out/$name.log" $(( 150 + steps )) "${train[@]}" --job.run_dir=/tmp/hf-$name "$@"
    grep "weights from\|rror" "$out/$name.log" | head -3
    keep_metrics /tmp/hf-$name "$name"
  }
  if [[ $parts == *train* ]]; then
    s=$SECONDS; python3 bench/hf_import.py make --preset 1.4b --out /tmp/hf-1.4b 2>&1 | grep -v Warning | tail -2
    echo "== made 1.4b in $(( SECONDS - s )) s"
    hf_run init1 --model.init_from=/tmp/hf-1.4b
    hf_run seed1
    hf_run seed2
    hf_run init2 --model.init_from=/tmp/hf-1.4b
    python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def rows(name):
    p = out / f"{name}.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.is_file() else []
med = {}
for name in ("init1", "seed1", "seed2", "init2"):
    r = rows(name)[1:]  # the first interval holds compilation
    if r:
        med[name] = statistics.median(x["tokens_per_s"] for x in r)
        print(f"{name}: median {med[name]:.0f} tokens/s over {len(r)} intervals, mfu {statistics.median(x['mfu'] for x in r):.3f}, "
              f"loss first {rows(name)[0]['loss']:.3f} last {r[-1]['loss']:.3f}, peak {max(x['mem.peak_gb'] for x in r):.1f} GB")
if len(med) == 4:
    print(f"init_from / seeded: pair 1 {med['init1'] / med['seed1']:.3f}, pair 2 {med['init2'] / med['seed2']:.3f}, "
          f"all {(med['init1'] + med['init2']) / (med['seed1'] + med['seed2']):.3f}")
PY
    rm -rf /tmp/hf-1.4b
  fi
  if [[ $parts == *7b* ]]; then
    s=$SECONDS; python3 bench/hf_import.py make --preset 7b --out /tmp/hf-7b 2>&1 | grep -v Warning | tail -2
    echo "== made 7b in $(( SECONDS - s )) s"
    timeout 240 python3 bench/hf_import.py time --dir /tmp/hf-7b --json "$out/import_7b.json" 2>&1 | grep -v Warning | tail -5
  fi
  if [[ $parts == *offload* ]]; then
    [ -d /tmp/hf-7b ] || python3 bench/hf_import.py make --preset 7b --out /tmp/hf-7b 2>&1 | grep -v Warning | tail -1
    train=(python3 -m holotrain.cli train --config offload --hw.gpu_memory_gb=24 --training.steps="${OFFLOAD_STEPS:-20}"
           --training.log_every=5 "${QUIET[@]}" "${NO_CKPT[@]}")
    steps=120  # the offload runs' cap: 150 + 120 s
    if [[ ${OFFLOAD_ORDER:-init} == init ]]; then hf_run off-init --model.init_from=/tmp/hf-7b; hf_run off-seed
    else hf_run off-seed; hf_run off-init --model.init_from=/tmp/hf-7b; fi
    python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("off-init", "off-seed"):
    p = out / f"{name}.jsonl"
    r = [json.loads(l) for l in p.read_text().splitlines()] if p.is_file() else []
    if len(r) > 1:
        print(f"{name}: median {statistics.median(x['tokens_per_s'] for x in r[1:]):.0f} tokens/s, mfu "
              f"{statistics.median(x['mfu'] for x in r[1:]):.3f}, host rss {max(x['mem.host_rss_gb'] for x in r):.1f} GB, "
              f"loss {r[0]['loss']:.3f} -> {r[-1]['loss']:.3f}")
PY
  fi
  rm -rf /tmp/hf-7b
  echo "== end after $SECONDS s"
}

dispatch "$@"
