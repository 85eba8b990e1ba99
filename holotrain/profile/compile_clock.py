"""Time spent compiling (`host.compile_s` per step): torch.compile's frames, and the backward graphs it compiles
when a backward first runs. Most of it falls in the first step, but a later step can compile too: a micro-batch
with documents to mask needs the blocks' second variant (per-token positions, a block mask) when the first such
batch arrives, which with a cold compile cache can take a large model's step ten times as long. The planner's
trials leave this time out of the step they measure: it is paid once per run, not per step."""

from __future__ import annotations

import threading
import time

from torch._dynamo.callback import callback_handler


class CompileClock:
    """Sums the wall time of the outermost compilations (the handler reports nested ones once) between calls to
    `collect`."""

    def __init__(self):
        self._seconds = 0.0
        self._started: float | None = None
        self._lock = threading.Lock()  # compilations may end on another thread (lazy backward under autograd's)
        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)

    def _on_start(self, *_args) -> None:  # torch passes CallbackArgs (releases before 2.7 passed nothing)
        with self._lock:
            self._started = time.perf_counter()

    def _on_end(self, *_args) -> None:
        with self._lock:
            if self._started is not None:
                self._seconds += time.perf_counter() - self._started
                self._started = None

    def collect(self, steps: int) -> dict[str, float]:
        """Seconds per step spent compiling since the last call."""
        with self._lock:
            out = {"host.compile_s": self._seconds / steps}
            self._seconds = 0.0
        return out

    def close(self) -> None:
        if self._on_start in callback_handler.start_callbacks:
            callback_handler.remove_start_callback(self._on_start)
        if self._on_end in callback_handler.end_callbacks:
            callback_handler.remove_end_callback(self._on_end)
