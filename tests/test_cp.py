"""Context parallelism (holotrain/parallel/cp.py): the model split over ranks by sequence against one process.
Training through `holotrain train` under parallel.cp is checked in tests/test_distributed.py."""

import os
import subprocess
import sys

import pytest

from holotrain.config import ConfigError, load_config, resolve
from holotrain.parallel.cp import resolve_mode
from tests.conftest import REPO


@pytest.mark.slow
def test_cp4_dp2xcp2_and_cp2xtp2_losses_and_gradients_equal_one_process():
    """One torchrun launch of 4 gloo ranks: cp=4, dp=2 x cp=2 (FSDP2) and cp=2 x tp=2, each in ring and all-to-all
    mode, on packed documents with masked targets: loss and every gradient equal one process's (fp32)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "tests/cp_worker.py"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "CP WORKER OK" in proc.stdout, out[-6000:]
    assert out.count("gradients equal one process's") == 6


def test_cp_mode_auto_and_config_errors_name_the_key():
    assert resolve_mode("auto", 2, 8, 4) == "alltoall"
    assert resolve_mode("auto", 4, 8, 2) == "ring"  # kv heads do not divide
    with pytest.raises(ConfigError, match="cp_mode = 'alltoall' needs the heads"):
        resolve_mode("alltoall", 4, 8, 2)
    for override, message in (("--parallel.cp=0", "parallel.cp must be >= 1"),
                              ("--parallel.cp_mode=zigzag", "parallel.cp_mode must be auto, ring or alltoall"),
                              ("--data.seq_len=36", r"data.seq_len=36 must divide by 2 x parallel.cp")):
        with pytest.raises(ConfigError, match=message):
            resolve(load_config(None, ["--parallel.cp=4", "--data.seq_len=64", override]), tokenizer_vocab=500)
