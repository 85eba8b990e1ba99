"""A full disk is survived: a save that finds no room removes older checkpoints (never the newest intact one) or is
skipped in one line, a write that fails midway leaves nothing behind, and training goes on; the end of the run names
the newest intact checkpoint (or fails in one line when the final one could not be written), and it resumes."""

import contextlib
import errno
import os
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from holotrain.errors import SaveFailed
from holotrain.parallel import DistEnv
from holotrain.train import checkpoint
from holotrain.train.checkpoint import NotWritten, damage, list_checkpoints, write_checkpoint
from tests.conftest import read_metrics, run_cli, tiny_args

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A file system of `size` at `path` (RAM-backed, so its free space is exact); skips the test where mounting
    one is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8): the full-disk scenario needs a disk that fills")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mounting a small tmpfs is not permitted here ({proc.stderr.strip()})")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)  # still busy: detached now, freed when let go


def _steps(run_dir) -> list[int]:
    return [step for step, _ in list_checkpoints(run_dir)]


def test_a_full_disk_mid_run_is_survived_and_the_newest_checkpoint_resumes(tmp_path):
    """The tiny model's checkpoint takes about 2.1 MB (2.5 MB asked for); its run directory is on a 6 MB disk, so
    the third save (step 6) finds no room. It removes the oldest checkpoint but the newest intact one and is
    written, and so is every later one: the run ends with exit 0, naming step 8, from which the next run resumes."""
    with tmpfs(tmp_path / "small", "6m") as disk:
        run_dir = disk / "run"
        proc = run_cli("train", *tiny_args(run_dir, **{"training.steps": 8, "checkpoint.every": 2}))
        out = proc.stdout + proc.stderr
        assert "Traceback" not in out
        ckpts = run_dir / "checkpoints"
        assert f"holotrain: checkpoint: removed {ckpts / 'step-2'} to make room for step 6" in proc.stdout
        assert f"holotrain: checkpoint: removed {ckpts / 'step-4'} to make room for step 8" in proc.stdout
        assert proc.stdout.strip().splitlines()[-1] == f"holotrain: newest intact checkpoint: {ckpts / 'step-8'} (step 8)"
        assert _steps(run_dir) == [6, 8] and not list(ckpts.glob(".tmp-*"))
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 9))

        proc = run_cli("train", *tiny_args(run_dir, **{"training.steps": 9, "checkpoint.every": 2}))
        assert f"holotrain: resuming from checkpoint {ckpts / 'step-8'} (step 8)" in proc.stdout
        assert "Traceback" not in proc.stdout + proc.stderr
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 10))
        assert _steps(run_dir) == [8, 9]


def test_a_final_checkpoint_the_disk_cannot_hold_ends_the_run_with_exit_4(tmp_path):
    """On a 3 MB disk the tiny model's second checkpoint (the final one, step 4) finds no room, and the first is the
    newest intact one, which is kept: the save is skipped in one warning line, the run ends with exit 4 and one
    error line naming step 2, and nothing half-written is left."""
    with tmpfs(tmp_path / "small", "3m") as disk:
        run_dir = disk / "run"
        proc = run_cli("train", *tiny_args(run_dir, **{"training.steps": 4, "checkpoint.every": 2}), check=False)
        ckpts = run_dir / "checkpoints"
        assert proc.returncode == 4, proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr
        assert f"holotrain: warning: no checkpoint at step 4: {ckpts} has " in proc.stdout
        [line] = proc.stderr.strip().splitlines()
        assert line.startswith(f"holotrain: error: the final checkpoint (step 4) could not be written: {ckpts} has ")
        assert line.endswith(f"and no older checkpoint is left to remove. The newest intact checkpoint is "
                             f"{ckpts / 'step-2'} (step 2); make room and run the same command again to go on from it")
        assert _steps(run_dir) == [2] and not list(ckpts.glob(".tmp-*"))


