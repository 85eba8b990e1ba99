"""Tensor parallelism on CPU (gloo): the layers against their dense computation, and TP=2 training against TP=1."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

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
    assert "terminate called" not in proc.stderr, proc.stderr[-6000:]


@pytest.mark.slow
def test_tp_worker_processes_exit_cleanly_every_time():
    """Regression: the TP workers once aborted after passing ("terminate called without an active exception",
    SIGABRT) because their gloo group outlived dist.destroy_process_group() (kept by a DeviceMesh that DTensor's
    caches keep) and a gloo thread freed a tensor during interpreter shutdown. Three launches at once (load widens
    that race), each of 2 ranks going twice through init, a TP model, a DTensor gather and
    holotrain.parallel.teardown.destroy_process_groups(), which must leave no group and no gloo thread: every
    rank exits 0, and no abort."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/tp_worker.py",
           "--teardown", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=300)
        why = f"launch {i} exited {proc.returncode}\n{out[-3000:]}\n{err[-6000:]}"
        assert proc.returncode == 0 and "TEARDOWN OK" in out, why
        assert "terminate called" not in err and "gloo threads still running" not in err, why


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


@pytest.mark.slow
def test_tp2_with_compiled_blocks_trains_like_eager(tmp_path):
    """training.compile with TP=2: the blocks compile around the TP layers (which stay out of the graphs) and train
    like the eager TP run."""
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    common = {"training.steps": 4, "checkpoint.every": 4, "profile.report": False}
    torchrun(2, "train", *tiny_args(eager, **common), "--parallel.tp=2")
    torchrun(2, "train", *tiny_args(compiled, **common), "--parallel.tp=2", "--training.compile=true")
    a, b = read_metrics(eager), read_metrics(compiled)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], abs=1e-4), (x, y)


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
    from holotrain.parallel.tiles import parse_tiles

    assert parse_tiles("128x256x64-s4-w8-f1-e2") == {"bm": 128, "bn": 256, "bk": 64, "stages": 4, "warps": 8,
                                                     "flat": 1, "epi": 2}
    with pytest.raises(ConfigError, match=r"parallel.tp_tiles: -e \(epilogue pieces\) must be 1 or 2"):
        _cfg("--parallel.tp_tiles=128x256x64-e3")
    assert parse_tiles("128x256x64-s3-w8-c1")["core"] == 1
    with pytest.raises(ConfigError, match=r"parallel.tp_tiles: the warp-specialized core \(-c1\) needs BM = 128"):
        _cfg("--parallel.tp_tiles=64x256x64-c1")


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


def test_fused_kernels_compile_without_spills():
    """The fused kernels compiled for sm_90a here (ptxas, no GPU): no register spills, no serialized wgmma
    (skipped where Triton is not installed, as on the CPU CI)."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "tests/tp_kernels_ptxas.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "PTXAS CHECKS OK" in proc.stdout, f"{proc.stdout}\n{proc.stderr[-6000:]}"


def _symm_worker(rank: int, world: int, tmp: str, port: int) -> None:
    """Runs the checks, then ends the process group from a frame that holds none of their objects (a caught
    exception's frames keep collectives' work alive, and with them the gloo threads that would abort the process
    at interpreter shutdown)."""
    from holotrain.parallel.teardown import destroy_process_groups, leftover_backend_threads

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _symm_checks(rank, world, tmp)
    left = destroy_process_groups()
    assert not left and not leftover_backend_threads(), (left, leftover_backend_threads())


def _symm_checks(rank: int, world: int, tmp: str) -> None:
    """Each rank's "symmetric buffer" is a shared file mapped by every rank (the CPU stand-in for symmetric memory)."""
    from holotrain.parallel import symm

    group, cpu, nbytes = dist.group.WORLD, torch.device("cpu"), 3 * symm.SYMM_HEADER + 12

    def mapping(owner: int, name: str) -> torch.Tensor:
        path = os.path.join(tmp, f"{name}{owner}")
        if owner == rank:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)

    local, other = mapping(rank, "a"), mapping(rank, "b")
    dist.barrier()
    views = [mapping(r, "a") for r in range(world)]
    symm.symm_self_test(group, rank, world, local, views, cpu, "plain")
    assert not local.any(), "markers left behind"

    # The race the self-test's ordering guards against: a rank leaves the first barrier late and reads after its
    # peers moved on.
    barrier = dist.barrier

    def late_barrier(*args, **kwargs):
        barrier(*args, **kwargs)
        if rank == 0:
            time.sleep(0.3)

    dist.barrier = late_barrier
    try:
        for _ in range(2):
            symm.symm_self_test(group, rank, world, local, views, cpu, "rank 0 late")
    finally:
        dist.barrier = barrier

    # A broken mapping on rank 1 only: every rank raises, and the message says which rank read what.
    bad = list(views)
    if rank == 1:
        bad[0] = mapping(0, "b")
    try:
        symm.symm_self_test(group, rank, world, local, bad, cpu, "broken")
        raise AssertionError(f"rank {rank}: a broken mapping passed the self-test")
    except RuntimeError as e:
        assert "rank 1 read" in str(e) and "(WRONG)" in str(e) and "rank 0 read" in str(e), str(e)
    dist.barrier()

    symm.agree_symm_size(group, 4096, cpu, "same")
    with pytest.raises(RuntimeError, match=r"different sizes \[4096, 4097\]"):
        symm.agree_symm_size(group, 4096 + rank, cpu, "differing")
    dist.barrier()
    del other


def test_symmetric_memory_self_test_protocol(tmp_path):
    """The fused path's self-test of a new symmetric buffer (symm.symm_self_test), over gloo with shared files as
    the buffers: passes with a rank late out of the barrier (a peer's markers must not be cleared before it has
    read them), and a broken mapping on one rank raises on every rank (no rank goes on alone into an op its peer
    never reaches)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_symm_worker, args=(2, str(tmp_path), port), nprocs=2, join=True)
