"""torch.profiler traces of chosen steps (`profile.trace_steps`), as gzipped Chrome/Perfetto JSON in RUN_DIR/traces.

Consecutive steps share one trace file (`trace_step10-11_rank0.json.gz`). A trace larger than
`profile.trace_max_mb` keeps only its longest events, so a long step never fills the disk; what was
dropped is counted in the file's `holotrain` entry.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def _runs(steps: list[int]) -> list[tuple[int, int]]:
    """Sorted steps grouped into inclusive runs of consecutive numbers: [3, 10, 11] -> [(3, 3), (10, 11)]."""
    runs: list[tuple[int, int]] = []
    for s in sorted(set(steps)):
        if runs and s == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    return runs


def bound_trace(trace: dict, max_bytes: int) -> dict:
    """Keep the longest complete events until the JSON fits in max_bytes; metadata events always stay."""
    events = trace.get("traceEvents", [])
    if len(json.dumps(trace)) <= max_bytes:
        return trace
    meta = [e for e in events if e.get("ph") == "M"]
    timed = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: -float(e.get("dur", 0)))
    budget = max_bytes - len(json.dumps({**trace, "traceEvents": meta})) - 256
    kept = []
    for event in timed:
        cost = len(json.dumps(event)) + 2
        if cost > budget:
            break
        budget -= cost
        kept.append(event)
    dropped = len(events) - len(meta) - len(kept)
    return {**trace, "traceEvents": meta + kept, "holotrain": {"dropped_events": dropped, "max_bytes": max_bytes}}


class StepTracer:
    """Call `before(step)` and `after(step)` around each training step (1-based step numbers)."""

    def __init__(self, steps: list[int], run_dir: Path, rank: int, max_mb: float, cuda: bool):
        self.runs = _runs(steps)
        self.dir = Path(run_dir) / "traces"
        self.rank = rank
        self.max_bytes = int(max_mb * 2**20)
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.active: tuple[profile, tuple[int, int]] | None = None
        self.written: list[Path] = []

    def before(self, step: int) -> None:
        for run in self.runs:
            if run[0] == step and self.active is None:
                prof = profile(activities=self.activities, record_shapes=False, with_stack=False)
                prof.start()
                self.active = (prof, run)

    def after(self, step: int) -> None:
        if self.active is None or self.active[1][1] != step:
            return
        prof, (first, last) = self.active
        self.active = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"trace_step{first}" + (f"-{last}" if last != first else "") + f"_rank{self.rank}.json.gz"
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            trace = bound_trace(json.loads(raw.read_text()), self.max_bytes)
        out = self.dir / name
        part = out.with_name(out.name + ".tmp")
        with gzip.open(part, "wt") as f:
            json.dump(trace, f)
        os.replace(part, out)
        self.written.append(out)

    def close(self) -> None:
        """A run that ends (or crashes) inside a traced range drops that partial trace."""
        if self.active is not None:
            self.active[0].stop()
            self.active = None
