import atexit
import contextlib
import fcntl
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import zygote

REPO = Path(__file__).resolve().parents[1]
# Commands run forked from a process that has imported holotrain and torch (tests/zygote.py); with this set to 1,
# each is a new interpreter, as a user starts it (slower by seconds a command).
FRESH = os.environ.get("HOLOTRAIN_TEST_FRESH_PROCESSES") == "1"
_server: subprocess.Popen | None = None


def _session_root(tmp_path_factory) -> Path:
    """A folder every test process of this run shares: pytest-xdist gives each worker its own base folder, under a
    common parent."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def corpus_cache(tmp_path_factory):
    """One corpus/tokenizer cache for the whole run, outside the user's home (builds publish by rename, so workers
    that build it at once leave one copy)."""
    cache = _session_root(tmp_path_factory) / "holotrain-cache"
    cache.mkdir(exist_ok=True)
    os.environ["HOLOTRAIN_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def _machine_lock(tmp_path_factory) -> Path:
    return _session_root(tmp_path_factory) / "machine.lock"


@pytest.fixture(autouse=True)
def _shares_the_machine(_machine_lock):
    """Tests run two at a time (pytest-xdist); each holds the machine lock shared, so that one that times the
    machine (quiet_machine) runs alone."""
    with _machine_lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def quiet_machine(lock: Path):
    """The machine to this test alone: waits for the tests running beside it to finish and keeps others from
    starting (for a fixture whose measurements of time other tests' work would skew)."""
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def tiny_args(run_dir, **overrides) -> list[str]:
    """Command-line overrides for a model small enough to train in seconds on a CPU (on the CPU also on a machine
    with a GPU, where "auto" would take it: a test that wants the GPU says job.device = cuda)."""
    base = {
        "job.run_dir": str(run_dir),
        "job.device": "cpu",
        "model.dim": 64,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.n_kv_heads": 2,
        "model.ffn_dim": 176,
        "data.seq_len": 32,
        "data.vocab_size": 512,
        "data.tokenizer_sample_mb": 1,
        # A loader's unit of work: 50 KB of text (about 12k tokens) holds more than a 40-step run here trains on;
        # the default 1 MB would tokenize a hundred times that, most of a launch's CPU time.
        "data.chunk_mb": 0.05,
        "training.batch_size": 8,
        "training.steps": 12,
        "training.warmup_steps": 2,
        "training.log_every": 1,
        "checkpoint.every": 3,
        "profile.tensorboard": False,
        "profile.progress": False,
    }
    base.update(overrides)
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in base.items()]


def _zygote() -> str:
    """The socket of this test process's command server, started on first use."""
    global _server
    if _server is None:
        path = os.path.join(tempfile.mkdtemp(prefix="holotrain-zygote-"), "socket")
        _server = subprocess.Popen([sys.executable, "-m", "tests.zygote", "serve", path], cwd=REPO,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert _server.stdout.readline() == b"ready\n", "tests/zygote.py did not start"
        os.environ[zygote.ENV] = path  # for the ranks of torchrun commands (they are its clients)
        atexit.register(_server.stdin.close)  # the server ends when its stdin does
    return os.environ[zygote.ENV]


def launch(argv: list[str], env: dict | None = None, stdin=None, stdout=None, stderr=None, cwd=REPO):
    """`python <argv>` in `cwd` (argv: "-m", MODULE, ... or a script and its arguments), with os.environ
    and `env`: forked from this test process's command server, or a new interpreter with FRESH. stdin, stdout and
    stderr: open files (default /dev/null). Returns a Popen or its like (pid, poll, wait, send_signal, kill)."""
    server = None if FRESH else _zygote()  # before the environment is read: it names the server to torchrun's ranks
    env = {**os.environ, **(env or {})}
    with contextlib.ExitStack() as stack:
        null = [stack.enter_context(open(os.devnull, "r+b")) for _ in range(3)]
        stdio = [f if f is not None else n for f, n in zip((stdin, stdout, stderr), null)]
        if FRESH:
            return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdin=stdio[0], stdout=stdio[1],
                                    stderr=stdio[2])
        return zygote.Launched(server, list(argv), env, str(cwd), tuple(f.fileno() for f in stdio))


def torchrun_argv(nproc: int, *target: str, options: tuple = ()) -> list[str]:
    """torchrun on `nproc` local ranks, each running `target` (a script and its arguments, or "-m", MODULE, ...); the
    ranks are clients of the command server unless FRESH."""
    ranks = list(target) if FRESH else [str(REPO / "tests" / "zygote.py"), *target]
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *options, *ranks]


def run(argv: list[str], env=None, timeout=600, cwd=REPO) -> subprocess.CompletedProcess:
    """launch(argv) to its end, its stdout and stderr captured as text (the command is killed after `timeout`)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = launch(argv, env, stdout=out, stderr=err, cwd=cwd)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode())
    return subprocess.CompletedProcess(argv, code, *texts)


def run_cli(*args, env=None, check=True, timeout=600) -> subprocess.CompletedProcess:
    proc = run(["-m", "holotrain.cli", *args], env, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"holotrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_worker(script: str, nproc: int, ok: str, timeout: int = 300) -> str:
    """Runs tests/<script> under torchrun on `nproc` gloo ranks (one thread each); asserts it exits 0 having printed
    `ok`, and returns its stdout and stderr together."""
    proc = run(torchrun_argv(nproc, f"tests/{script}"), {"OMP_NUM_THREADS": "1"}, timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and ok in proc.stdout, out[-6000:]
    return out


def run_cli_here(*args) -> subprocess.CompletedProcess:
    """holotrain's main() in this process, for a command that ends at a user error before anything starts (a
    process of its own costs seconds of startup). An exception that escapes main() fails the test."""
    from holotrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(["holotrain", *args], code, out.getvalue(), err.getvalue())


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sigkill_after(args: list[str], run_dir, kill_after: int, sig=None, until=None) -> int:
    """Runs `holotrain <args>` and SIGKILLs it (or sends `sig`) once metrics.jsonl holds `kill_after` rows (and
    `until()` holds, when given); returns the rows logged."""
    import signal
    import time

    sig = signal.SIGKILL if sig is None else sig
    proc = launch(["-m", "holotrain.cli", *args])
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_after and (until is None or until()):
            proc.send_signal(sig)
            break
        time.sleep(0.002)
    proc.wait()
    # SIGTERM unwinds the run (the checkpoint writer finishes), then exits with 128 + 15.
    expected = -signal.SIGKILL if sig == signal.SIGKILL else 128 + sig
    assert proc.returncode == expected, f"run ended with {proc.returncode}, not by the signal at step {kill_after}"
    from holotrain.jsonl import read_jsonl

    return len(read_jsonl(metrics))  # whole rows: the kill may have cut the last one short
