"""Distributed checkpoints (torch.distributed.checkpoint), written atomically, loaded without arbitrary pickle.

Layout: RUN_DIR/checkpoints/step-N/ holds the DCP shards of model + optimizer + RNG, `manifest.json` (every
file's size) and `trainer_state.json` (step). A checkpoint is written into `.tmp-step-N/` and renamed into place
only after every rank has finished and every file is synced, so a crash mid-save leaves the previous checkpoint
as the newest complete one; one damaged later (a truncated or missing file) is detected against the manifest or
when it fails to load, and the previous one is used. One that is intact but holds other tensors than the job's
(another model or setting) is a mismatch (CheckpointMismatch), not damage. Loading reads DCP's metadata through an
unpickler that admits only DCP's own metadata classes, and tensors with `torch.load(weights_only=True)`. Writing
in the background, while training goes on, is train/checkpointer.py's.

A full disk does not stop the run: a save that finds no room removes older checkpoints (never the newest intact
one) until it fits, and one that still does not fit, or whose write fails midway, leaves nothing behind and raises
NotWritten, which the caller reports in one line before training goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import signal
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from holotrain.train.dcpwriter import Writer, write_error

_STEP_DIR = re.compile(r"step-(\d+)")
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"  # every file's size, to tell a complete checkpoint from a truncated one

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


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if _is_dist():
        dist.barrier(group=group)


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


RUN_ID = "run_id"


def memory_root(run_dir: Path) -> Path:
    """Where this run's in-memory snapshots live: host RAM that outlives the process (/dev/shm, a tmpfs), one
    folder per run directory, laid out like a run directory (checkpoints/step-N)."""
    key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    return base / f"holotrain-{key}"


def run_id(run_dir: Path) -> str | None:
    """The run directory's identity: a memory snapshot is this run's only if it carries the same id (a run
    directory deleted and started afresh gets a new one, so a stale snapshot in RAM is never resumed)."""
    try:
        return (Path(run_dir) / RUN_ID).read_text().strip() or None
    except OSError:
        return None


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class NotWritten(Exception):
    """A checkpoint that could not be written (no room on its disk, or its write failed midway): nothing of it is
    left behind, every rank raises it with the same verdict, and the message says why in one line."""


# What a checkpoint holds besides its tensors' bytes, for the check that the disk has room: DCP's framing of each
# tensor in its files and its metadata entry (under 2 KiB measured), and the small files (metadata, data position).
_TENSOR_OVERHEAD = 4096
_FILES_OVERHEAD = 256 << 10


def checkpoint_bytes(n_params: int, adamw_moments: str = "fp32", delayed_update: bool = False) -> int:
    """About how many bytes one checkpoint of a model with `n_params` parameters takes on disk (all ranks together):
    the fp32 weights (the offload engine saves its fp32 masters in their place), AdamW's two moments (fp32, or bf16
    with memory.adamw_moments = "bf16"), the bf16 working weights that memory.offload_delayed_update saves too,
    and a fixed allowance for the metadata, RNG and data position. Not counted: each tensor's framing (about 2 KiB;
    the room check before a save counts it)."""
    moment = 2 if adamw_moments == "bf16" else 4
    return n_params * (4 + 2 * moment + (2 if delayed_update else 0)) + _FILES_OVERHEAD


def write_checkpoint(run_dir: Path, step: int, state: dict, trainer_state: dict, keep: int,
                     extra_files: dict[str, str] | None = None, group: dist.ProcessGroup | None = None,
                     threads: int = 1, protect: int | None = None) -> Path:
    """Collective over `group` (default: the default group): writes `state` (tensors DCP can save: on the device,
    or a host snapshot of them) as RUN_DIR/checkpoints/step-N atomically. `extra_files` (name -> text, given on
    rank 0) are written into the checkpoint before it is published; then a manifest of every file's size, then
    trainer_state.json, whose presence marks a complete checkpoint. `threads`: files written at once by this rank.
    Returns the final checkpoint directory; NotWritten (on every rank) when there is no room for it even after
    removing older checkpoints, or when writing it failed."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    rank = dist.get_rank(group) if _is_dist() else 0
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(group)
    short = _make_room(Path(run_dir), step, state, group)
    if short is not None:
        raise NotWritten(short)
    error = None
    try:
        with _quiet_single_process():
            dcp.save(state, storage_writer=Writer(tmp, thread_count=threads), process_group=group)
        fault_point(step)
        if rank == 0:
            for name, text in (extra_files or {}).items():
                _write_synced(tmp / name, text)
            sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            _write_synced(tmp / MANIFEST, json.dumps(sizes))
            _write_synced(tmp / TRAINER_STATE, json.dumps(trainer_state))  # last: marks the checkpoint complete
            _fsync_dir(tmp)
    except (OSError, CheckpointException) as e:
        error = write_error(e)
        if error is None:
            raise
    failed = _any_rank(error is not None, group)  # also the barrier: every rank's part is written
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint is never left to be mistaken for one
        _barrier(group)
        why = (error.strerror or str(error)) if error is not None else "on another rank"
        raise NotWritten(f"writing it into {root} failed ({why}); its partial files were removed")
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # a checkpoint of the same step is replaced only by a complete one
        os.rename(tmp, final)
        _fsync_dir(root)
        for old_step, old in list_checkpoints(run_dir)[:-keep]:
            if old_step != protect:  # the best checkpoint (checkpoint.keep_best) stays
                shutil.rmtree(old, ignore_errors=True)
        for stale in root.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier(group)
    return final


