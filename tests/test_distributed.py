"""FSDP2 over two gloo processes must train like one process on the same global batch."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, read_metrics, run, run_cli, tiny_args, torchrun_argv


def torchrun(nproc: int, *args, env=None, ok=True) -> str:
    proc = run(torchrun_argv(nproc, "-m", "holotrain.cli", *args), {"OMP_NUM_THREADS": "1", **(env or {})})
    if (proc.returncode == 0) != ok:
        # Keep the ranks' own output (torchrun's summary alone does not say why a rank died).
        raise AssertionError(f"torchrun exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n"
                             f"--- stderr ---\n{proc.stderr[-12000:]}")
    return proc.stdout


@pytest.mark.slow
def test_two_process_fsdp_and_context_parallel_match_one_process(tmp_path):
    """FSDP2 over 2 ranks, and context parallelism over 2 ranks (each sequence split, packed documents masked),
    train like one process; a context-parallel checkpoint resumes in one process. The validation loss (the held-out
    documents, evaluated every 4 steps and at the end) is the same in every layout."""
    one, two, cp2 = tmp_path / "one", tmp_path / "two", tmp_path / "cp2"
    common = {"training.steps": 8, "checkpoint.every": 4, "eval.every": 4}
    run_cli("train", *tiny_args(one, **common), env={"OMP_NUM_THREADS": "1"})
    clean = torchrun(2, "train", *tiny_args(two, **common))
    assert "straggler" not in clean  # no rank is slowed: none may be named (profile.straggler_margin)
    # Stopped at step 3, the last of the warmup-then-full-lr steps, so the two schedules agree up to there.
    out = torchrun(2, "train", *tiny_args(cp2, **{"training.steps": 3, "checkpoint.every": 3}), "--parallel.cp=2",
                   "--parallel.cp_mode=ring")
    assert "context parallelism over 2 ranks (ring)" in out
    run_cli("train", *tiny_args(cp2, **{**common, "checkpoint.every": 3}), "--checkpoint.resume=true",
            env={"OMP_NUM_THREADS": "1"})
    a = read_metrics(one)
    for run in (two, cp2):
        b = read_metrics(run)
        assert [r["step"] for r in a] == [r["step"] for r in b]
        for ra, rb in zip(a, b):
            assert rb["loss"] == pytest.approx(ra["loss"], abs=2e-4), (run.name, ra, rb)
            assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-3), (run.name, ra, rb)
            if ra.get("eval.loss") is not None and rb.get("eval.loss") is not None:
                assert rb["eval.loss"] == pytest.approx(ra["eval.loss"], abs=2e-4), (run.name, ra, rb)
                assert rb["eval.tokens"] == ra["eval.tokens"]
                if run is two:  # FSDP2 gathers the root's weights for the samples' cached decode too
                    assert rb["eval.samples"] == ra["eval.samples"]
    assert [r["step"] for r in a if r.get("eval.loss") is not None] == [4, 8]
    assert sum(r.get("eval.loss") is not None for r in read_metrics(two)) == 2
    assert a[-1]["loss"] < a[0]["loss"] and a[-1]["eval.loss"] < a[3]["eval.loss"]
    # The sharded checkpoint exports to one Hugging Face model file.
    run_cli("export", str(two), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 0


@pytest.mark.slow
def test_two_process_resume_continues_exactly(tmp_path):
    """Two ranks killed while saving step 6 resume from their sharded step-4 checkpoint to the same curve."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = {"training.steps": 8, "checkpoint.every": 2}
    assert "straggler" not in torchrun(2, "train", *tiny_args(full, **common))  # a clean run: none named
    torchrun(2, "train", *tiny_args(resumed, **common), env={"HOLOTRAIN_KILL_DURING_SAVE": "6"}, ok=False)
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-2", "step-4"]
    torchrun(2, "train", *tiny_args(resumed, **common))
    assert [r["loss"] for r in read_metrics(resumed)] == [r["loss"] for r in read_metrics(full)]

    # SIGTERM to rank 1 alone (held 0.5 s a step, so that the run is mid-way): both ranks stop at the same step, save
    # it, and exit 143 with one line each; the same command then resumes to the same curve.
    stopped = tmp_path / "stopped"
    args = ["train", *tiny_args(stopped, **common)]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "-m", "holotrain.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HOLOTRAIN_SLOW_RANK": "1:forward:0.5"})
    rank1 = _worker_of_rank(proc.pid, 1, stopped / "metrics.jsonl", rows=2)
    os.kill(rank1, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    lines = {x for x in err.splitlines() if "holotrain: SIGTERM: stopped after step" in x}  # a line from each rank
    assert len(lines) == 1, err[-3000:]  # ... naming the same step
    line = lines.pop()
    step = int(line.split("after step ")[1].split(",")[0])
    assert f"saved {stopped / 'checkpoints' / f'step-{step}'}" in line and "the same torchrun command" in line
    assert step < 8 and str(REPO / "holotrain") not in err  # torchrun prints its own traceback, none of ours
    torchrun(2, *args)
    assert [r["loss"] for r in read_metrics(stopped)] == [r["loss"] for r in read_metrics(full)]


def _worker_of_rank(launcher: int, rank: int, metrics, rows: int) -> int:
    """The pid of torchrun's worker of `rank`, once rank 0 has logged `rows` steps."""
    import time

    import psutil

    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= rows):
        time.sleep(0.01)
    for child in psutil.Process(launcher).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "holotrain.cli" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no worker of rank {rank} under {launcher}")


@pytest.mark.slow
@pytest.mark.parametrize("node_lost", [False, True], ids=["restart", "node-lost"])
def test_two_process_resume_from_an_in_memory_snapshot(tmp_path, node_lost):
    """Two ranks, a snapshot in RAM after every step and on disk every 8: killed while writing the step-11 snapshot,
    they resume from the step-10 one in RAM (not the step-8 one on disk) to the same losses and samples. With
    rank 1's RAM wiped as well (its node lost), rank 1's part comes from the replica rank 0 holds."""
    from holotrain.train.checkpoint import memory_root
    from holotrain.train.snapshots import local_steps

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = {"training.steps": 16, "checkpoint.every": 8, "checkpoint.memory_every": 1, "data.log_samples": True}
    torchrun(2, "train", *tiny_args(full, **common))
    torchrun(2, "train", *tiny_args(resumed, **common), env={"HOLOTRAIN_KILL_DURING_SAVE": "11"}, ok=False)
    for rank, holder in ((0, 1), (1, 0)):
        # Its own: step 11 was never completed (a rank killed before starting it may still hold step 9 too).
        assert max(local_steps(resumed, rank)[0]) == 10
        assert max(local_steps(resumed, holder)[1]) == 10  # its replica, held by the other rank
    if node_lost:
        shutil.rmtree(memory_root(resumed) / "rank-1")
    out = torchrun(2, "train", *tiny_args(resumed, **common))
    assert "resuming from the in-memory snapshot in " in out and "(step 10)" in out
    assert [r["loss"] for r in read_metrics(resumed)] == [r["loss"] for r in read_metrics(full)]
    assert (resumed / "samples.jsonl").read_text() == (full / "samples.jsonl").read_text()
    assert not memory_root(resumed).exists()
