"""The per-rank side of the data plane: starts the node's plane (local rank 0), then prefetches this rank's
batches from it into pinned memory and onto the GPU on a side stream, so the step does not wait."""

from __future__ import annotations

import atexit
import hashlib
import multiprocessing as mp
import os
import queue
import tempfile
import threading
import time
from multiprocessing import shared_memory
from multiprocessing.connection import Client
from pathlib import Path

import numpy as np
import torch

from holotrain.data.plane import PlaneSpec, plane_main
from holotrain.data.shm import sweep_blocks
from holotrain.data.worker import start_light
from holotrain.errors import ConfigError


def plane_address(run_dir: Path) -> tuple[str, bytes]:
    """A Unix socket path and key that every local rank of this job derives alike."""
    job = "|".join([str(Path(run_dir).resolve()), os.environ.get("TORCHELASTIC_RUN_ID", ""),
                    os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                    os.environ.get("GROUP_RANK", "0"), str(os.getpid() if "LOCAL_RANK" not in os.environ else "")])
    digest = hashlib.sha256(job.encode()).hexdigest()
    return os.path.join(tempfile.gettempdir(), f"holotrain-{digest[:16]}.sock"), digest[16:48].encode()


class PlaneProcess:
    """The node's data-plane process, as its owner (local rank 0) holds it. The plane ignores SIGINT and SIGTERM:
    it ends when a client asks it to (DataClient.close), when this process is gone, or by stop()."""

    def __init__(self, proc: mp.Process, link, shm_prefix: str):
        self.proc, self.shm_prefix = proc, shm_prefix
        # This end of a pipe with the plane: on it the plane says why it could not listen; closing it stops the plane.
        self._link = link

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def failure(self) -> Exception | None:
        """Why the plane ended before it served (its one line for a user error), or None while it runs."""
        if self.proc.is_alive():
            return None
        try:
            kind, message = self._link.recv() if self._link.poll() else (None, None)
        except EOFError:  # it ended without a word (killed)
            kind = None
        if kind is None:
            return RuntimeError(f"the data plane exited (code {self.proc.exitcode}) before it served")
        return ConfigError(message) if kind == "config_error" else RuntimeError(f"data plane failed: {message}")

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the plane (if no client's "close" has already) and waits for it to end, killing it after `timeout` s;
        then frees the blocks it could not (those of a plane killed here, or earlier)."""
        self._link.close()
        self.proc.join(timeout=timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        sweep_blocks(self.shm_prefix)
        atexit.unregister(self.stop)


def start_plane(spec: PlaneSpec, state: dict | None, address: str, authkey: bytes) -> PlaneProcess:
    if os.path.exists(address):
        os.unlink(address)
    ctx = mp.get_context("spawn")
    link, plane_end = ctx.Pipe()
    proc = ctx.Process(target=plane_main, args=(address, authkey, spec, state, os.getpid(), plane_end), daemon=False,
                       name="holotrain-data-plane")
    start_light(proc)
    plane_end.close()  # the plane holds it now: when the plane is gone, this end reads as closed
    plane = PlaneProcess(proc, link, spec.shm_prefix)
    # A plane never closed (this process stopped while starting it) would outlive it, and multiprocessing's own exit
    # hook, which runs after this one, would wait for it forever.
    atexit.register(plane.stop)
    return plane


def _connect(address: str, authkey: bytes, timeout: float = 300.0, plane: PlaneProcess | None = None):
    """A connection to the plane at `address`. The plane's owner watches its process meanwhile: a plane that ended
    without listening raises its reason at once instead of after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, family="AF_UNIX", authkey=authkey)
        except (FileNotFoundError, ConnectionRefusedError):
            failure = plane.failure() if plane is not None else None
            if failure is not None:
                raise failure from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"data plane at {address} did not come up in {timeout:.0f} s") from None
            time.sleep(0.05)


RECONNECT_S = 120.0  # how long a rank waits for a restarted plane
MAX_PLANE_RESTARTS = 5


def with_boundary(doc_ids: np.ndarray) -> list[bool]:
    """For doc_ids [accum, micro, T], whether each micro-batch has a row that holds more than one document."""
    return (doc_ids[..., 1:] != doc_ids[..., :-1]).reshape(doc_ids.shape[0], -1).any(axis=1).tolist()


