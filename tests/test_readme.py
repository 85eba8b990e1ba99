"""The README's commands: the two set-up commands are .ci/run's, and every other command in its shell blocks runs here
as a user would type it, in a fresh folder (the GPU figures are in its table, each with the command that measured
it)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

HERE = ("holotrain generate", "holotrain export", "holotrain train --help")


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300
    first = next(i for i, line in enumerate(lines) if line.startswith("```bash"))
    assert lines[first + 1].startswith("pip install") and lines[first + 1].endswith("&& holotrain train")
    for link in re.findall(r"\]\(([^)#]+)\)", "\n".join(lines)):  # every page it links to exists
        assert (REPO / link).exists(), link


def test_the_setup_commands_are_what_ci_runs():
    setup = [c for c in readme_commands() if c.startswith("pip install")]
    assert len(setup) == 2, setup
    train_install, train = setup[0].split(" && ")
    test_install, tests = setup[1].split(" && ")
    assert train == "holotrain train" and train_install == test_install.replace('-e ".[test]"', "-e .")
    ci = (REPO / ".ci" / "run").read_text()
    assert test_install.replace("pip install", "python3 -m pip install -q") in ci
    assert tests.replace("python -m", "python3 -m") in ci


def _holotrain(command: str, cwd: Path, **kw) -> subprocess.Popen | subprocess.CompletedProcess:
    import shlex

    args = [sys.executable, "-m", "holotrain.cli", *shlex.split(command)[1:]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if kw.pop("background", False):
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path):
    """`holotrain train` on the embedded default, stopped by Ctrl-C (SIGINT) after its first logged rows: it saves
    the step it stopped at and prints the command that resumes; then each command of the README's next block runs
    on that run as written."""
    commands = readme_commands()
    others = [c for c in commands if not c.startswith("pip install")]
    assert others and all(c.startswith(HERE) for c in others), f"a README command no test runs: {others}"

    proc = _holotrain("holotrain train", tmp_path, background=True)
    metrics = tmp_path / "runs" / "default" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not (metrics.is_file() and metrics.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    assert "holotrain train" in out.splitlines()[-1] or "resume" in out.lower(), out[-2000:]
    assert list((tmp_path / "runs" / "default" / "checkpoints").glob("step-*"))

    for command in others:
        done = _holotrain(command, tmp_path)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        if command.startswith("holotrain generate"):
            assert len(done.stdout) > 1  # 32 tokens (after ten steps, often blank lines)
        if command.startswith("holotrain export"):
            assert (tmp_path / command.split()[-1] / "config.json").is_file()
        if command.startswith("holotrain train --help"):
            assert "training.steps" in done.stdout
