"""In-memory snapshots (checkpoint.memory_every): the training state in host RAM that outlives the process, each
rank's part also replicated in a peer rank's RAM, so that a restart resumes from a snapshot seconds old even when
one node's memory is lost with the node.

In each node's memory root (/dev/shm/holotrain-<hash of the run directory>, see checkpoint.memory_root):
    rank-R/own/slot-{0,1}.bin       rank R's part of the state: every tensor at its offset (hostcopy.FlatLayout)
    rank-R/own/slot-{0,1}.json      its header: step, run id, world size, layout, non-tensor values, checksums
    rank-R/replica/slot-{0,1}.*     the same for the rank whose replica rank R holds (its source)
Rank R's replica is held by rank R + (ranks per node), modulo the world size: a rank of another node, or with one
node the next rank. Two slots alternate, so a crash while one is written leaves the other whole. A slot's header
is removed before the slot is overwritten and written (atomically) only once its data is complete, so a slot with
a header is whole; its CRC-32 checksums are checked again before it is loaded.

Saving blocks only while the state is copied into a slot: the slot's file is mapped, and page-locked on a GPU, so
the device-to-host copies land in /dev/shm directly. The checksums, the header and the exchange of replicas (over
a gloo group of the snapshots' own) run on a background thread while training goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from holotrain.errors import ConfigError
from holotrain.memory.offload.host import page_lock, unregister
from holotrain.train.background import BackgroundWriter
from holotrain.train.checkpoint import (
    RUN_ID,
    agreed,
    apply_loaded,
    fault_point,
    memory_root,
    prepare_hold,
    run_id,
    training_state,
)
from holotrain.train.hostcopy import BehindTheStep, FlatLayout, copy_from, copy_into, leaves, replace_leaves

if TYPE_CHECKING:
    from holotrain.config import CheckpointConfig
    from holotrain.parallel import DistEnv

_CHUNK = 64 << 20  # bytes per checksum and per replica message
_SLOTS = 2


def peers(env: DistEnv) -> tuple[int, int] | None:
    """(the rank that holds this rank's replica, the rank whose replica this rank holds); None with one rank."""
    if env.world_size == 1:
        return None
    hop = env.local_world_size if env.world_size > env.local_world_size else 1
    return (env.rank + hop) % env.world_size, (env.rank - hop) % env.world_size


class Slot:
    """One snapshot's place in RAM: its data file and its header."""

    def __init__(self, folder: Path, index: int):
        self.index = index
        self.data, self.header = folder / f"slot-{index}.bin", folder / f"slot-{index}.json"

    def read_header(self) -> dict | None:
        try:
            return json.loads(self.header.read_text())
        except (OSError, ValueError):
            return None

    def invalidate(self) -> None:
        self.header.unlink(missing_ok=True)

    def publish(self, header: dict) -> None:
        tmp = self.header.with_suffix(".tmp")
        tmp.write_text(json.dumps(header))
        os.replace(tmp, self.header)

    def map(self, nbytes: int) -> torch.Tensor:
        """The data file mapped (shared) at `nbytes`, created or resized as needed."""
        self.data.parent.mkdir(parents=True, exist_ok=True)
        with open(self.data, "ab") as f:
            if os.fstat(f.fileno()).st_size != nbytes:
                self.invalidate()
                f.truncate(nbytes)
        return torch.from_file(str(self.data), shared=True, size=nbytes, dtype=torch.uint8)


def _slots(root: Path, rank: int, kind: str) -> list[Slot]:
    return [Slot(root / f"rank-{rank}" / kind, i) for i in range(_SLOTS)]


def checksums(buf: torch.Tensor) -> list[int]:
    """CRC-32 of each 64 MiB of `buf`, several at a time (zlib releases the GIL)."""
    array = buf.numpy()
    starts = range(0, buf.numel(), _CHUNK)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda s: zlib.crc32(array[s:s + _CHUNK]), starts))


