"""A run directory belongs to one job and one process at a time.

- The lock: RUN_DIR/.lock, held with flock(2) for the whole run by the job's first rank and naming its host and pid.
  A second process into the same directory is refused at once, in one line; the kernel drops the lock when its
  holder dies (even by SIGKILL), so a lock left by a dead run is simply taken over.
- Ownership: a job whose model, tokenizer or data differ from the directory's config.toml is refused before
  anything is written there, naming the first differing keys, so that a second job started in the same folder never
  overwrites a run's config, tokenizer or checkpoints.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from holotrain.errors import ConfigError
from holotrain.model.args import FIELDS, ModelArgs
from holotrain.model.registry import DEFAULT_FAMILY

LOCK = ".lock"

# What makes a run directory's run what it is: its model, and the data and tokenizer its checkpoints were trained
# on. The rest (steps, learning rate, parallel layout, memory levers, logging) may change between a run's sessions.
OWNED_SECTIONS = ("model",)
OWNED_DATA_KEYS = ("sources", "seq_len", "tokenizer", "chat_template")
IGNORED_MODEL_KEYS = ("preset",)  # a preset's name: the dimensions it resolved to are compared instead


class RunDirLock:
    """flock on RUN_DIR/.lock (see the module's docstring). `acquire` raises ConfigError naming the holder."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self._file = None

    def acquire(self) -> None:
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise ConfigError(f"{self.path.parent} is in use by {holder}: wait for that run to end, or give this "
                              "job another job.run_dir") from None
        f.seek(0)
        f.truncate()
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {since}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def check_writable(run_dir: Path) -> None:
    """The run directory can be made and written to, or one ConfigError naming it (before any work starts)."""
    probe = Path(run_dir) / f".write-test-{os.getpid()}"
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"job.run_dir: cannot write to {run_dir} ({e.strerror or e}): choose another "
                          "job.run_dir") from None


def saved_config(run_dir: Path) -> dict | None:
    """The run directory's config.toml as written (None when it has none)."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path} does not read as TOML ({e}): it is not a holotrain run's config; choose "
                          "another job.run_dir") from None


def implied_model(section: dict) -> dict:
    """A saved model section with the keys it lacks (a run saved before they existed) as their values then: the
    family's default, head_dim = dim / n_heads, no switch on."""
    known = {k: v for k, v in section.items() if k in FIELDS}
    if not {"dim", "n_heads"} <= set(known):
        return section
    implied = ModelArgs(**{**known, "family": known.get("family") or DEFAULT_FAMILY})
    return {**{f: getattr(implied, f) for f in FIELDS if f not in section}, **section}


def differences(saved: dict, job: dict, saved_tokenizer: bytes | None, job_tokenizer: bytes) -> list[str]:
    """`section.key: saved -> this job's` for every owned key that differs, the tokenizer included. A key the saved
    config lacks (one a later holotrain added) had its default then."""
    from holotrain.config import Config

    out = []
    saved = {**saved, "model": implied_model(saved.get("model", {}))}
    defaults = Config().to_dict()
    for section in OWNED_SECTIONS:
        keys = sorted(set(saved.get(section, {})) | set(job.get(section, {})))
        for key in keys:
            if key in IGNORED_MODEL_KEYS:
                continue
            old, new = saved.get(section, {}).get(key, defaults.get(section, {}).get(key)), job.get(section, {}).get(key)
            if key == "init_from":
                old, new = _path(old), _path(new)
            if _normal(old) != _normal(new):
                out.append(f"{section}.{key}: {_short(old)} -> {_short(new)}")
    for key in OWNED_DATA_KEYS:
        old, new = saved.get("data", {}).get(key), job.get("data", {}).get(key)
        if key == "sources":
            old, new = _sources(old), _sources(new)
        elif key in ("tokenizer", "chat_template"):
            old, new = _path(old), _path(new)
        if _normal(old) != _normal(new):
            out.append(f"data.{key}: {_short(old)} -> {_short(new)}")
    if saved_tokenizer is not None and saved_tokenizer != job_tokenizer:
        out.append("tokenizer.json: another vocabulary")
    return out


def check_ownership(run_dir: Path, job: dict, job_tokenizer: bytes, resume: bool) -> dict | None:
    """Refuses, in one ConfigError line, a job that is not the run directory's own. `job`: the resolved config as a
    dict; `resume`: checkpoint.resume. Returns the directory's saved config (None for a new run directory) for the
    caller to compare the rest with (the learning-rate schedule)."""
    run_dir = Path(run_dir)
    saved = saved_config(run_dir)
    if saved is None:
        return None
    tokenizer = run_dir / "tokenizer.json"
    diff = differences(saved, job, tokenizer.read_bytes() if tokenizer.is_file() else None, job_tokenizer)
    if not diff:
        return saved
    has_checkpoints = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    if not resume and not has_checkpoints:
        return None  # checkpoint.resume = false into a directory with nothing to resume: a fresh start
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    raise ConfigError(f"{run_dir} holds another job's run ({shown}): give this job its own directory with "
                      "--job.run_dir=DIR (or a job.name), or start afresh with --checkpoint.resume=false in an empty "
                      "one; its config is in " + str(run_dir / "config.toml"))


def _path(value):
    """A path compared as an absolute one (older runs saved them as given); a name (chatml) or "" as it is."""
    if not value or not isinstance(value, str) or ("/" not in value and "." not in value):
        return value
    return os.path.abspath(os.path.expanduser(value))


def _sources(sources) -> list | None:
    """Data sources compared by what they read."""
    if sources is None:
        return None
    return [{**s, "path": _path(s.get("path"))} for s in map(dict, sources)]


def _normal(value):
    """TOML has no None and no tuples: compare as they round-trip."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in sorted(value.items())}
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
