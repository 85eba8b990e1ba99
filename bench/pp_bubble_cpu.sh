#!/usr/bin/env bash
# The pipeline bubble on CPU ranks (gloo), on a machine with >= 16 idle cores: bench/pp_bubble.py's isolated
# schedules, then `holotrain train` on the shipped tiny config (clipping on, the embedded corpus) with pipeline
# stages, its logged pp.bubble_share beside the model's. Usage: bash bench/pp_bubble_cpu.sh OUT
set -uo pipefail
OUT=${1:?usage: bench/pp_bubble_cpu.sh OUT}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
python3 -m torch.distributed.run --standalone --nproc_per_node 4 bench/pp_bubble.py \
    --cases "${CASES:-1f1b:4,1f1b:16,interleaved:16,zb1p:16,zb1p:8}" --out "$OUT/pp_bubble.json" \
    --timeline-dir "$OUT/timelines" > "$OUT/pp_bubble.log" 2>&1
echo "pp_bubble rc=$?"
tail -8 "$OUT/pp_bubble.log"
train() {  # name nproc overrides...
    local name=$1 nproc=$2; shift 2
    python3 -m torch.distributed.run --standalone --nproc_per_node "$nproc" -m holotrain.cli train --config tiny \
        --job.device=cpu --job.run_dir="$OUT/$name" --training.steps=16 --training.log_every=4 \
        --checkpoint.every=0 --profile.tensorboard=false --profile.progress=false "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$?"
    python3 - "$OUT/$name/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(f"  step {r['step']:>3} loss {r['loss']:.4f} step_s {r['step_s']:.3f} bubble {r.get('pp.bubble_share')} "
          f"model {r.get('pp.bubble_share_model')} textbook {r.get('pp.bubble_share_textbook')}")
PY
}
train pp4-1f1b-m4 4 --parallel.pp=4 --parallel.pp_schedule=1f1b --training.micro_batch_size=4
train pp4-1f1b-m16 4 --parallel.pp=4 --parallel.pp_schedule=1f1b --training.micro_batch_size=1
train pp2-1f1b-m8 2 --parallel.pp=2 --parallel.pp_schedule=1f1b --training.micro_batch_size=2
train pp2-zb1p-m8 2 --parallel.pp=2 --parallel.pp_schedule=zb1p --training.micro_batch_size=2
train pp2-interleaved-m8 2 --parallel.pp=2 --parallel.pp_schedule=interleaved --training.micro_batch_size=2
