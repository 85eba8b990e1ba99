"""Step phase clock: how long each part of a training step takes (`time.forward`, `time.backward`, ...).

On GPU each phase is bracketed by CUDA events that are read only when metrics are logged, after the step's
own synchronization, so timing adds no wait to the hot path. On CPU the phases are wall-clock. Levers add
their own phases (offload transfers, exposed communication) with `clock.phase(name)`.

The clock also notes when each top-level phase began (host clock, time.time(): comparable across processes and,
to the clocks' synchronization, across nodes), so the straggler check (stragglers.py) can tell a rank that was slow
in a phase from one that waited there for a rank that came in late.

Fault injection for tests: HOLOTRAIN_SLOW_RANK="rank:phase:seconds" (e.g. "1:forward:0.2") holds that rank in that
phase for the given seconds at every step, after the phase's own work, so the rank leaves the phase late as one whose
compute is slow does.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict

import torch

from holotrain.errors import ConfigError


class PhaseClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds: dict[str, float] = defaultdict(float)
        self._open: list[str] = []  # names of the phases now open, outermost first
        # When top-level phases began since the last collect(): name -> [sum of (time.time() - origin), count]
        self._origin = time.time()  # subtracted before summing, so that float sums keep sub-microsecond precision
        self._began: dict[str, list] = defaultdict(lambda: [0.0, 0])
        self.began: dict[str, float] = {}  # the last collected interval's mean start time of each top-level phase
        self._slow = slow_rank_fault()

    @contextlib.contextmanager
    def phase(self, name: str, stream: torch.cuda.Stream | None = None):
        """Times the enclosed work; `stream` times work queued on a side stream (offload copies, communication).

        A phase opened inside another is reported under both names (`time.forward.offload_wait`): it is part of
        its parent's time, so a breakdown stacks only the top-level phases."""
        if not self._open:
            began = self._began[name]
            began[0] += time.time() - self._origin
            began[1] += 1
        name = ".".join(self._open + [name])
        self._open.append(name.rsplit(".", 1)[-1])
        try:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                yield
                if self._slow is not None and self._slow[0] == name:
                    torch.cuda.current_stream().synchronize()  # the device idles for the delay, as the events see it
                    time.sleep(self._slow[1])
                end.record(stream)
                self._pending.append((name, start, end))
            else:
                t0 = time.perf_counter()
                yield
                if self._slow is not None and self._slow[0] == name:
                    time.sleep(self._slow[1])
                self._seconds[name] += time.perf_counter() - t0
        finally:
            self._open.pop()

    def add(self, name: str, seconds: float) -> None:
        """A host-side duration measured elsewhere (e.g. waiting for data)."""
        self._seconds[name] += seconds

    def collect(self, steps: int) -> dict[str, float]:
        """Mean seconds per step of each phase since the last call; call after the device is synchronized."""
        for _, _, end in self._pending:
            end.synchronize()  # a phase may still be running (side streams too): wait for it, at log time only
        for name, start, end in self._pending:
            self._seconds[name] += start.elapsed_time(end) / 1000.0
        out = {f"time.{name}": total / steps for name, total in self._seconds.items()}
        self.began = {name: self._origin + total / count for name, (total, count) in self._began.items()}
        self._pending.clear()
        self._seconds.clear()
        self._began.clear()
        return out


def slow_rank_fault() -> tuple[str, float] | None:
    """HOLOTRAIN_SLOW_RANK="rank:phase:seconds": (phase, seconds) on that rank, None elsewhere and without it."""
    spec = os.environ.get("HOLOTRAIN_SLOW_RANK")
    if not spec:
        return None
    try:
        rank, phase, seconds = spec.split(":")
        rank, seconds = int(rank), float(seconds)
    except ValueError:
        raise ConfigError(f"HOLOTRAIN_SLOW_RANK must be rank:phase:seconds (e.g. 1:forward:0.2), got {spec!r}") from None
    return (phase, seconds) if rank == int(os.environ.get("RANK", "0")) else None
