"""Time the interpreter spends in its cyclic garbage collector (`host.gc_s` per step), and the freeze that keeps it
small.

A full collection walks every tracked object. After the first step the process holds the model, the compiled graphs
and their caches (some 0.5M objects), and a walk over them takes 0.3 s or so: a stall the GPU waits out whenever
the collector happens to start inside forward. Those objects live for the whole run, so `freeze_long_lived()` moves
them out of the collector's sight, after the first step and again at the first logged step (FP8 "delayed" compiles
its main variant in the second step: on the H200 the full collections that walked it took 0.08-0.17 s). After the
first freeze the interpreter makes no full collection of its own (young generations are collected as usual); the
trainer asks for one every FULL_EVERY_STEPS steps, which bounds what cyclic garbage can pile up.
"""

from __future__ import annotations

import gc
import time

FULL_EVERY_STEPS = 1000
_NEVER = 2**31 - 1  # a generation-2 threshold that is never reached


class GcClock:
    """Sums the duration of every collection (any thread of this process) between calls to `collect`."""

    def __init__(self):
        self._seconds = 0.0
        self._count = 0
        self._started: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._count += int(info.get("generation") == 2)
            self._started = None

    def collect(self, steps: int) -> dict[str, float]:
        """Seconds per step spent collecting, and the number of full collections, since the last call."""
        out = {"host.gc_s": self._seconds / steps, "host.gc_full": self._count}
        self._seconds, self._count = 0.0, 0
        return out

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def freeze_long_lived() -> None:
    """Collects once, then exempts every object alive now from later collections (see the module's note)."""
    gc.collect()
    gc.freeze()


def stop_full_collections() -> tuple[int, ...]:
    """No more full collections of the interpreter's own (see the module's note); returns the thresholds to
    restore."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], _NEVER)
    return thresholds


def thaw(thresholds: tuple[int, ...] | None) -> None:
    """The run is over: what was frozen is collectable again (a process may train several models in turn), with
    the interpreter's own thresholds."""
    gc.unfreeze()
    if thresholds is not None:
        gc.set_threshold(*thresholds)
