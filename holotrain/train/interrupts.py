"""Interrupts that save. The first SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption, torchrun stopping its
workers) asks the loop to stop after the step under way; the trainer then saves a checkpoint of that step and
exits with 128 + the signal's number. A second signal exits at once. Before the first step there is nothing to save,
so a signal then unwinds the start-up as an exit.

With several ranks, each may see its signal at a different step; the ranks agree on the step to stop at with one
small all-reduce per step on a gloo group of its own (host memory, no GPU synchronization), waited for a step
later, so that it never holds a rank's host back.

SIGUSR1 stops nothing: it prints every thread's Python stack to stderr (faulthandler), for a run that seems stuck
(`kill -USR1 PID`: where the first step's compilation, a collective or the data plane is waiting)."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _register_stack_dump() -> bool:
    """SIGUSR1 -> every thread's stack on the process's stderr (the real one: faulthandler writes to a file
    descriptor, which a captured sys.stderr, as in a test or a notebook, may not have). False where none has one."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return True
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            continue
    return False


class StopSignals:
    def __init__(self):
        self.signum = 0  # the first signal seen, 0 while none
        self.deferring = False  # in the step loop and after it: a signal waits for the end of the step
        self.group = None
        self._pending = None  # the last call's all-reduce: (work, its tensor)

    @contextlib.contextmanager
    def installed(self):
        """The handlers, in the main thread only (signal handlers cannot be set elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        stacks = _register_stack_dump()
        try:
            yield self
        finally:
            if stacks:
                faulthandler.unregister(signal.SIGUSR1)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.group is not None:
                self._finish_pending()  # every rank started it: it completes
                dist.destroy_process_group(self.group)
                self.group = None

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum:
            # os.write: a print from a handler can land inside another print of the main thread.
            os.write(2, f"holotrain: {name}: a second signal, exiting at once\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        if not self.deferring:
            os.write(2, f"holotrain: {name}: stopped before the first step; nothing to save\n".encode())
            raise SystemExit(128 + signum)
        os.write(2, f"holotrain: {name}: finishing the step under way and saving a checkpoint "
                    "(a second signal exits at once)\n".encode())

    def start_loop(self, world_size: int) -> None:
        """From here on a signal waits for the end of the step. Collective: makes the ranks' agreement group."""
        if world_size > 1 and self.group is None:
            self.group = dist.new_group(backend="gloo")
        self.deferring = True

    def requested(self) -> int:
        """The signal every rank stops for (the largest any rank saw), or 0. Collective with several ranks: each call
        starts an all-reduce of this rank's flag and returns the previous call's result, so no rank's host ever waits
        for another's here; the ranks stop one step after the first signal, all at the same step."""
        if self.group is None:
            return self.signum
        agreed = self._finish_pending()
        flag = torch.tensor([self.signum], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return agreed

    def _finish_pending(self) -> int:
        if self._pending is None:
            return 0
        work, flag = self._pending
        self._pending = None
        work.wait()
        return int(flag.item())