class RamSnapshots(BackgroundWriter):
    """Saves a snapshot every checkpoint.memory_every steps (the interface of checkpointer.Checkpointer)."""

    what = "an in-memory snapshot"

    def __init__(self, section: CheckpointConfig, env: DistEnv, run_dir: Path):
        super().__init__()
        self.section, self.env = section, env
        self.root, self.run_id = memory_root(run_dir), run_id(run_dir)
        self.peers = peers(env)
        # Collective: every rank makes the group at the same point.
        self.group = dist.new_group(backend="gloo") if self.peers is not None else None
        self.own, self.replica = _slots(self.root, env.rank, "own"), _slots(self.root, env.rank, "replica")
        self.pin = env.device.type == "cuda"
        self.layout: FlatLayout | None = None
        self._bufs: list[torch.Tensor | None] = [None] * _SLOTS
        self._replica_bufs: list[torch.Tensor | None] = [None] * _SLOTS
        self._skipped = 0  # snapshots skipped while the slots were being allocated
        self._slot_steps: list[int] | None = None  # the step each own slot holds (-1: none), read at the first save
        self._allocating: threading.Thread | None = None
        self.holds = False  # the optimizer can hold its host-resident state for the background thread
        self._copies = BehindTheStep(env.device)  # the device-to-host copies, overlapping the next step

    # ----------------------------------------------------------------------------------------------------------
    # Saving

    def prepare(self, optimizer) -> None:
        """Once the optimizer's state exists (after the first step): checks the RAM cap, then maps (and on a GPU
        page-locks) the slots in the background: pinning tens of GB takes seconds."""
        if self._allocating is not None:
            return
        layout = FlatLayout.of(training_state(optimizer))
        self._check_cap(layout)
        self._allocating = threading.Thread(target=self._allocate, args=(layout, optimizer),
                                            name="holotrain-snapshot-buffers")
        self._allocating.start()

    def _check_cap(self, layout: FlatLayout) -> None:
        copies = _SLOTS * (2 if self.peers is not None else 1)  # its own slots, and the replica slots it holds
        need = layout.nbytes * copies * self.env.local_world_size
        cap = self.section.memory_gb
        if need > cap * 1e9:
            raise ConfigError(
                f"checkpoint.memory_gb = {cap:g}: in-memory snapshots of this job need about {need / 1e9:.1f} GB of "
                f"this node's RAM ({layout.nbytes / 1e9:.2f} GB of state per rank x {copies} copies (two slots"
                f"{' and a peer replica' if self.peers is not None else ''}) x {self.env.local_world_size} ranks); "
                "raise checkpoint.memory_gb or set checkpoint.memory_every = 0")

    def _allocate(self, layout: FlatLayout, optimizer=None) -> None:
        t0 = time.perf_counter()
        if optimizer is not None:
            self.holds = prepare_hold(optimizer, self.env)
        if self.pin:
            torch.cuda.set_device(self.env.device)
        self._release()
        for slot in self.own:
            self._bufs[slot.index] = buf = slot.map(layout.nbytes)
            if self.pin:
                buf.zero_()  # faults the pages in on several threads, which page-locking alone does on one
                page_lock(buf)  # unlocked, the copies would only be slower
        self.layout = layout
        if self.env.is_main:
            print(f"holotrain: in-memory snapshot slots ready ({_SLOTS} x {layout.nbytes / 1e9:.1f} GB per rank in "
                  f"{time.perf_counter() - t0:.1f} s)", flush=True)

    def _ready(self) -> bool:
        """Whether every rank's slots are allocated. Until then a snapshot is skipped rather than waited for: the
        first one would otherwise block training for as long as page-locking tens of GB takes."""
        ready = torch.tensor([int(self._allocating is None or not self._allocating.is_alive())])
        if self.env.world_size > 1:
            ready = ready.to(self.env.device)
            dist.all_reduce(ready, op=dist.ReduceOp.MIN)
        return bool(ready.item())

    def save(self, step: int, optimizer, trainer_state: dict, extra_files: dict[str, str] | None = None) -> None:
        """Collective (the replica exchange). Returns once the state is in RAM; the rest goes on in the background."""
        t0 = time.perf_counter()
        if not self._ready():
            if not self._skipped and self.env.is_main:
                print(f"holotrain: in-memory snapshot of step {step} skipped: its RAM is still being prepared",
                      flush=True)
            self._skipped += 1
            return
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
        self.wait()
        # Held, the offloaded state is copied on the background thread; not while a disk save holds it.
        held = optimizer.hold(wait=False) if self.holds else None
        state = training_state(optimizer, held)
        layout = FlatLayout.of(state)
        if layout != self.layout:
            self._check_cap(layout)
            self._allocate(layout)
        if self._slot_steps is None:
            self._slot_steps = [(h or {}).get("step", -1) for h in (s.read_header() for s in self.own)]
        slot = self.own[self._slot_steps.index(min(self._slot_steps))]  # the older one: the newer stays whole
        slot.invalidate()
        self._slot_steps[slot.index] = -1
        self._copies.copy(state, layout, self._bufs[slot.index], optimizer,
                          skip=held.paths if held is not None else frozenset())
        header = {"step": step, RUN_ID: self.run_id, "world_size": self.env.world_size, "rank": self.env.rank,
                  "slot": slot.index, "nbytes": layout.nbytes, "layout": layout.describe(),
                  "values": [[list(p), v] for p, v in leaves(state) if not isinstance(v, torch.Tensor)],
                  "trainer_state": trainer_state, "files": extra_files or {}}
        self._start(self._publish, slot, header, held, state, layout, name="holotrain-snapshot")
        self._blocked(t0)

    def _publish(self, slot: Slot, header: dict, held=None, state: dict | None = None,
                 layout: FlatLayout | None = None) -> None:
        buf = self._bufs[slot.index]
        self._copies.ready()
        if held is not None:
            try:
                held.ready()
                copy_into(state, layout, buf, non_blocking=False, skip=frozenset(layout.entries) - held.paths)
            finally:
                held.release()
        header["crc32"] = checksums(buf)
        fault_point(header["step"])
        slot.publish(header)
        self._slot_steps[slot.index] = header["step"]
        if self.peers is not None:
            self._exchange(buf, header)

    def _exchange(self, buf: torch.Tensor, header: dict) -> None:
        """Sends this rank's snapshot to its holder and receives its source's into the replica slots."""
        holder, source = self.peers
        theirs = _swap_bytes(json.dumps(header).encode(), holder, source, self.group)
        theirs = json.loads(theirs)
        slot = self.replica[theirs["slot"]]
        slot.invalidate()
        rbuf = self._replica_bufs[slot.index]
        if rbuf is None or rbuf.numel() != theirs["nbytes"]:
            rbuf = self._replica_bufs[slot.index] = slot.map(theirs["nbytes"])
        for start in range(0, max(buf.numel(), rbuf.numel()), _CHUNK):
            ops = []
            if start < buf.numel():
                ops.append(dist.P2POp(dist.isend, buf[start:start + _CHUNK], holder, self.group))
            if start < rbuf.numel():
                ops.append(dist.P2POp(dist.irecv, rbuf[start:start + _CHUNK], source, self.group))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        slot.publish(theirs)

    def close(self) -> None:
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None
        self.wait()
        self._release()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def _release(self) -> None:
        self._copies.ready()
        if self.pin and any(b is not None for b in self._bufs):
            torch.cuda.synchronize(self.env.device)
        for b in self._bufs:
            if b is not None:
                unregister(b)
        self._bufs = [None] * _SLOTS
        self.layout = None


