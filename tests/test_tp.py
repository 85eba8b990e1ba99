"""Tensor parallelism on CPU (gloo): the layers against their dense computation, and TP=2 training against TP=1."""

import os
import subprocess
import sys

import pytest

from holotrain.config import ConfigError, load_config, resolve
from tests.conftest import REPO, read_metrics, run_cli, tiny_args
from tests.test_distributed import torchrun


@pytest.mark.slow
def test_tp_layers_match_dense():
    """Column/row-parallel GEMMs, vocabulary-parallel cross-entropy, and a whole TP=2 Llama (sequence-parallel
    norms, vocabulary-parallel embedding and head, packed documents) against the dense model, forward and backward."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/tp_worker.py"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "TP WORKER OK" in proc.stdout, f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.slow
def test_tp2_and_dp2_tp2_training_match_one_process(tmp_path):
    """Same global batch: one process, TP=2 on 2 ranks, and FSDP dp=2 x TP=2 on 4 ranks train alike (losses and
    gradient norms per step); the TP checkpoints resume and export."""
    one, tp2, dp2tp2 = tmp_path / "one", tmp_path / "tp2", tmp_path / "dp2tp2"
    common = {"training.steps": 6, "checkpoint.every": 3, "profile.report": False}
    run_cli("train", *tiny_args(one, **common), env={"OMP_NUM_THREADS": "1"})
    torchrun(2, "train", *tiny_args(tp2, **{**common, "training.steps": 3}), "--parallel.tp=2")
    torchrun(2, "train", *tiny_args(tp2, **common), "--parallel.tp=2")  # resumes from its step-3 checkpoint
    torchrun(4, "train", *tiny_args(dp2tp2, **common), "--parallel.tp=2")
    ref = read_metrics(one)
    for run in (tp2, dp2tp2):
        rows = read_metrics(run)
        assert [r["step"] for r in rows] == [r["step"] for r in ref]
        for a, b in zip(ref, rows):
            assert b["loss"] == pytest.approx(a["loss"], abs=2e-4), (run.name, a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), (run.name, a, b)
    assert ref[-1]["loss"] < ref[0]["loss"]
    run_cli("export", str(tp2), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 0


def _cfg(*overrides):
    return resolve(load_config(None, list(overrides)), tokenizer_vocab=500)


def test_tp_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"parallel.tp=3 must divide model.n_heads"):
        _cfg("--parallel.tp=3")
    with pytest.raises(ConfigError, match=r"parallel.tp_overlap must be none, async_tp or fused"):
        _cfg("--parallel.tp_overlap=nccl")
    with pytest.raises(ConfigError, match=r"parallel.tp_overlap='fused' runs on CUDA GPUs only"):
        _cfg("--parallel.tp=2", "--parallel.tp_overlap=fused", "--job.device=cpu")
    with pytest.raises(ConfigError, match=r"parallel.tp=2 must divide data.seq_len=255"):
        _cfg("--parallel.tp=2", "--data.seq_len=255")
    with pytest.raises(ConfigError, match=r"parallel.tp_tiles"):
        _cfg("--parallel.tp_tiles=128x100x64")
    assert _cfg("--parallel.tp=2", "--parallel.tp_tiles=128x256x64-s4-w8-r2").parallel.tp_tiles


@pytest.mark.slow
def test_tp_user_errors_are_one_line(tmp_path):
    """A fused overlap on CPU ranks, and more TP ranks than launched, fail at startup with one clear line."""
    proc = run_cli("train", *tiny_args(tmp_path / "a"), "--parallel.tp=2", check=False)
    assert proc.returncode == 2 and "parallel.tp=2 needs 2 ranks" in proc.stderr, proc.stderr[-2000:]
    proc = run_cli("train", *tiny_args(tmp_path / "b"), "--parallel.tp=2", "--parallel.tp_overlap=fused",
                   "--job.device=cpu", check=False)
    assert proc.returncode == 2 and "runs on CUDA GPUs only" in proc.stderr, proc.stderr[-2000:]


def test_fused_kernels_interpreted():
    """The fused kernels' tiling, chunk order, remote staging and counters under Triton's CPU interpreter
    (skipped where Triton is not installed, as on the CPU CI; the GPU runs them for real in test_gpu_tp.py)."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "tests/tp_kernels_interpreted.py"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "INTERPRETED KERNELS OK" in proc.stdout, f"{proc.stdout}\n{proc.stderr[-6000:]}"
