"""Step phase clock: how long each part of a training step takes (`time.forward`, `time.backward`, ...).

On GPU each phase is bracketed by CUDA events that are read only when metrics are logged, after the step's
own synchronization, so timing adds no wait to the hot path. On CPU the phases are wall-clock. Levers add
their own phases (offload transfers, exposed communication) with `clock.phase(name)`.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class PhaseClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds: dict[str, float] = defaultdict(float)
        self._open: list[str] = []  # names of the phases now open, outermost first

    @contextlib.contextmanager
    def phase(self, name: str, stream: torch.cuda.Stream | None = None):
        """Times the enclosed work; `stream` times work queued on a side stream (offload copies, communication).

        A phase opened inside another is reported under both names (`time.forward.offload_wait`): it is part of
        its parent's time, so a breakdown stacks only the top-level phases."""
        name = ".".join(self._open + [name])
        self._open.append(name.rsplit(".", 1)[-1])
        try:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                yield
                end.record(stream)
                self._pending.append((name, start, end))
            else:
                t0 = time.perf_counter()
                yield
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
        self._pending.clear()
        self._seconds.clear()
        return out
