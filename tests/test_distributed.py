"""FSDP2 over two gloo processes must train like one process on the same global batch."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, read_metrics, run_cli, tiny_args


def torchrun(nproc: int, *args, env=None, ok=True) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "holotrain.cli", *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    if (proc.returncode == 0) != ok:
        # Keep the ranks' own output (torchrun's summary alone does not say why a rank died).
        raise AssertionError(f"torchrun exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n"
                             f"--- stderr ---\n{proc.stderr[-12000:]}")


@pytest.mark.slow
def test_two_process_fsdp_matches_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    common = {"training.steps": 8, "checkpoint.every": 4}
    run_cli("train", *tiny_args(one, **common), env={"OMP_NUM_THREADS": "1"})
    torchrun(2, "train", *tiny_args(two, **common))
    a, b = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=2e-4), (ra, rb)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-3)
    assert a[-1]["loss"] < a[0]["loss"]
    # The sharded checkpoint exports to one Hugging Face model file.
    run_cli("export", str(two), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 0


@pytest.mark.slow
def test_two_process_resume_continues_exactly(tmp_path):
    """Two ranks killed while saving step 6 resume from their sharded step-4 checkpoint to the same curve."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = {"training.steps": 8, "checkpoint.every": 2}
    torchrun(2, "train", *tiny_args(full, **common))
    torchrun(2, "train", *tiny_args(resumed, **common), env={"HOLOTRAIN_KILL_DURING_SAVE": "6"}, ok=False)
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-2", "step-4"]
    torchrun(2, "train", *tiny_args(resumed, **common))
    assert [r["loss"] for r in read_metrics(resumed)] == [r["loss"] for r in read_metrics(full)]


@pytest.mark.slow
def test_two_process_resume_from_an_in_memory_snapshot(tmp_path):
    """Two ranks on one node, a snapshot in RAM after every step and on disk every 8: killed while writing the
    step-11 snapshot, they resume from the step-10 one in RAM (not the step-8 one on disk) to the same curve."""
    from holotrain.train.checkpoint import list_checkpoints, memory_root

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = {"training.steps": 16, "checkpoint.every": 8, "checkpoint.memory_every": 1}
    torchrun(2, "train", *tiny_args(full, **common))
    torchrun(2, "train", *tiny_args(resumed, **common), env={"HOLOTRAIN_KILL_DURING_SAVE": "11"}, ok=False)
    assert [s for s, _ in list_checkpoints(memory_root(resumed))] == [10]
    torchrun(2, "train", *tiny_args(resumed, **common))
    assert [r["loss"] for r in read_metrics(resumed)] == [r["loss"] for r in read_metrics(full)]
    assert not memory_root(resumed).exists()
