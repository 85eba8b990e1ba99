"""The data plane service: one process per node that owns the source loaders and the constructor.

    loader workers (per source, autoscaled)  --shared memory-->  constructor (mixture, packing, balance)
        --shared memory, one block per rank and step-->  clients in the training ranks (client.py)

Each source is read once per node, whatever the number of ranks. The constructor consumes every source's
chunks in a fixed order, so the batches are a pure function of the sources, the seed and the state,
whatever the number of workers or their timing. A worker that dies is replaced and its unfinished chunks
are read again by the replacement (its differential state is the set of chunks it had not delivered);
nothing is lost or repeated because chunks enter the constructor only whole and in order.

This module must not import torch: the service process stays small.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Listener
from pathlib import Path

import numpy as np

from holotrain.data.mixture import Mixture
from holotrain.data.packing import Packer, StepFormer, sample_arrays
from holotrain.data.shm import new_block, owner_prefix, sweep_blocks, unlink_block
from holotrain.data.split import Split
from holotrain.data.shm import shm_prefix  # noqa: F401 - callers find it here too
from holotrain.data.sources import SourceConfig, plan_chunks, source_files
from holotrain.data.worker import ignore_stop_signals, read_block, start_light, worker_main
from holotrain.errors import ConfigError
from holotrain.parallel.dims import ParallelDims


@dataclass
class PlaneSpec:
    """Everything the service needs; plain data so it crosses a process boundary."""

    sources: list[SourceConfig]
    tokenizer_path: str
    eos_id: int
    pad_id: int
    seq_len: int
    global_batch: int  # samples per optimizer step, all ranks
    world_size: int
    local_ranks: list[int]  # global ranks served by this node's plane
    micro_batch: int
    accum: int
    seed: int
    max_workers: int = 4
    chunk_bytes: int = 1 << 20
    prefetch_steps: int = 4
    balance: bool = True
    shuffle: bool = True
    log_samples: bool = False
    backend: str = "local"  # local processes, or "ray" actors
    ray_address: str = ""  # empty: start a Ray instance on this node
    # The job's parallel layout (parallel/dims.py): which ranks share rows (a tensor- and context-parallel group, every
    # pipeline stage). None: plain data parallelism over world_size ranks.
    dims: ParallelDims | None = None
    # Share of each source's documents held out for validation (data/split.py): never served to training.
    holdout: float = 0.0
    # Cost-aware step formation (packing.StepFormer): micro-batches chosen from this many steps of ready samples; no
    # sample trains more than this many steps after its turn in order.
    balance_window: int = 4
    shm_prefix: str = ""  # names this plane's shared-memory blocks (shm_prefix()); empty: random names
    chat_template: str = ""  # Jinja source of the chat sources' template (chat.template_for); "": no chat source


# ----------------------------------------------------------------------------------------------
# Loader workers


@dataclass
class _Worker:
    proc: mp.Process
    source: int
    tasks: object
    inflight: dict = field(default_factory=dict)  # (epoch, index) -> chunk
    retired: bool = False


class LoaderPool:
    """Loader processes per source; dispatches chunks, collects them, replaces the dead, scales with demand."""

    def __init__(self, spec: PlaneSpec, files: list[list[Path]]):
        self.spec, self.files = spec, files
        self.prefix = owner_prefix(spec.shm_prefix, os.getpid())  # the loaders' chunks are this plane's blocks
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.workers: dict[int, _Worker] = {}
        self.ready: dict[tuple, dict] = {}  # (source, epoch, index) -> result
        self.cond = threading.Condition()
        self.restarts = 0
        self.failure: tuple[str, str] | None = None  # a loader's error, raised to the constructor
        self._attempts: dict[tuple, int] = {}  # (source, epoch, index) -> loaders lost on it
        self._next_id = 0
        self._last_scale = [0.0] * len(spec.sources)
        self._delivered = [0] * len(spec.sources)
        self._closed = False
        for s in range(len(spec.sources)):
            self._spawn(s)
        self._collector = threading.Thread(target=self._collect, daemon=True)
        self._collector.start()

    def _spawn(self, source: int) -> _Worker:
        src = self.spec.sources[source]
        tasks = self.ctx.Queue()
        proc = self.ctx.Process(
            target=worker_main, daemon=True,
            args=(self._next_id, [str(f) for f in self.files[source]], src, self.spec.tokenizer_path,
                  self.spec.eos_id, self.spec.chat_template, tasks, self.results, os.getpid(), self.prefix,
                  Split(src.name, self.spec.holdout)),
        )
        start_light(proc)
        w = _Worker(proc, source, tasks)
        self.workers[self._next_id] = w
        self._next_id += 1
        return w

    def _collect(self) -> None:
        while not self._closed:
            try:
                kind, wid, res = self.results.get(timeout=0.5)
            except Exception:
                continue
            with self.cond:
                if kind != "chunk":
                    self.failure = (kind, res["message"])
                    self.cond.notify_all()
                    continue
                if self._closed:
                    unlink_block(res["shm"])
                    continue
                key = (res["source"], res["epoch"], res["index"])
                w = self.workers.get(wid)
                if w is not None:
                    w.inflight.pop((res["epoch"], res["index"]), None)
                if key in self.ready or self._dispatched_elsewhere(key, wid):
                    unlink_block(res["shm"])  # a duplicate from a worker presumed dead: drop it
                else:
                    self.ready[key] = res
                    self._delivered[res["source"]] += 1
                self.cond.notify_all()

    def _dispatched_elsewhere(self, key: tuple, wid: int) -> bool:
        return any(i != wid and (key[1], key[2]) in w.inflight for i, w in self.workers.items() if w.source == key[0])

    def live(self, source: int) -> list[_Worker]:
        return [w for w in self.workers.values() if w.source == source and not w.retired]

    def counts(self) -> dict[str, int]:
        return {s.name: len(self.live(i)) for i, s in enumerate(self.spec.sources)}

    def prefetch(self, source: int, upcoming: list[tuple[int, object]]) -> None:
        """Dispatch the next chunks of a source (in consumption order) to its least-loaded workers."""
        with self.cond:
            self._replace_dead()
            workers = self.live(source)
            inflight = {k for w in workers for k in w.inflight}
            for epoch, chunk in upcoming:
                key = (epoch, chunk.index)
                if key in inflight or (source, epoch, chunk.index) in self.ready:
                    continue
                w = min(workers, key=lambda w: len(w.inflight))
                if len(w.inflight) >= 2:
                    break
                w.inflight[key] = chunk
                w.tasks.put((chunk, epoch))
            # Too much read ahead: give a worker back (never the last one).
            backlog = sum(1 for k in self.ready if k[0] == source)
            if backlog > 4 * len(workers) and len(workers) > 1 and not workers[-1].inflight:
                workers[-1].retired = True
                workers[-1].tasks.put(None)

    def wait(self, source: int, epoch: int, index: int) -> dict:
        key = (source, epoch, index)
        t0 = time.monotonic()
        with self.cond:
            while key not in self.ready:
                if self._closed:
                    raise RuntimeError("the loaders were stopped")  # the plane is shutting down
                if self.failure is not None:
                    kind, message = self.failure
                    raise ConfigError(message) if kind == "config_error" else RuntimeError(f"loader failed: {message}")
                self._replace_dead()
                if time.monotonic() - t0 > 0.05:
                    self._scale_up(source)
                self.cond.wait(0.05)
            return self.ready.pop(key)

    def _scale_up(self, source: int) -> None:
        """The constructor is waiting for this source: add a worker if the CPU budget allows."""
        now = time.monotonic()
        total = sum(1 for w in self.workers.values() if not w.retired)
        booted = self._delivered[source] > 0  # a worker still starting up is not a shortage
        if booted and total < self.spec.max_workers and now - self._last_scale[source] > 0.5:
            self._last_scale[source] = now
            self._spawn(source)

    def _replace_dead(self) -> None:
        if self._closed:
            return
        for wid, w in list(self.workers.items()):
            if w.retired or w.proc.is_alive():
                continue
            w.retired = True
            self.restarts += 1
            for key in w.inflight:
                self._attempts[(w.source, *key)] = self._attempts.get((w.source, *key), 0) + 1
                if self._attempts[(w.source, *key)] > 3:  # it kills every loader that reads it
                    self.failure = ("error", f"loaders died 4 times reading chunk {key[1]} of source "
                                             f"{self.spec.sources[w.source].name!r} (epoch {key[0]})")
            new = self._spawn(w.source)
            for (epoch, _), chunk in w.inflight.items():  # what it never delivered is read again
                new.inflight[(epoch, chunk.index)] = chunk
                new.tasks.put((chunk, epoch))
            w.inflight = {}

    def close(self, grace_s: float = 5.0) -> None:
        """Stops the loaders: each is told to (they ignore SIGTERM) and finishes the chunk it is on, and one that has
        not within `grace_s` is killed. Once they are gone, the chunks no one will read are freed.

        The threads that hold this pool or its queues end here too: an object freed in a daemon thread while the
        process exits can stop half-way (a queue's semaphore then stays on multiprocessing's resource tracker, which
        warns at the end of the run)."""
        with self.cond:
            self._closed = True
            for w in self.workers.values():
                if w.proc.is_alive():
                    w.tasks.put(None)
            leftovers, self.ready = list(self.ready.values()), {}
        deadline, killed = time.monotonic() + grace_s, False
        for w in self.workers.values():
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
                killed = True
            w.tasks.close()
            w.tasks.join_thread()  # its few small tasks fit in the pipe, read or not
        self._collector.join(timeout=2)  # it checks for the close every 0.5 s
        while not killed:  # chunks finished after the close (a killed loader may have left half a message: not read)
            try:
                kind, _, res = self.results.get(timeout=0.05)
            except queue.Empty:
                break
            if kind == "chunk":
                leftovers.append(res)
        for res in leftovers:
            unlink_block(res["shm"])


def _take_block(res: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Copy a worker's chunk out of shared memory (or Ray's object store) and free the block: (tokens, doc starts,
    doc keys, trained-on mask or None)."""
    if "arrays" in res:
        return tuple(None if a is None else np.array(a) for a in res["arrays"])
    return read_block(res)


