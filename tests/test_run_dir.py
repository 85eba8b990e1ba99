"""A run directory belongs to one job and one process: a second job in the same folder never changes a run's files,
a second process is refused at once, inputs are checked before anything starts, and a resume says how its
learning-rate schedule changed."""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from holotrain.errors import ConfigError
from holotrain.train.rundir import RunDirLock, check_ownership, differences
from tests.conftest import REPO, run, run_cli_here, tiny_args


def _cli(*args, cwd, timeout=300) -> subprocess.CompletedProcess:
    return run(["-m", "holotrain.cli", *args], {"PYTHONPATH": str(REPO)}, timeout, cwd)


def _hashes(run_dir: Path) -> dict[str, str]:
    files = [run_dir / "config.toml", run_dir / "tokenizer.json", *sorted((run_dir / "checkpoints").rglob("*"))]
    return {str(f.relative_to(run_dir)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


def _no_run_dir(args: list[str]) -> list[str]:
    return [a for a in args if not a.startswith("--job.run_dir=")]


def test_a_second_job_in_the_same_folder_never_changes_the_first_run(tmp_path):
    """The first job (no config file) trains into runs/default; a second, different job with no job.run_dir either
    trains into a directory named after its own config file or, with the same name, is refused in one line with
    exit 2 — and the first run's config, tokenizer and checkpoints are byte for byte as they were."""
    first = _no_run_dir(tiny_args(None, **{"training.steps": 2, "checkpoint.every": 2}))
    proc = _cli("train", *first, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "runs" / "default"
    before = _hashes(run)
    assert "checkpoints/step-2/trainer_state.json" in before

    # A different model, same (default) name: refused before anything is written, naming the differing key.
    other = _no_run_dir(tiny_args(None, **{"training.steps": 2, "model.dim": 96}))
    proc = _cli("train", *other, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert "runs/default" in lines[0] and "model.dim: 64 -> 96" in lines[0] and "--job.run_dir" in lines[0]
    assert _hashes(run) == before

    # A job from its own config file trains into runs/<the file's name>, leaving runs/default alone.
    (tmp_path / "wider.toml").write_text("[model]\ndim = 96\n")
    proc = _cli("train", "--config", "wider.toml", *other, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "runs" / "wider" / "checkpoints" / "step-2").is_dir()
    assert _hashes(run) == before


def test_a_second_process_is_refused_at_once(tmp_path):
    """The lock names the holder; a lock whose holder died (flock is dropped by the kernel) is taken over."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from holotrain.train.rundir import RunDirLock; "
        f"lock = RunDirLock({str(tmp_path)!r}); lock.acquire(); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.perf_counter()
        proc = run_cli_here("train", *tiny_args(tmp_path))
        assert proc.returncode == 2 and time.perf_counter() - t0 < 10
        assert f"is in use by pid {holder.pid} on" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    finally:
        holder.kill()
        holder.wait()
    lock = RunDirLock(tmp_path)
    lock.acquire()  # the dead holder's lock
    assert f"pid {os.getpid()}" in (tmp_path / ".lock").read_text()
    lock.release()


def test_ownership_compares_the_model_the_data_and_the_tokenizer(tmp_path):
    saved = {"model": {"dim": 64, "preset": "tiny", "init_from": ""},
             "data": {"seq_len": 32, "sources": [{"name": "a", "path": "/x/a.jsonl"}], "tokenizer": "",
                      "chat_template": ""},
             "training": {"steps": 10}}
    job = {**saved, "model": {**saved["model"], "preset": "125m"}, "training": {"steps": 20}}
    assert differences(saved, job, b"tok", b"tok") == []  # a longer run, the same dimensions under another preset
    job["data"] = {**saved["data"], "sources": [{"name": "a", "path": "/x/b.jsonl"}]}
    assert differences(saved, job, b"tok", b"other") == [
        "data.sources: [{'name': 'a', 'path': '/x/a.jsonl'}] -> [{'name': 'a', 'path': '/x/b.jsonl'}]",
        "tokenizer.json: another vocabulary"]

    import tomli_w

    (tmp_path / "config.toml").write_text(tomli_w.dumps(saved))
    (tmp_path / "tokenizer.json").write_bytes(b"tok")
    with pytest.raises(ConfigError, match="holds another job's run"):
        check_ownership(tmp_path, job, b"tok", resume=True)
    # checkpoint.resume = false into a directory with nothing to resume: a fresh start is allowed
    assert check_ownership(tmp_path, job, b"tok", resume=False) is None
    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds another job's run"):
        check_ownership(tmp_path, job, b"tok", resume=False)


def test_an_unwritable_run_directory_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    proc = run_cli_here("train", *tiny_args(tmp_path / "file" / "run"))
    assert proc.returncode == 2
    assert proc.stderr.startswith("holotrain: error: job.run_dir: cannot write to") and proc.stderr.count("\n") == 1


def test_a_missing_data_path_with_init_from_is_one_line_in_seconds(tmp_path):
    """A fine-tune (model.init_from: the tokenizer is given, so no source is read to train one) with a mistyped data
    path is refused in the trainer's process before anything starts, not by a data plane minutes later; a relative
    path in the TOML resolves against the file's folder, and the message names the path it looked for."""
    from tests.hf_models import make_hf_model

    make_hf_model(tmp_path / "hf", "gqa_tied")
    (tmp_path / "sft.toml").write_text(
        f'[model]\ninit_from = "{tmp_path / "hf"}"\n[[data.sources]]\nname = "sft"\npath = "data/sfft.jsonl"\n'
        'format = "chat"\n')
    t0 = time.perf_counter()
    proc = _cli("train", "--config", str(tmp_path / "sft.toml"), "--job.device=cpu", "--data.seq_len=32",
                f"--job.run_dir={tmp_path / 'run'}", cwd=REPO, timeout=60)
    assert time.perf_counter() - t0 < 30
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "data" / "sfft.jsonl") in lines[0], proc.stderr
    assert not (tmp_path / "run" / "config.toml").exists()


def test_a_disk_without_room_for_one_checkpoint_is_refused_before_the_first_step(tmp_path, monkeypatch):
    """The run's older checkpoints count as room (a save removes them to make it); the disk's own free space is
    faked here, as a CI machine's cannot be made small without a mount."""
    from collections import namedtuple

    from holotrain.train import preflight

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**5, 10**5))
    proc = run_cli_here("train", *tiny_args(tmp_path / "run"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "has 0.1 MB free, and one checkpoint of this job takes" in proc.stderr
    assert not (tmp_path / "run" / "config.toml").exists()


def test_a_key_added_since_the_run_was_saved_counts_as_its_default():
    """A run saved before a config key existed resumes when the job leaves that key at its default; a job that sets
    it otherwise is another job."""
    from holotrain.config import Config

    job = Config().to_dict()
    saved = {section: dict(keys) for section, keys in job.items() if isinstance(keys, dict)}
    del saved["model"]["router_bias_rate"], saved["memory"]["ffn_tiles"]
    assert differences(saved, job, None, b"") == []
    job["model"]["router_bias_rate"] = 0.01
    assert differences(saved, job, None, b"") == ["model.router_bias_rate: 0.001 -> 0.01"]
