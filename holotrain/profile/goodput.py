"""Goodput: useful tokens per second of wall clock over the whole process, from its start, and where that wall
time went: start-up (process, data plane, model build, compilation), recovery (loading a checkpoint), training
steps, checkpoint blocking, data waits, and the rest (teardown, the last checkpoint's write, logging)."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

_IMPORTED = time.time()


def process_start_time() -> float:
    """This process's start, wall clock (Linux: /proc), else when this module was first imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks since boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


class Goodput:
    """Spans of this process's wall time; the trainer adds what it measures, the rest is "other"."""

    def __init__(self):
        self.start = process_start_time()
        self.ready: float | None = None  # when the first step began
        self.done: float | None = None  # when the last step ended
        self.recovery_s = 0.0
        self.first_step_s: float | None = None
        self.step_s: list[float] = []  # per-step times of logged intervals after the first
        self.data_wait_s = 0.0
        self.useful_tokens = 0

    def steps_begin(self) -> None:
        self.ready = time.time()

    def steps_end(self) -> None:
        self.done = time.time()

    def summary(self, checkpoint_s: float, now: float | None = None) -> dict:
        """The breakdown up to `now`; checkpoint_s: the loop's time blocked by saves so far."""
        now = time.time() if now is None else now
        wall = now - self.start
        ready = self.ready if self.ready is not None else now
        steady = statistics.median(self.step_s) if self.step_s else self.first_step_s or 0.0
        compile_s = max(0.0, (self.first_step_s or 0.0) - steady)  # the first step's compilation and warm-up
        startup = ready - self.start - self.recovery_s + compile_s
        in_steps = (self.done if self.done is not None else now) - ready
        train = max(0.0, in_steps - compile_s - self.data_wait_s - checkpoint_s)
        parts = {"startup": startup, "recovery": self.recovery_s, "train": train, "checkpoint": checkpoint_s,
                 "data_wait": self.data_wait_s}
        parts["other"] = max(0.0, wall - sum(parts.values()))
        return {"goodput": self.useful_tokens / wall if wall > 0 else None, "goodput.wall_s": wall,
                **{f"goodput.{k}_s": v for k, v in parts.items()}}

    def write(self, run_dir: Path, checkpoint_s: float) -> dict:
        """RUN_DIR/goodput.json: the whole process's breakdown (after teardown)."""
        out = self.summary(checkpoint_s)
        Path(run_dir, "goodput.json").write_text(json.dumps(out, indent=1))
        return out
