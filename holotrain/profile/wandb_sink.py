"""Weights & Biases as a metrics sink (profile.wandb): the main rank's metrics rows, as the TensorBoard writer sees
them, logged to one W&B run per run directory.

The run is named job.name and its id is the run directory's `run_id` (written by the trainer before the levers are
built), with resume="allow": a resumed run directory continues the same W&B run; a run directory deleted and started
afresh gets a new one. wandb's files go to RUN_DIR/wandb/ (an offline run: RUN_DIR/wandb/offline-run-*, uploaded
later by `wandb sync`). The run's config is the resolved config, read back from RUN_DIR/config.toml. wandb is imported
only when asked for; without it the run stops at startup with one line saying how to install it."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from holotrain.errors import ConfigError
from holotrain.profile.metrics import layer_scalars

if TYPE_CHECKING:
    from holotrain.profile.config import ProfileConfig

INSTALL = 'pip install "holotrain[wandb]"'
RUN_ID_FILE = "run_id"  # the run directory's identity (holotrain/train/checkpoint.py: RUN_ID)


def _missing(detail: str) -> ConfigError:
    return ConfigError(f"profile.wandb = true needs the wandb package, which {detail}: {INSTALL} "
                       "(or --profile.wandb=false)")


def check_installed() -> None:
    """At startup, on every rank (cheap: nothing is imported): ConfigError unless wandb can be imported."""
    try:
        found = importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise _missing("is not installed")


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise _missing("is not installed" if isinstance(e, ModuleNotFoundError) and e.name == "wandb"
                       else f"does not import ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return wandb


def _resolved_config(run_dir: Path) -> dict[str, Any]:
    try:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python < 3.11
            import tomli as tomllib
        with open(run_dir / "config.toml", "rb") as f:
            return tomllib.load(f)
    except (OSError, ValueError):
        return {}


def _run_id(run_dir: Path) -> str | None:
    try:
        return (run_dir / RUN_ID_FILE).read_text().strip() or None
    except OSError:
        return None


def scalars(row: dict) -> dict[str, float]:
    """A row's numeric scalars under the TensorBoard writer's names (dots become slashes: eval.loss -> eval/loss,
    eval.<source>.loss -> eval/<source>/loss, time.forward -> time/forward); `step` and what is not a finite number
    (None, lists, strings, booleans) are left out, but for a mixture-of-experts model's per-layer lists, one scalar
    per block (metrics.layer_scalars)."""
    return {**{k.replace(".", "/"): v for k, v in row.items()
               if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)},
            **layer_scalars(row)}


class WandbSink:
    """One W&B run; log() each metrics row, close() once (finishes the run, marked failed while an exception is
    propagating: the trainer closes its sinks in a `finally`)."""

    def __init__(self, run):
        self.run = run
        self._said_skip = False

    def log(self, row: dict) -> None:
        step = int(row["step"])
        if step < self.run.step:  # a resumed W&B run already holds this step (logged after the last checkpoint)
            if not self._said_skip:
                print(f"holotrain: wandb: run {self.run.id} already holds steps up to {self.run.step - 1}; the "
                      "resumed run's steps up to there are not logged to it again", flush=True)
                self._said_skip = True
            return
        self.run.log(scalars(row), step=step, commit=True)

    def close(self) -> None:
        failed = sys.exc_info()[0] is not None
        self.run.finish(exit_code=1 if failed else 0)


def open_sink(section: ProfileConfig, run_dir: Path) -> WandbSink:
    """The main rank's W&B run for this run directory (wandb.init). ConfigError, in one line, when wandb is not
    installed or the run cannot start (not logged in, say)."""
    wandb = _import_wandb()
    run_dir = Path(run_dir)
    config = _resolved_config(run_dir)
    name = (config.get("job") or {}).get("name") or run_dir.name
    try:
        run = wandb.init(project=section.wandb_project, entity=section.wandb_entity or None, name=name,
                         id=_run_id(run_dir), resume="allow", dir=str(run_dir), mode=section.wandb_mode,
                         config=config)
    except Exception as e:  # wandb's errors (no API key, no network, a bad entity) have no common base class
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"profile.wandb: wandb.init failed ({first}); log in with `wandb login` or WANDB_API_KEY, "
                          "or use --profile.wandb_mode=offline and upload later with `wandb sync`") from None
    return WandbSink(run)
