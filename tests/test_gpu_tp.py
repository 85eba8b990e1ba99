"""The fused tensor-parallel kernels (and torch async-TP) on two GPUs, against the unfused bf16 result.

Fresh random inputs every run (the seed is printed), outputs poisoned with NaN, the benchmark's shapes and an odd
one, both weight layouts, queued calls, autograd and a TP=2 Llama; see tests/gpu_tp_worker.py. Each group of cases
runs in its own process (a lost CUDA context ends only its group). Skipped without two CUDA GPUs.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

# No NVLink multicast anywhere (the lent machines do not support it reliably).
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "HOLOTRAIN_TEST_CASE_S": "90"}
# Short waits (parallel.tp_barrier_ms, tp_spin_limit): a desynchronized barrier or a missing peer fails its case
# within seconds instead of minutes.
KNOBS = ["--barrier-ms", "20000", "--spin-limit", str(1 << 25)]


@pytest.mark.parametrize("group", ["basic", "large", "model"])
def test_fused_tp_ops_match_unfused_bf16(group):
    quick = os.environ.get("HOLOTRAIN_GPU_TP_QUICK", "") == "1"
    if quick and group != "basic":
        pytest.skip("HOLOTRAIN_GPU_TP_QUICK=1: the basic group only")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "tests/gpu_tp_worker.py", "--groups", group, *KNOBS, *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400,
                          env={**os.environ, **ENV, "OMP_NUM_THREADS": "4"})
    print(proc.stdout[-20000:])
    assert proc.returncode == 0 and "ALL PASSED" in proc.stdout, f"rc {proc.returncode}\n{proc.stderr[-12000:]}"