def _swap_bytes(mine: bytes, to: int, frm: int, group) -> bytes:
    """Sends `mine` to rank `to` while receiving rank `frm`'s bytes (lengths first)."""
    out_len, in_len = torch.tensor([len(mine)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out_len, to, group),
                                     dist.P2POp(dist.irecv, in_len, frm, group)]):
        w.wait()
    out = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    got = torch.empty(int(in_len.item()), dtype=torch.uint8)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, to, group),
                                     dist.P2POp(dist.irecv, got, frm, group)]):
        w.wait()
    return got.numpy().tobytes()


# --------------------------------------------------------------------------------------------------------------
# Finding and loading


def local_steps(run_dir: Path, rank: int) -> tuple[dict[int, Slot], dict[int, Slot]]:
    """This run's snapshots in this rank's RAM: (step -> own slot, step -> replica slot), by their headers."""
    root, ident = memory_root(run_dir), run_id(run_dir)
    found = []
    for kind in ("own", "replica"):
        steps = {}
        for slot in _slots(root, rank, kind):
            h = slot.read_header()
            if h is not None and ident is not None and h.get(RUN_ID) == ident:
                steps[h["step"]] = slot
        found.append(steps)
    return found[0], found[1]


def any_local(run_dir: Path) -> bool:
    """Whether this node's RAM holds a snapshot of this run (of any rank)."""
    root = memory_root(run_dir)
    ranks = [int(p.name.removeprefix("rank-")) for p in root.glob("rank-*") if p.name.removeprefix("rank-").isdigit()]
    return any(any(local_steps(run_dir, r)) for r in ranks)


