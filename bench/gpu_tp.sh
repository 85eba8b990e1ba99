#!/usr/bin/env bash
# Tensor parallelism with fused compute/communication on the 2-GPU machine (nvidia-h200-x2), in one go:
#   1. the GPU kernel tests (tests/gpu_tp_worker.py: fused and async-TP ops against NCCL + cuBLAS, TP=2 Llama)
#   2. bench/overlap.py --part kernels (the AG+GEMM / GEMM+RS table, the fused tiles tried, efficiency, vs async-TP)
#   3. bench/overlap.py --part e2e (1.4b TP=2 tokens/s for tp_overlap none / async_tp / fused)
# Each step under its own timeout, logging into OUT_DIR; a step that fails or hangs does not stop the next one.
# Budget: about 4-5 minutes; at most 7.6 (the timeouts: 170 + 170 + what is left of 450 s, at most 130). Usage (repo root): bash bench/gpu_tp.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/holotrain-triton-cache}
run="python3 -m torch.distributed.run --standalone --nproc_per_node=2"
t0=$(date +%s)
step() { echo "== $1: rc=$2, $(( $(date +%s) - $3 )) s (total $(( $(date +%s) - t0 )) s)"; }

{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv; nvidia-smi topo -m;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$out/machine.txt" 2>&1
head -4 "$out/machine.txt"

s=$(date +%s)
HOLOTRAIN_TEST_WATCHDOG_S=160 timeout 170 $run tests/gpu_tp_worker.py > "$out/gpu_tests.log" 2>&1
step "GPU tests (tests/gpu_tp_worker.py, log gpu_tests.log)" $? $s
grep -E "^\[rank [0-9]\] (PASS|FAIL|GPU TP CHECKS|torch|triton)" "$out/gpu_tests.log" | cut -c1-220
grep -E "Error|error:|Traceback" "$out/gpu_tests.log" | grep -v "^\[rank" | sort | uniq -c | head -10

s=$(date +%s)
timeout 170 $run bench/overlap.py --part kernels --watchdog 160 --out "$out/kernels.json" > "$out/kernels.log" 2>&1
step "kernel benchmark (bench/overlap.py --part kernels, log kernels.log)" $? $s
[ -f "$out/kernels.md" ] && cat "$out/kernels.md"
grep -E "FAILED|Error" "$out/kernels.log" | sort | uniq -c | head -10
best=$(python3 -c "import json; print(json.load(open('$out/kernels.json')).get('best_tiles', ''))" 2>/dev/null)

s=$(date +%s)
left=$(( 450 - ($(date +%s) - t0) )); [ $left -gt 130 ] && left=130; [ $left -lt 40 ] && left=40
timeout $left $run bench/overlap.py --part e2e --e2e-tiles "$best" --watchdog $(( left - 10 )) \
  --out "$out/e2e.json" > "$out/e2e.log" 2>&1
step "end to end (bench/overlap.py --part e2e, log e2e.log, tiles '$best')" $? $s
[ -f "$out/e2e.md" ] && cat "$out/e2e.md"
grep -E "FAILED|Error" "$out/e2e.log" | sort | uniq -c | head -10
echo "== done in $(( $(date +%s) - t0 )) s; results in $out (kernels.json/.md, e2e.json/.md, logs)"
