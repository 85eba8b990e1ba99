"""Distributed checkpoints (torch.distributed.checkpoint), written atomically, loaded without arbitrary pickle.

Layout: RUN_DIR/checkpoints/step-N/ holds the DCP shards of model + optimizer + RNG and
`trainer_state.json` (step, data position). A checkpoint is written into `.tmp-step-N/` and renamed
into place only after every rank has finished and every file is synced, so a crash mid-save leaves
the previous checkpoint as the newest complete one. Loading reads DCP's metadata through an unpickler
that admits only DCP's own metadata classes, and tensors with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

_STEP_DIR = re.compile(r"step-(\d+)")
TRAINER_STATE = "trainer_state.json"

# Everything DCP's .metadata file may name; anything else is refused.
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _SAFE_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type) or not callable(obj):
                return obj
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is not allowed")


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank) if rank is not None else self._get_metadata_path()
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes a single process when no process group exists; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m and (p / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(
    run_dir: Path, step: int, model: torch.nn.Module, optimizer, trainer_state: dict, keep: int,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Collective: every rank calls it. `optimizer` (holotrain.optim.StepOptimizer) gives the training state, model
    included, keyed by parameter name. `extra_files` (name -> text, given on rank 0) are written into the
    checkpoint before it is published. Returns the final checkpoint directory."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
    _barrier()
    with _quiet_single_process():
        dcp.save({**optimizer.state_dict(), "rng": _rng_state()}, checkpoint_id=tmp)
    _maybe_inject_fault(step)
    if _rank() == 0:
        # trainer_state.json goes last: its presence marks a checkpoint whose files are all written.
        for name, text in [*(extra_files or {}).items(), (TRAINER_STATE, json.dumps(trainer_state))]:
            with open(tmp / name, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
    _barrier()
    if _rank() == 0:
        os.rename(tmp, final)
        _fsync_dir(root)
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer) -> dict:
    """Collective. Restores model, optimizer and RNG in place; returns the trainer state."""
    state = {**optimizer.state_dict(), "rng": _rng_state()}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path))
    optimizer.load_state_dict(state)
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return json.loads((Path(path) / TRAINER_STATE).read_text())


def load_model_weights(path: Path, model: torch.nn.Module) -> None:
    """Model weights only (for export and evaluation); no process group needed."""
    model_sd = get_state_dict(model, [], options=StateDictOptions())[0]
    state = {"model": model_sd}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path))
    model.load_state_dict(state["model"])


def _maybe_inject_fault(step: int) -> None:
    """Crash-test hook: HOLOTRAIN_KILL_DURING_SAVE=N kills this process after the shards of step N are
    written but before the checkpoint is complete, as a power loss or OOM kill would."""
    target = os.environ.get("HOLOTRAIN_KILL_DURING_SAVE")
    if target is not None and int(target) == step:
        os.kill(os.getpid(), signal.SIGKILL)
