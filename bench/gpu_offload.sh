#!/usr/bin/env bash
# Issue-5 figures on one H200 in one call: the offload GPU tests, (a) 1.4b throughput vs no offload and FSDP2
# CPUOffloadPolicy at B=8 and B=16, and (b) 7B under a 24 GiB GPU cap. (c) runs separately (bench/offload.py --part c).
# Usage (repo root, on the GPU machine): bash bench/gpu_offload.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
export PYTHONUNBUFFERED=1
timeout 200 python3 bench/offload.py --part a --batch 8 --ratios 1.0 --variants plain,offload,fsdp2-cpu \
  --steps 8 --warmup 3 --timeout 150 --out "$out/offload.json" 2>&1 | grep -v Warning | tail -12
timeout 130 python3 bench/offload.py --part a --batch 16 --ratios 1.0 --variants plain,offload \
  --steps 6 --warmup 3 --timeout 110 --out "$out/offload.json" 2>&1 | grep -v Warning | tail -8
timeout 200 python3 bench/offload.py --part b --sizes 7b --steps 3 --warmup 2 --timeout 190 --out "$out/offload.json" 2>&1 \
  | grep -v Warning | tail -8
python3 bench/offload.py --table "$out/offload.json" 2>&1 | tail -30
timeout 100 python3 -m pytest -q -x tests/test_offload.py -m gpu -p no:cacheprovider 2>&1 | tail -5; echo "gpu tests rc=$?"