def _any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Collective: whether `flag` holds on any rank of `group`."""
    value = torch.tensor([int(flag)])
    if _is_dist():
        if dist.get_backend(group) == "nccl":
            value = value.cuda()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def _state_bytes(state: dict) -> int:
    """This rank's bytes of `state` on disk: its tensors' (local shards') and their framing."""
    def tensors(tree):
        for value in tree.values():
            if isinstance(value, dict):
                yield from tensors(value)
            elif isinstance(value, torch.Tensor):
                yield value.to_local() if hasattr(value, "to_local") else value

    return sum(t.numel() * t.element_size() + _TENSOR_OVERHEAD for t in tensors(state))


def _make_room(run_dir: Path, step: int, state: dict, group: dist.ProcessGroup | None) -> str | None:
    """Collective. Makes room for the checkpoint of `step` before anything of it is written (the ranks of a node
    share the disk), so that a full disk, or a RAM-backed one filling the host's memory, is found before a write
    and not halfway through it. While any rank finds too little room, rank 0 removes what is least worth keeping
    (leftovers of unfinished saves, damaged checkpoints, then the oldest; never the newest intact checkpoint).
    Returns None when there is room, else why not in one line."""
    root = run_dir / "checkpoints"
    rank = dist.get_rank(group) if _is_dist() else 0
    need = (_state_bytes(state) + _FILES_OVERHEAD) * int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    while True:
        free = shutil.disk_usage(root).free
        if not _any_rank(need > free, group):
            return None
        removed = None
        if rank == 0:
            victim = _least_worth_keeping(run_dir)
            if victim is not None:
                shutil.rmtree(victim, ignore_errors=True)
                if not victim.exists():
                    removed = victim
                    print(f"holotrain: checkpoint: removed {victim} to make room for step {step} ({root} had "
                          f"{_size(free)} free, {_size(need)} is needed)", flush=True)
        if not _any_rank(removed is not None, group):
            where = " (on some rank, if this one has more)" if _is_dist() and dist.get_world_size(group) > 1 else ""
            return (f"{root} has {_size(free)} free{where}, a checkpoint of this run needs {_size(need)}, and no "
                    "older checkpoint is left to remove")


def _least_worth_keeping(run_dir: Path) -> Path | None:
    """What a save that finds no room removes first: a leftover of a save that did not finish, then a damaged
    checkpoint, then the oldest intact one; never the newest intact checkpoint. None when nothing is left."""
    root = run_dir / "checkpoints"
    leftovers = sorted(root.glob(".tmp-step-*"))
    if leftovers:
        return leftovers[0]
    keep = newest_intact(run_dir)
    others = [(damage(path) is None, step, path) for step, path in list_checkpoints(run_dir) if path != keep]
    return min(others)[2] if others else None


def newest_intact(run_dir: Path) -> Path | None:
    """The newest checkpoint of the run whose files are all there, by its manifest (see damage)."""
    for _, path in reversed(list_checkpoints(run_dir)):
        if damage(path) is None:
            return path
    return None


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def save_checkpoint(run_dir: Path, step: int, optimizer, trainer_state: dict, keep: int,
                    extra_files: dict[str, str] | None = None) -> Path:
    """Collective, blocking: the training state of `optimizer` (holotrain.optim.StepOptimizer: model included,
    keyed by parameter name) and the RNG, written where they are."""
    return write_checkpoint(run_dir, step, training_state(optimizer), trainer_state, keep, extra_files)


def training_state(optimizer, held=None) -> dict:
    """What a checkpoint holds: the optimizer's state dict (model included; `held`'s state when given, see
    StepOptimizer.hold) and the RNG states."""
    return {**(held.state if held is not None else optimizer.state_dict()), "rng": _rng_state()}


_hold_reasons: set[str] = set()


def prepare_hold(optimizer, env) -> bool:
    """Whether saves can hold the optimizer's host-resident state (StepOptimizer.hold) instead of copying it while
    the loop waits; prepares it. Where it cannot, with state on the host, says why once."""
    why = optimizer.prepare_hold()
    if why is not None and optimizer.held_paths and env.is_main and why not in _hold_reasons:
        _hold_reasons.add(why)
        print(f"holotrain: checkpoints block while the offloaded state is copied: {why}", flush=True)
    return why is None


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be used (a missing or truncated file, against its manifest), or None.
    Checkpoints without a manifest are only checked for their metadata file; loading finds the rest."""
    path = Path(path)
    try:
        json.loads((path / TRAINER_STATE).read_text())
    except (OSError, ValueError) as e:
        return f"{TRAINER_STATE} unreadable ({e.__class__.__name__})"
    if not (path / ".metadata").is_file():
        return "no .metadata file"
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None
    try:
        sizes = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return f"{MANIFEST} unreadable"
    for name, size in sizes.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    return None


class _DropLoaderTracebacks(logging.Filter):
    """DCP's loader logs a traceback to the root logger when a checkpoint's metadata does not load, before it
    raises; the caller reports a damaged checkpoint in one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.pathname.endswith(os.path.join("checkpoint", "state_dict_loader.py"))


def agreed(reason: str | None) -> str | None:
    """A checkpoint is usable only if every rank finds it intact (each checks the files it sees)."""
    if not _is_dist():
        return reason
    bad = torch.tensor([0 if reason is None else 1], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        bad = bad.cuda()
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return reason if reason is not None or not bad.item() else "damaged on another rank"


class CheckpointMismatch(ValueError):
    """A checkpoint whose files are readable but whose tensors are not this job's (another model or setting): the
    message names the first differing entry."""


def load_checkpoint(path: Path, optimizer) -> dict:
    """Collective. Restores model, optimizer and RNG in place; returns the trainer state. CheckpointMismatch when
    the checkpoint lacks an entry of this job's state or holds it in another shape; any other error when it cannot
    be read."""
    state = training_state(optimizer)
    quiet = _DropLoaderTracebacks()
    logging.getLogger().addFilter(quiet)
    reader = SafeFileSystemReader(path)
    try:
        _drop_unsaved_optional(state, optimizer, reader)
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path, storage_reader=reader)
        apply_loaded(state, optimizer)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - told apart below, then raised again
        difference = _first_difference(state, reader)
        if difference is not None:
            raise CheckpointMismatch(difference) from error
        raise
    finally:
        logging.getLogger().removeFilter(quiet)
    return json.loads((Path(path) / TRAINER_STATE).read_text())


def _first_difference(state: dict, reader: SafeFileSystemReader) -> str | None:
    """The first tensor of `state` that the checkpoint's metadata lacks or has in another shape; None when every
    one matches, or when the metadata does not read (then the checkpoint is damaged, not another job's)."""
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - unreadable metadata is damage, which the caller reports
        return None

    def entries(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from entries(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    for key, value in entries(state):
        if not isinstance(value, torch.Tensor):
            continue  # other values are saved whole (DCP's bytes), and how DCP keys them varies
        if key not in saved:
            return f"{key} is not in the checkpoint"
        shape = getattr(saved[key], "size", None)
        if shape is not None and tuple(shape) != tuple(value.shape):
            return f"{key} is {list(shape)} there, {list(value.shape)} here"
    return None


def _drop_unsaved_optional(state: dict, optimizer, reader) -> None:
    """Entries of the state that a checkpoint may lack (StepOptimizer.optional_paths: e.g. what only a run with a
    setting on saves) are not asked of a checkpoint that does not have them; the optimizer's load_state_dict then
    finds them missing."""
    optional = getattr(optimizer, "optional_paths", ())
    if not optional:
        return
    saved = reader.read_metadata().state_dict_metadata
    for keys in optional:
        prefix = ".".join(keys) + "."
        if not any(k.startswith(prefix) for k in saved):
            parent = state
            for k in keys[:-1]:
                parent = parent[k]
            parent.pop(keys[-1], None)


def apply_loaded(state: dict, optimizer) -> None:
    """After training_state(optimizer)'s tensors were filled from a checkpoint: the optimizer's remaining state and
    the RNG."""
    optimizer.load_state_dict(state)
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"])


def why_unusable(error: BaseException) -> str:
    """One line for a checkpoint that failed to load."""
    text = str(error).strip()
    return f"{error.__class__.__name__}: {text.splitlines()[0][:200] if text else ''}"


def load_model_weights(path: Path, model: torch.nn.Module) -> None:
    """Model weights only (for export and evaluation); no process group needed."""
    model_sd = get_state_dict(model, [], options=StateDictOptions())[0]
    reader = SafeFileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    # A balancing bias the saved model lacked (model.router_bias turned on for a fine-tune) keeps its zeros.
    absent = [k for k in model_sd if k.endswith(".expert_bias") and f"model.{k}" not in saved]
    for key in absent:
        model_sd.pop(key)
    state = {"model": model_sd}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path, storage_reader=reader)
    model.load_state_dict(state["model"], strict=not absent)


def fault_point(step: int) -> None:
    """Crash-test hook: HOLOTRAIN_KILL_DURING_SAVE=N kills this process after the data of the checkpoint (or
    in-memory snapshot) of step N is written but before it is complete, as a power loss or OOM kill would."""
    target = os.environ.get("HOLOTRAIN_KILL_DURING_SAVE")
    if target is not None and int(target) == step:
        os.kill(os.getpid(), signal.SIGKILL)
