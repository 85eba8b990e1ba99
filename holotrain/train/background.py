"""What a saver that writes in the background shares: one write thread at a time, its error handed back to the
training thread, and the time the loop was blocked against the time the writes took."""

from __future__ import annotations

import os
import threading
import time

_NICE = 19  # the write thread's (and the threads it starts') scheduling priority: lowest


def yield_cpu_to_training() -> None:
    """Lowers the calling thread's CPU priority (threads it starts inherit it). A write competes for cores with the
    offload engine's CPU step, which the GPU waits for; at the lowest priority it only takes cores left idle."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)
    except (AttributeError, OSError):
        pass  # not Linux (per-thread priorities), or not permitted: the write just competes


class BackgroundWriter:
    what = "a checkpoint"  # for the error message

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._blocking_s = 0.0  # since the last metrics() call
        self.blocking_total_s = 0.0  # since the start: the goodput account's checkpoint time
        self._write_s: list[float] = []
        self._lock = threading.Lock()

    def _start(self, target, *args, name: str) -> None:
        """Runs target(*args) on the write thread; its error is raised by the next wait()."""

        def run():
            yield_cpu_to_training()
            t0 = time.perf_counter()
            try:
                target(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread at its next save or at close
                self._error = e
                return
            self._written(time.perf_counter() - t0)

        self._thread = threading.Thread(target=run, name=name)
        self._thread.start()

    def _written(self, seconds: float) -> None:
        with self._lock:
            self._write_s.append(seconds)

    def _blocked(self, since: float) -> None:
        elapsed = time.perf_counter() - since
        self._blocking_s += elapsed
        self.blocking_total_s += elapsed

    def wait(self) -> None:
        """Until the write under way (if any) is complete; raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing {self.what} failed") from error

    def join(self, timeout: float | None = None) -> bool:
        """Waits up to `timeout` seconds for the write under way; True when no write is left running (its error,
        if any, is still raised by the next wait())."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def metrics(self, steps: int) -> dict:
        """time.checkpoint: seconds per step the loop was blocked by saves since the last call; checkpoint.write_s:
        the background writes that finished since then (seconds each, summed; None when none did)."""
        with self._lock:
            written, self._write_s = self._write_s, []
        blocking, self._blocking_s = self._blocking_s, 0.0
        return {"time.checkpoint": blocking / max(1, steps), "checkpoint.write_s": sum(written) if written else None}
