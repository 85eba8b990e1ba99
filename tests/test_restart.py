"""torchrun --max-restarts: a rank SIGKILLed mid-run is restarted with its peer, and the job resumes from its newest
disk checkpoint to the same losses and samples as a run that was never interrupted."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO, read_metrics, tiny_args
from tests.test_distributed import torchrun


def _workers(launcher: psutil.Process) -> dict[tuple[int, int], psutil.Process]:
    """torchrun's training processes by (attempt, rank): its own children (the data plane, loaders and resource
    trackers the workers start are grandchildren)."""
    found = {}
    for p in launcher.children():
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "RANK" in env and "TORCHELASTIC_RESTART_COUNT" in env:  # not yet, between fork and exec
            found[int(env["TORCHELASTIC_RESTART_COUNT"]), int(env["RANK"])] = p
    return found


def _in_store(worker: psutil.Process, port: int) -> bool:
    """Whether the worker has connected to torchrun's store (it is inside init_process_group)."""
    try:
        return any(c.raddr and c.raddr.port == port for c in worker.net_connections(kind="tcp"))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _wait_for(what: str, predicate, proc: subprocess.Popen, timeout: float = 120.0):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"gave up waiting for {what} (torchrun exit code {proc.poll()})")


@pytest.mark.slow
def test_one_rank_killed_under_torchrun_max_restarts_recovers_exactly(tmp_path):
    """Rank 1 is SIGKILLed at step 6 or later (disk checkpoints every 4 steps, no in-memory snapshots). torchrun
    stops rank 0 (SIGTERM) and starts both again; they resume from the newest checkpoint (step 4, or 8 if written by
    then). The restarted rank 1 is held (SIGSTOP) until the restarted rank 0 is in init_process_group: a rank 0 that
    read the killed attempt's address of rank 1 from torchrun's store (kept across restarts) then fails every time,
    not only when it happens to win the race."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    common = {"training.steps": 12, "checkpoint.every": 4, "data.log_samples": True}
    torchrun(2, "train", *tiny_args(full, **common))

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "holotrain.cli", "train", *tiny_args(killed, **common)]
    out_path, err_path = tmp_path / "torchrun.out", tmp_path / "torchrun.err"  # files: a full pipe would block it
    with open(out_path, "w") as out_file, open(err_path, "w") as err_file:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out_file, stderr=err_file,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    launcher, metrics = psutil.Process(proc.pid), killed / "metrics.jsonl"
    try:
        victim = _wait_for("rank 1", lambda: _workers(launcher).get((0, 1)), proc)
        # Killed once the step-4 checkpoint is complete (renamed into place) and training has gone past it.
        _wait_for("step 6 and the step-4 checkpoint", lambda: (killed / "checkpoints" / "step-4").is_dir()
                  and len(metrics.read_text().splitlines()) >= 6, proc)
        victim.send_signal(signal.SIGKILL)

        late = _wait_for("the restarted rank 1", lambda: _workers(launcher).get((1, 1)), proc)
        late.send_signal(signal.SIGSTOP)  # caught while it imports: long before it reaches the store
        try:
            first = _wait_for("the restarted rank 0", lambda: _workers(launcher).get((1, 0)), proc)
            port = int(first.environ()["MASTER_PORT"])
            _wait_for("the restarted rank 0 in init_process_group", lambda: _in_store(first, port), proc)
            time.sleep(1.0)  # it has read rank 1's address by now, if the store had one for it
        finally:
            late.send_signal(signal.SIGCONT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:  # the test failed: no process of this run outlives it
            for p in [*launcher.children(recursive=True), launcher]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            proc.wait()
    out, err = out_path.read_text(), err_path.read_text()
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{out[-3000:]}\n{err[-8000:]}"
    resumed = re.search(r"resuming from .* \(step (\d+)\)", out)
    assert resumed and 0 < int(resumed[1]) < 12, out[-3000:]  # from a checkpoint, not from scratch
    assert [r["loss"] for r in read_metrics(killed)] == [r["loss"] for r in read_metrics(full)]
    assert [r["step"] for r in read_metrics(killed)] == list(range(1, 13))
    assert (killed / "samples.jsonl").read_text() == (full / "samples.jsonl").read_text()


def test_store_of_a_torchrun_attempt_has_its_own_keys(monkeypatch, capsys):
    """Under one torchrun agent each restart's process groups meet under a key prefix of their own in the agent's
    store; without the agent's store (or with several agents, whose restart counts disagree) torch's env:// stays."""
    import torch.distributed as dist

    from holotrain.parallel.launch import _restart_safe_store

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # stands in for the agent's store
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    assert _restart_safe_store(0, 2) == {}  # not launched by torchrun

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    for attempt in (0, 1):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        kwargs = _restart_safe_store(1, 2)
        assert (kwargs["rank"], kwargs["world_size"]) == (1, 2)
        kwargs["store"].set("rank_1", f"address of attempt {attempt}")
    assert server.get("holotrain/attempt-0/rank_1") == b"address of attempt 0"
    assert server.get("holotrain/attempt-1/rank_1") == b"address of attempt 1"

    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert _restart_safe_store(0, 4) == {}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().err