class Restorer:
    """Collective: which snapshot steps every rank can recover (its own, or the replica its holder keeps), and
    loading one of them: a rank that lost its own gets it from the holder over `group` (gloo)."""

    def __init__(self, run_dir: Path, env: DistEnv, group):
        self.env, self.group = env, group
        self.peers = peers(env)
        self.own, self.held = local_steps(run_dir, env.rank)
        if env.world_size > 1:
            gathered = [None] * env.world_size
            dist.all_gather_object(gathered, (sorted(self.own), sorted(self.held)), group=group)
        else:
            gathered = [(sorted(self.own), sorted(self.held))]
        self.own_of = [set(own) for own, _ in gathered]
        hop = (self.peers[0] - env.rank) % env.world_size if self.peers else 0
        available = [self.own_of[r] | (set(gathered[(r + hop) % env.world_size][1]) if self.peers else set())
                     for r in range(env.world_size)]
        self.steps = sorted(set.intersection(*available))  # the steps every rank can recover

    def load(self, step: int, optimizer) -> tuple[dict, dict[str, str]]:
        """Loads snapshot `step` into the training state; returns (trainer state, files) or raises ValueError with
        why it cannot be used (on any rank: the caller agrees on it)."""
        header, buf = self._fetch(step)
        state = training_state(optimizer)
        layout = FlatLayout.from_description(header["layout"], header["nbytes"])
        reason = None
        if header["world_size"] != self.env.world_size:
            reason = f"saved by {header['world_size']} ranks, not {self.env.world_size}"
        elif layout != FlatLayout.of(state):
            reason = "its tensors differ from this job's (another model or setting)"
        elif checksums(buf) != header["crc32"]:
            reason = f"checksum mismatch on rank {self.env.rank}"
        reason = agreed(reason)  # every rank stops here, or none does
        if reason is not None:
            raise ValueError(reason)
        copy_from(state, layout, buf)
        state = replace_leaves(state, {tuple(p): v for p, v in header["values"]})
        apply_loaded(state, optimizer)
        files = [header["files"]]
        if self.env.world_size > 1:
            dist.broadcast_object_list(files, src=0, group=self.group)  # rank 0's part carries the data state
        return header["trainer_state"], files[0]

    def _fetch(self, step: int) -> tuple[dict, torch.Tensor]:
        """This rank's part of snapshot `step`: from its own slot, or sent by its holder; meanwhile sends the
        replica this rank holds to its source if the source lost its own."""
        header = buf = outgoing = None
        if step in self.own:
            header = self.own[step].read_header()
            buf = torch.from_file(str(self.own[step].data), shared=False, size=header["nbytes"], dtype=torch.uint8)
        if self.peers is None:
            return header, buf
        holder, source = self.peers
        if step not in self.own_of[source]:
            outgoing = self.held[step].read_header()
        headers = [None] * self.env.world_size
        dist.all_gather_object(headers, outgoing, group=self.group)  # what each holder sends, and its size
        ops = []
        if outgoing is not None:
            data = torch.from_file(str(self.held[step].data), shared=False, size=outgoing["nbytes"],
                                   dtype=torch.uint8)
            ops += [dist.P2POp(dist.isend, data[s:s + _CHUNK], source, self.group)
                    for s in range(0, data.numel(), _CHUNK)]
        if step not in self.own:
            header = headers[holder]
            buf = torch.empty(header["nbytes"], dtype=torch.uint8)
            ops += [dist.P2POp(dist.irecv, buf[s:s + _CHUNK], holder, self.group)
                    for s in range(0, buf.numel(), _CHUNK)]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return header, buf


def forget_newer(run_dir: Path, rank: int, step: int) -> None:
    """After resuming from `step`: this rank's snapshots of later steps belong to a history that was not resumed."""
    own, held = local_steps(run_dir, rank)
    for s, slot in [*own.items(), *held.items()]:
        if s > step:
            slot.invalidate()


def discard(run_dir: Path, rank: int) -> None:
    """After the run completed: this rank's snapshots (and the memory root once it is empty)."""
    root = memory_root(run_dir)
    shutil.rmtree(root / f"rank-{rank}", ignore_errors=True)
    try:
        root.rmdir()
    except OSError:
        pass
