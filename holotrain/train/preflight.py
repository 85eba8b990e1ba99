"""Every input of a job checked in the trainer's process before any work starts, each failure one ConfigError line
(exit 2): the run directory (writable, not in use, this job's own, room for a checkpoint), the data (paths, formats,
a sample of each source's records, the tokenizer, the chat template) and model.init_from (read by config.resolve).
Mistakes that would otherwise surface minutes later, inside a data-plane process or at the first save, surface in
seconds. Rank 0 checks what the job shares; every rank raises the same line."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from holotrain.config import Config
from holotrain.errors import ConfigError
from holotrain.parallel import DistEnv
from holotrain.train.checkpoint import checkpoint_bytes, list_checkpoints
from holotrain.train.rundir import RunDirLock, check_ownership, check_writable


def agree(env: DistEnv, check) -> object:
    """Runs `check()` on rank 0 and raises its ConfigError on every rank (one line each, the same line); returns
    rank 0's result on rank 0 and None elsewhere."""
    result, message = None, None
    if env.is_main:
        try:
            result = check()
        except ConfigError as e:
            message = str(e)
    if env.world_size > 1:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        raise ConfigError(message)
    return result


def claim_run_dir(cfg: Config, env: DistEnv) -> RunDirLock | None:
    """Collective. The run directory writable and locked for this job (rank 0 holds the lock; None elsewhere)."""
    def claim():
        check_writable(cfg.run_dir)
        lock = RunDirLock(cfg.run_dir)
        lock.acquire()
        return lock

    return agree(env, claim)


def check_data(cfg: Config, env: DistEnv) -> None:
    """Collective. The data section's files (holotrain.data.inputs), before the tokenizer is trained or loaded."""
    from holotrain.data.inputs import check_inputs

    agree(env, lambda: check_inputs(cfg.data))


def check_run_dir_owner(cfg: Config, env: DistEnv, tokenizer_path: Path) -> dict | None:
    """Collective. This job is the run directory's own (train/rundir.py); returns the directory's saved config on
    rank 0 (None for a new run, and on other ranks)."""
    return agree(env, lambda: check_ownership(cfg.run_dir, cfg.to_dict(), Path(tokenizer_path).read_bytes(),
                                              cfg.checkpoint.resume))


def check_room(cfg: Config, env: DistEnv, n_params: int) -> None:
    """Collective. The run directory's disk holds at least one checkpoint of this job when it saves any (a full
    disk later in the run is survived: train/checkpointer.py)."""
    c = cfg.checkpoint
    if not (c.every or c.save_final):
        return

    def room():
        need = checkpoint_bytes(n_params, cfg.memory.adamw_moments, cfg.memory.offload_delayed_update)
        # A save makes room by removing the run's older checkpoints (all but the newest intact one): they count.
        older = [path for _, path in list_checkpoints(cfg.run_dir)[:-1]]
        older += list((Path(cfg.run_dir) / "checkpoints").glob(".tmp-step-*"))
        free = shutil.disk_usage(cfg.run_dir).free + sum(_bytes(path) for path in older)
        if free < need:
            raise ConfigError(f"job.run_dir: {cfg.run_dir} has {_size(free)} free, and one checkpoint of this job "
                              f"takes {_size(need)}: point job.run_dir at a larger disk, or set checkpoint.every = 0 "
                              "and checkpoint.save_final = false")

    agree(env, room)


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