class DataClient:
    """Yields, per optimizer step, this rank's micro-batches as (inputs, targets, doc_ids) on the device. On a GPU,
    doc_ids is None for a micro-batch whose rows each hold a piece of one document: it needs no document mask, and the
    model then takes its dense causal attention kernel, faster than the masked one (the result is the same: positions
    restart at every row either way)."""

    def __init__(self, address: str, authkey: bytes, rank: int, start_step: int, device: torch.device,
                 plane: PlaneProcess | None = None, depth: int = 2, restart=None, plane_state: dict | None = None):
        """`plane`: the plane's process, held by its owner (local rank 0); `restart(state) -> PlaneProcess` (the
        owner): starts a new plane from a plane state when this one dies; `plane_state` is the state the current
        plane started from."""
        self.rank, self.device, self.plane = rank, device, plane
        self.address, self.authkey = address, authkey
        self.restart = restart
        self.restarts = 0
        # Owner: plane states by resume position (the next step to produce), kept for the last few steps.
        self._states: dict[int, dict | None] = {start_step: plane_state}
        self._handed = start_step  # steps handed to training so far
        self._batches = _connect(address, authkey, plane=plane)
        self._control = _connect(address, authkey, plane=plane)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._stop = threading.Event()
        self.stats: dict = {}
        self.samples = None
        self.micro_batches = self.masked_micro_batches = 0  # handed out, and of them with a document boundary
        self._thread = threading.Thread(target=self._prefetch, args=(start_step,), name="holotrain-data-prefetch",
                                        daemon=True)
        self._thread.start()

    def _request(self, conn, msg):
        conn.send(msg)
        while not conn.poll(0.1):  # the prefetch thread wakes up now and then to notice close()
            if conn is self._batches and self._stop.is_set():
                raise EOFError("data client closed")
        status, payload = conn.recv()
        if status == "config_error":
            raise ConfigError(payload)
        if status != "ok":
            raise RuntimeError(f"data plane failed: {payload}")
        return payload

    def _prefetch(self, step: int) -> None:
        try:
            while not self._stop.is_set():
                try:
                    reply = self._request(self._batches, ("batch", step, self.rank, self.restart is not None))
                except (EOFError, OSError):
                    if self._stop.is_set():
                        return
                    self._recover()
                    continue
                if "state" in reply:
                    self._states[step + 1] = reply.pop("state")
                    for old in [k for k in self._states if k < self._handed - 2]:
                        del self._states[old]
                shm = shared_memory.SharedMemory(name=reply["shm"])
                # One copy out of shared memory, straight into pinned memory when a GPU will take it.
                host = torch.empty(tuple(reply["shape"]), dtype=torch.int32, pin_memory=self._stream is not None)
                host.numpy()[:] = np.ndarray(reply["shape"], dtype=np.int32, buffer=shm.buf)
                shm.close()
                shm.unlink()
                # On a GPU, where the dense causal kernel is the faster one; on a CPU every micro-batch keeps its ids
                # (one compiled variant of the blocks instead of two, for the short runs CPUs make).
                gpu = self._stream is not None
                masked = with_boundary(host.numpy()[2]) if gpu else [True] * reply["shape"][1]
                event = None
                if gpu:
                    with torch.cuda.stream(self._stream):
                        dev = host.to(self.device, non_blocking=True).long()
                        event = torch.cuda.Event()
                        event.record(self._stream)
                else:
                    dev = host.long()
                self._put((dev, masked, event, reply["stats"], reply["samples"], step))
                step += 1
        except BaseException as e:  # handed to the training loop, which raises it
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], float]:
        """This rank's micro-batches for the next step, and the seconds spent waiting for them."""
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                continue  # a dead plane is noticed, and restarted, by the prefetch thread
        waited = time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        batch, masked, event, self.stats, self.samples, step = item
        self._handed = step + 1
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            batch.record_stream(torch.cuda.current_stream(self.device))
        self.micro_batches += len(masked)
        self.masked_micro_batches += sum(masked)
        inputs, targets, doc_ids = batch  # each [accum, micro, T]
        return [(inputs[m], targets[m], doc_ids[m] if masked[m] else None) for m in range(inputs.shape[0])], waited

    def state(self, steps_done: int) -> dict | None:
        """The plane's state after `steps_done` steps, for a checkpoint."""
        deadline = time.monotonic() + RECONNECT_S
        while True:
            try:
                return self._request(self._control, ("state", steps_done))
            except (EOFError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # the plane died: the prefetch thread restarts it and reconnects

    def _recover(self) -> None:
        """The plane's connection broke. Its owner starts a new plane from the state of the earliest step a local
        rank may still ask for (the step training has last taken: another rank can be one step behind), which
        produces the same batches the old one would have; every rank then reconnects and asks again."""
        if self.restart is not None:
            self.restarts += 1
            if self.restarts > MAX_PLANE_RESTARTS:
                raise RuntimeError(f"the data plane died {self.restarts} times; giving up")
            if self.plane is not None:
                self.plane.stop(timeout=0)  # one still alive no longer answers: it is killed
            position = max(k for k in self._states if k <= max(min(self._states), self._handed - 1))
            code = self.plane.exitcode if self.plane is not None else None
            print(f"holotrain: warning: the data plane exited (code {code}); restarting it from step {position}",
                  flush=True)
            self.plane = self.restart(self._states[position])
        for conn in (self._batches, self._control):
            conn.close()
        self._batches = _connect(self.address, self.authkey, RECONNECT_S, self.plane)
        self._control = _connect(self.address, self.authkey, RECONNECT_S, self.plane)

    def close(self, stop_plane: bool) -> None:
        # The prefetch thread must be out of torch before the interpreter exits: a daemon thread inside an
        # ATen op at shutdown takes the whole process down with std::terminate.
        self._stop.set()
        self._thread.join(timeout=30)
        if stop_plane:
            try:
                self._request(self._control, ("close",))
            except (EOFError, OSError, RuntimeError, ConfigError):
                pass
            if self.plane is not None:
                self.plane.stop()
        for conn in (self._batches, self._control):
            conn.close()