def _state(numel: int = 1 << 20) -> dict:
    return {"model": {"w": torch.ones(numel), "v": torch.arange(numel // 2, dtype=torch.float32)},
            "optim": {"step": torch.tensor(3.0)}}


Usage = namedtuple("Usage", "total used free")


def _virtual_disk(monkeypatch, run_dir: Path, capacity: int) -> None:
    """The checkpoints' disk as holding `capacity` bytes, of which the run directory's files take their sizes."""
    def usage(path):
        used = sum(f.stat().st_size for f in Path(run_dir).rglob("*") if f.is_file())
        return Usage(capacity, used, max(0, capacity - used))

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", usage)


def test_no_room_removes_what_is_least_worth_keeping_and_never_the_newest_intact(tmp_path, monkeypatch, capsys):
    """Checkpoints 2, 4 and 6 (keep = 3), 6 damaged: the save of step 8 on a full disk removes the damaged one
    first, not the oldest; then with even less room, everything but the newest intact one goes, and when that is
    not enough the save is skipped (NotWritten, one line) with that checkpoint untouched."""
    state = _state()
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step, state, {"step": step}, keep=3)
    (tmp_path / "checkpoints" / "step-6" / "trainer_state.json").write_text("{")  # damaged, still as large
    ckpt_bytes = sum(f.stat().st_size for f in (tmp_path / "checkpoints" / "step-2").iterdir())
    used = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())

    _virtual_disk(monkeypatch, tmp_path, used + ckpt_bytes // 4)
    write_checkpoint(tmp_path, 8, state, {"step": 8}, keep=3)
    assert _steps(tmp_path) == [2, 4, 8]
    out = capsys.readouterr().out
    assert f"removed {tmp_path / 'checkpoints' / 'step-6'} to make room for step 8" in out and "step-2" not in out

    # Too little room even with the two older checkpoints gone: they go, the newest intact stays, the save is skipped.
    _virtual_disk(monkeypatch, tmp_path, used - 2 * ckpt_bytes + ckpt_bytes // 4)
    with pytest.raises(NotWritten, match=r"checkpoints has [\d.]+ MB free, a checkpoint of this run needs [\d.]+ MB, "
                                         r"and no older checkpoint is left to remove$"):
        write_checkpoint(tmp_path, 10, state, {"step": 10}, keep=3)
    assert _steps(tmp_path) == [8] and damage(tmp_path / "checkpoints" / "step-8") is None
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def _full_at(when: str, victim: str = "__0_1.distcp"):
    """FileSystem.create_stream as on a disk that fills while DCP writes `victim` (on whichever of its threads takes
    that file): opening it fails, or closing it does."""
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if Path(path).name == victim and when == "open":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with real(self, path, mode) as stream:
            yield stream
            if Path(path).name == victim:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return create_stream


@pytest.mark.parametrize("when", ["close", "open"])
def test_a_write_that_fails_midway_leaves_nothing_behind(tmp_path, monkeypatch, capfd, when):
    """The disk fills while DCP's threads write the files (the room check passed): the save raises NotWritten on
    the caller's thread, with the error of whichever thread hit it and no traceback printed by that thread; the
    partial .tmp-step-N is removed and the previous checkpoint is untouched. The next save writes normally."""
    state = _state()
    write_checkpoint(tmp_path, 2, state, {"step": 2}, keep=2, threads=2)
    monkeypatch.setattr(FileSystem, "create_stream", _full_at(when))
    with pytest.raises(NotWritten, match=r"writing it into .*checkpoints failed \(No space left on device\); its "
                                         r"partial files were removed"):
        write_checkpoint(tmp_path, 4, state, {"step": 4}, keep=2, threads=2)
    assert _steps(tmp_path) == [2] and damage(tmp_path / "checkpoints" / "step-2") is None
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert "Traceback" not in capfd.readouterr().err
    monkeypatch.undo()
    write_checkpoint(tmp_path, 4, state, {"step": 4}, keep=2, threads=2)
    assert _steps(tmp_path) == [2, 4]


def test_a_real_disk_that_fills_during_the_write(tmp_path, monkeypatch, capfd):
    """The same on a 1 MB tmpfs that the room check is told has room for a 6 MB state: DCP's own writes hit
    ENOSPC, and nothing is left on the disk."""
    with tmpfs(tmp_path / "tiny", "1m") as disk:
        monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(1 << 40, 0, 1 << 40))
        with pytest.raises(NotWritten, match=r"No space left on device"):
            write_checkpoint(disk, 2, _state(), {"step": 2}, keep=2, threads=2)
        assert list((disk / "checkpoints").iterdir()) == []
        assert "Traceback" not in capfd.readouterr().err


def _optimizer(width: int = 256):
    from holotrain.config import TrainingConfig
    from holotrain.optim import AdamWHyper, DeviceAdamW

    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    optimizer = DeviceAdamW(model, AdamWHyper.from_section(TrainingConfig()), 1e-3, sharded=False)
    model(torch.randn(4, width)).sum().backward()
    optimizer.begin(1e-3, 1)
    optimizer.finish()
    return optimizer


@pytest.mark.parametrize("async_save", [True, False])
def test_the_end_of_a_run_names_the_newest_intact_checkpoint_or_fails_when_the_final_save_did(
        tmp_path, monkeypatch, capsys, async_save):
    """Through Checkpoints, as the trainer saves (in the background or not): a save that cannot be written is one
    warning line and nothing is raised at the next save or at close(); finish() then raises SaveFailed naming the
    newest intact checkpoint when the final save was the one lost, and otherwise prints that checkpoint."""
    from holotrain.config import CheckpointConfig
    from holotrain.train.checkpointer import Checkpoints

    optimizer = _optimizer()
    section = CheckpointConfig(every=1, keep=2, async_save=async_save)
    ckpts = Checkpoints(section, CPU, tmp_path, total_steps=3)
    ckpts.prepare(optimizer)
    files = {"data_state.json": "{}"}
    ckpts.save(ckpts.due(1), 1, optimizer, files)
    ckpts.disk.wait()  # written before the disk fills
    monkeypatch.setattr(FileSystem, "create_stream", _full_at("close", "__0_0.distcp"))
    ckpts.save(ckpts.due(2), 2, optimizer, files)
    ckpts.save(ckpts.due(3), 3, optimizer, files)  # waits for step 2's write, whose failure is not raised
    ckpts.close()
    out = capsys.readouterr().out
    assert "holotrain: warning: no checkpoint at step 2: writing it into" in out
    assert "training goes on (newest intact checkpoint: step-1)" in out
    assert ckpts.final_unwritten() is not None and ckpts.newest_intact().name == "step-1"
    with pytest.raises(SaveFailed, match=r"^the final checkpoint \(step 3\) could not be written: writing it into "
                                         r".*No space left on device.*The newest intact checkpoint is "
                                         rf"{tmp_path / 'checkpoints' / 'step-1'} \(step 1\); make room and run "
                                         r"the same command again to go on from it$"):
        ckpts.finish()

    monkeypatch.undo()
    ckpts = Checkpoints(section, CPU, tmp_path, total_steps=4)
    ckpts.save(ckpts.due(4), 4, optimizer, files)
    ckpts.close()
    ckpts.finish()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"holotrain: newest intact checkpoint: {tmp_path / 'checkpoints' / 'step-4'} (step 4)"


def test_checkpoint_bytes_counts_weights_and_adamw_moments(tmp_path):
    """The preflight estimate: 12 bytes a parameter (fp32 weights and two fp32 moments), 8 with bf16 moments, 14
    with a delayed offload update's working weights, and a fixed allowance; within a few percent of what a
    checkpoint of a 1M-parameter model takes."""
    n = 10_000_000
    fixed = checkpoint.checkpoint_bytes(0)
    assert checkpoint.checkpoint_bytes(n) - fixed == 12 * n
    assert checkpoint.checkpoint_bytes(n, adamw_moments="bf16") - fixed == 8 * n
    assert checkpoint.checkpoint_bytes(n, delayed_update=True) - fixed == 14 * n

    optimizer = _optimizer(1024)
    n_params = sum(p.numel() for p in optimizer.model.parameters())
    path = checkpoint.save_checkpoint(tmp_path, 1, optimizer, {"step": 1}, keep=1)
    written = sum(f.stat().st_size for f in path.iterdir())
    assert abs(checkpoint.checkpoint_bytes(n_params) - written) < 0.03 * written, (n_params, written)