# ----------------------------------------------------------------------------------------------
# The constructor


class SourceStream:
    """One source's documents in their fixed order: chunk order per epoch, documents in file order."""

    def __init__(self, index: int, chunks: list, pool: LoaderPool, seed: int, shuffle: bool, name: str):
        self.index, self.chunks, self.pool, self.name = index, chunks, pool, name
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position, self.doc = 0, 0, 0
        self.current = None
        self.records, self.skipped, self.skip_examples = 0, 0, []  # records read so far, and skipped of them
        self._orders: dict[int, np.ndarray] = {}
        self._empty_chunks_in_row = 0

    def order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.chunks)
            perm = np.random.default_rng([self.seed, self.index, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = perm
        return self._orders[epoch]

    def upcoming(self, n: int) -> list[tuple[int, object]]:
        out, epoch, pos = [], self.epoch, self.position
        for _ in range(n):
            out.append((epoch, self.chunks[self.order(epoch)[pos]]))
            pos += 1
            if pos == len(self.chunks):
                epoch, pos = epoch + 1, 0
        return out

    def next_doc(self) -> tuple[np.ndarray, tuple, np.ndarray | None]:
        """(tokens, key, mask): the mask says which tokens are trained on (chat sources); None: all of them."""
        while self.current is None or self.doc >= len(self.current[1]) - 1:
            if self.current is not None:
                self.position, self.doc = self.position + 1, 0
                if self.position == len(self.chunks):
                    self.epoch, self.position = self.epoch + 1, 0
            self.pool.prefetch(self.index, self.upcoming(8))
            res = self.pool.wait(self.index, self.epoch, self.chunks[self.order(self.epoch)[self.position]].index)
            if self.doc == 0:  # a chunk re-read after a resume was already counted
                self.records += res.get("records", 0)
                self.skipped += res["skipped"]
                self.skip_examples = (self.skip_examples + res["skip_examples"])[:5]
            self.current = _take_block(res)
            self._empty_chunks_in_row = 0 if res["n_docs"] else self._empty_chunks_in_row + 1
            if self._empty_chunks_in_row > len(self.chunks):
                example = f" (skipped, e.g. {self.skip_examples[0]})" if self.skip_examples else ""
                raise ConfigError(f"data source {self.name!r} holds no readable documents{example}")
        tokens, starts, keys, mask = self.current
        d = self.doc
        self.doc += 1
        span = slice(starts[d], starts[d + 1])
        key = (self.index, self.epoch, int(keys[d, 0]), int(keys[d, 1]))
        return tokens[span], key, None if mask is None else mask[span]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "doc": self.doc, "records": self.records,
                "skipped": self.skipped, "skip_examples": self.skip_examples}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self.doc = state["epoch"], state["position"], state["doc"]
        self.skipped, self.skip_examples = state["skipped"], list(state["skip_examples"])
        self.records = state.get("records", 0)
        if "records" not in state:  # an older holotrain's checkpoint: both counts start again, to stay a share
            self.skipped = 0
        self.current = None
        if self.doc > 0:  # reopen the chunk in progress and continue after its last consumed document
            res = self.pool.wait(self.index, self.epoch, self._fetch_current())
            self.current = _take_block(res)

    def _fetch_current(self) -> int:
        self.pool.prefetch(self.index, self.upcoming(8))
        return self.chunks[self.order(self.epoch)[self.position]].index


class Constructor:
    def __init__(self, spec: PlaneSpec, streams: list[SourceStream]):
        self.spec, self.streams = spec, streams
        self.mixture = Mixture([s.weight for s in spec.sources], [s.weight_schedule for s in spec.sources])
        self.packer = Packer(spec.seq_len + 1, max_open=max(8, 2 * spec.global_batch))
        self.step = 0  # steps produced
        self.dims = spec.dims or ParallelDims(world=spec.world_size)
        dp = self.dims.dp
        rows = spec.global_batch // dp // spec.accum  # samples per rank per micro-batch
        self.former = StepFormer(self.packer, dp, rows, spec.accum, spec.balance_window) if spec.balance and dp > 1 else None

    def _read_document(self) -> None:
        s = self.mixture.pick()
        tokens, key, mask = self.streams[s].next_doc()
        self.mixture.account(s, len(tokens), self.step)
        self.packer.add(tokens, key, mask)

    def produce(self) -> dict:
        """The next step's batch for every rank of this node, and what it is made of."""
        spec, n = self.spec, self.spec.global_batch
        dp = self.dims.dp
        if self.former is not None:
            while self.former.wants():
                self._read_document()
            micro_batches = self.former.next_step()  # per micro-batch: per rank, its samples and their cost
            ranks = [[b for bins, _ in micro_batches for b in bins[r]] for r in range(dp)]
            loads = [costs for _, costs in micro_batches]
        else:  # in order, equal count
            while not self.packer.has(n):
                self._read_document()
            bins, per, rows = self.packer.take(n), n // dp, n // dp // spec.accum
            ranks = [bins[r * per : (r + 1) * per] for r in range(dp)]
            loads = [[sum(b.attention_cost(self.packer.length) for b in g[m * rows : (m + 1) * rows]) for g in ranks]
                     for m in range(spec.accum)]
        # How much longer the step's attention takes than on even ranks: ranks wait for the slowest at every
        # micro-batch, so the sum of each micro-batch's most loaded rank over the sum of its means (max/mean with one).
        peak, mean = sum(max(m) for m in loads), sum(sum(m) / len(m) for m in loads)
        out = {"ranks": {}, "cost_max_over_mean": peak / mean if mean else 1.0}
        for rank in spec.local_ranks:
            rank_bins = ranks[self.dims.dp_index(rank)]
            inputs, targets, doc_ids = sample_arrays(rank_bins, spec.seq_len + 1, spec.pad_id)
            samples = [[list(p.key) for p in b.pieces] for b in rank_bins] if spec.log_samples else None
            out["ranks"][rank] = {"arrays": (inputs, targets, doc_ids), "samples": samples}
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "streams": [s.state_dict() for s in self.streams],
                "mixture": self.mixture.state_dict(), "packer": self.packer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.mixture.load_state_dict(state["mixture"])
        self.packer.load_state_dict(state["packer"])
        for s, st in zip(self.streams, state["streams"]):
            s.load_state_dict(st)

    def stats(self) -> dict:
        return {
            "tokens_by_source": {s.name: self.mixture.actual[i] for i, s in enumerate(self.streams)},
            "skipped": sum(s.skipped for s in self.streams),
            "skip_examples": [e for s in self.streams for e in s.skip_examples][:5],
            "padding": self.packer.pad_tokens / max(1, self.packer.total_tokens),
            # Per source, for the trainer's warnings and its data.max_skip_fraction check (monitor.SkipMonitor):
            # records read and skipped so far, the first skipped one, and the passes over the source completed.
            "sources": {s.name: {"records": s.records, "skipped": s.skipped, "passes": s.epoch,
                                 "first": s.skip_examples[0] if s.skip_examples else None} for s in self.streams},
        }


# ----------------------------------------------------------------------------------------------
# The service process


def _put_arrays(arrays: tuple[np.ndarray, ...], accum: int, micro: int, prefix: str) -> dict:
    """One shared block per rank and step: inputs, targets, doc ids as int32 [accum, micro, T]."""
    stacked = np.stack([a.reshape(accum, micro, -1) for a in arrays]).astype(np.int32)
    shm = new_block(stacked.nbytes, prefix)
    np.ndarray(stacked.shape, dtype=np.int32, buffer=shm.buf)[:] = stacked
    name = shm.name
    shm.close()
    resource_tracker.unregister(shm._name, "shared_memory")  # the client unlinks it
    return {"shm": name, "shape": stacked.shape}


def _failure(e: BaseException) -> tuple[str, str]:
    """An error as the clients get it: ("config_error", its one line) for a user error, else ("error", traceback)."""
    return ("config_error", str(e)) if isinstance(e, ConfigError) else ("error", traceback.format_exc())


class _PlaneError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


def plane_main(address: str, authkey: bytes, spec: PlaneSpec, state: dict | None, parent_pid: int,
               link=None) -> None:
    """The plane process. It ignores SIGINT and SIGTERM (the training process handles them) and stops when a client
    sends "close", when its owner closes `link` (one end of a pipe, client.PlaneProcess holds the other), or when the
    training process is gone. It prints nothing: it listens first, and whatever fails after that (reading the
    sources, a loader) is the reply to every request from then on, so every rank raises it; a failure to listen
    goes to the owner through `link`."""
    ignore_stop_signals()
    try:
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
    except Exception as e:
        if link is not None:
            link.send(_failure(e))
        return
    _serve(listener, spec, state, parent_pid, link)


def _build(spec: PlaneSpec, state: dict | None) -> tuple[object, Constructor]:
    """The loaders and the constructor, at the position `state` gives."""
    sweep_blocks(spec.shm_prefix)  # a plane of this run that was killed left these behind (live planes' stay)
    files = [source_files(s) for s in spec.sources]
    if spec.backend == "ray":
        from holotrain.data.ray_backend import RayLoaderPool

        pool = RayLoaderPool(spec, files)
        ignore_stop_signals()  # ray.init sets a SIGTERM handler of its own
    else:
        pool = LoaderPool(spec, files)
    try:
        streams = [
            SourceStream(i, plan_chunks(i, f, spec.chunk_bytes, s.document, s.path_field), pool, spec.seed,
                         spec.shuffle, s.name)
            for i, (s, f) in enumerate(zip(spec.sources, files))
        ]
        constructor = Constructor(spec, streams)
        if state is not None:
            constructor.load_state_dict(state)
    except BaseException:
        pool.close()
        raise
    return pool, constructor


def _serve(listener: Listener, spec: PlaneSpec, state: dict | None, parent_pid: int, link) -> None:
    prefix = owner_prefix(spec.shm_prefix, os.getpid())
    produced: dict[int, dict] = {}  # step -> {"ranks", "state", "stats"}
    cond = threading.Condition()
    first = state["step"] if state is not None else 0
    consumed = {r: first for r in spec.local_ranks}  # next step each rank will ask for
    error: list[tuple[str, str]] = []  # why the plane cannot go on: every request's reply from then on
    stop = threading.Event()

    def fail(e: BaseException) -> None:
        with cond:
            error.append(_failure(e))
            cond.notify_all()

    def producer(pool, constructor: Constructor) -> None:
        try:
            while not stop.is_set():
                with cond:
                    while constructor.step >= min(consumed.values()) + spec.prefetch_steps and not stop.is_set():
                        cond.wait(0.1)
                if stop.is_set():
                    return
                step_index = constructor.step
                out = constructor.produce()
                entry = {
                    "ranks": {r: {**_put_arrays(v["arrays"], spec.accum, spec.micro_batch, prefix),
                                  "samples": v["samples"]} for r, v in out["ranks"].items()},
                    "state": constructor.state_dict(),
                    "stats": {**constructor.stats(), "cost_max_over_mean": out["cost_max_over_mean"],
                              "workers": pool.counts(), "worker_restarts": pool.restarts},
                }
                with cond:
                    produced[step_index] = entry
                    # Keep a few steps' state for checkpoints that lag behind production.
                    for old in [s for s in produced if s < min(consumed.values()) - 2 * spec.prefetch_steps]:
                        del produced[old]
                    cond.notify_all()
        except BaseException as e:  # surfaced to every client: a user error as its one line
            fail(e)

    def wait_step(step: int) -> dict:
        with cond:
            while step not in produced and not error:
                cond.wait(0.1)
            if error:
                raise _PlaneError(*error[0])
            return produced[step]

    def handle(conn) -> None:
        try:
            while True:
                msg = conn.recv()
                try:
                    if msg[0] == "batch":
                        _, step, rank, want_state = msg
                        with cond:
                            consumed[rank] = max(consumed[rank], step)
                            cond.notify_all()
                        entry = wait_step(step)
                        reply = {**entry["ranks"][rank], "stats": entry["stats"]}
                        if want_state:  # the plane's owner keeps it: a restarted plane resumes from it
                            reply["state"] = entry["state"]
                        conn.send(("ok", reply))
                    elif msg[0] == "state":
                        conn.send(("ok", wait_step(msg[1] - 1)["state"] if msg[1] > 0 else None))
                    elif msg[0] == "close":
                        conn.send(("ok", None))
                        stop.set()
                        return
                except _PlaneError as e:
                    conn.send((e.kind, e.message))
        except (EOFError, OSError):
            return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn = listener.accept()
            except (EOFError, OSError, mp.AuthenticationError):  # the listener closed, or a client left mid-handshake
                time.sleep(0.01)
                continue
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    # Clients connect at once, and hear of a failure to start (a missing file, a malformed one) as their first reply.
    threading.Thread(target=accept, daemon=True).start()
    pool, producing = None, None
    try:
        pool, constructor = _build(spec, state)
    except Exception as e:
        fail(e)
    else:
        producing = threading.Thread(target=producer, args=(pool, constructor), daemon=True)
        producing.start()
    while not stop.wait(0.5):
        # The training process is gone, or its owner closed the link (the owner never writes to it: readable is closed).
        if os.getppid() != parent_pid or (link is not None and link.poll()):
            stop.set()
    if producing is not None:
        producing.join(timeout=10)  # a step being produced now would otherwise leave its blocks behind
    if pool is not None:
        pool.close()
    for entry in produced.values():
        for r in entry["ranks"].values():
            unlink_block(r["shm"])
    sweep_blocks(spec.shm_prefix)  # this plane's other blocks (no one will read them now), and dead planes'
    listener.close()
