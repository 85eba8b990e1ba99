"""Checkpoints that do not stop training. The step loop blocks only while the training state is copied into host
memory (pinned and kept across saves on a GPU; with memory.offload the engine first lets its CPU step finish, so
the host-resident states are consistent); a background thread then writes that copy with DCP, atomically as
train/checkpoint.py does. One write at a time: a save that comes while the previous one is still being written
waits for it, so a checkpoint is never torn and the host copy is never overwritten while it is read. With several
ranks the writer runs its collectives on a gloo process group of its own, so it never interleaves with the
training's NCCL collectives. The process waits for the writer when training ends, on an error and on SIGTERM."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from holotrain.errors import ConfigError
from holotrain.train.checkpoint import RUN_ID, memory_root, run_id, training_state, write_checkpoint

if TYPE_CHECKING:
    from holotrain.config import CheckpointConfig
    from holotrain.parallel import DistEnv


class Checkpointer:
    def __init__(self, section: CheckpointConfig, env: DistEnv, run_dir: Path, keep: int | None = None,
                 cap_gb: float | None = None):
        """run_dir: where checkpoints/ goes (the run directory, or the memory root of in-memory snapshots);
        keep: newest kept (default checkpoint.keep); cap_gb: RAM the snapshots may take (buffers and files)."""
        self.section, self.env, self.run_dir = section, env, Path(run_dir)
        self.keep = keep or section.keep
        self.cap_gb = cap_gb
        self.background = section.async_save
        # Collective: every rank makes the group at the same point.
        self.group = dist.new_group(backend="gloo") if self.background and env.world_size > 1 else None
        self.snapshot = HostSnapshot(env.device)
        self._thread: threading.Thread | None = None
        self._allocating: threading.Thread | None = None
        self._error: BaseException | None = None
        self._blocking_s = 0.0  # since the last metrics() call
        self.blocking_total_s = 0.0  # since the start: the goodput account's checkpoint time
        self._write_s: list[float] = []
        self._lock = threading.Lock()

    def prepare(self, optimizer) -> None:
        """Allocates the pinned host buffers in the background, once the optimizer's state exists (after the first
        step): pinning tens of GB takes seconds, which the first save would otherwise block for."""
        if self.background and self.snapshot.pin and self._allocating is None:
            layout = self.snapshot.layout(training_state(optimizer))
            self._allocating = threading.Thread(target=self.snapshot.allocate, args=(layout,),
                                                name="holotrain-checkpoint-buffers")
            self._allocating.start()

    def save(self, step: int, optimizer, trainer_state: dict, extra_files: dict[str, str] | None = None) -> None:
        """Collective. Returns once the state is copied (background) or written (checkpoint.async_save = false)."""
        t0 = time.perf_counter()
        if self._allocating is not None:
            self._allocating.join()
        self.wait()
        state = training_state(optimizer)
        if self.cap_gb is not None:
            self._check_cap(state)
            self.cap_gb = None  # the state's size does not change: checked once
        if not self.background:
            write_checkpoint(self.run_dir, step, state, trainer_state, self.keep, extra_files)
            self._finished(time.perf_counter() - t0)
        else:
            snapshot = self.snapshot.take(state)
            self._thread = threading.Thread(target=self._write, name="holotrain-checkpoint",
                                            args=(step, snapshot, trainer_state, extra_files))
            self._thread.start()
        self._blocking_s += time.perf_counter() - t0
        self.blocking_total_s += time.perf_counter() - t0

    def _check_cap(self, state: dict) -> None:
        """The RAM a snapshot takes on this node: the host copy, and the files of two snapshots while the newer
        replaces the older (each rank holds its share)."""
        layout = self.snapshot.layout(state)
        mine = sum(shape.numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout.values())
        need = mine * (3 if self.background else 2) * self.env.local_world_size
        if need > self.cap_gb * 1e9:
            raise ConfigError(
                f"checkpoint.memory_gb = {self.cap_gb:g}: in-memory snapshots of this job need about {need / 1e9:.1f} "
                f"GB of this node's RAM ({mine / 1e9:.1f} GB of state per rank x {self.env.local_world_size} ranks, a "
                "host copy and two snapshots' files); raise checkpoint.memory_gb or set checkpoint.memory_every = 0")

    def wait(self) -> None:
        """Until the write under way (if any) is complete; raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("writing a checkpoint failed") from error

    def metrics(self, steps: int) -> dict:
        """time.checkpoint: seconds per step the loop was blocked by saves since the last call; checkpoint.write_s:
        the background writes that finished since then (seconds each, summed; None when none did)."""
        with self._lock:
            written, self._write_s = self._write_s, []
        blocking, self._blocking_s = self._blocking_s, 0.0
        return {"time.checkpoint": blocking / max(1, steps), "checkpoint.write_s": sum(written) if written else None}

    def close(self) -> None:
        if self._allocating is not None:
            self._allocating.join()
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def _write(self, step, snapshot, trainer_state, extra_files) -> None:
        t0 = time.perf_counter()
        try:
            write_checkpoint(self.run_dir, step, snapshot, trainer_state, self.keep, extra_files, group=self.group)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread at its next save or at close
            self._error = e
            return
        self._finished(time.perf_counter() - t0)

    def _finished(self, seconds: float) -> None:
        with self._lock:
            self._write_s.append(seconds)


class HostSnapshot:
    """A copy of a state dict in host memory, into buffers allocated at the first save and reused after (a 1.4b's
    16 GB once, not per save): pinned on a GPU, so the device-to-host copies run at full bandwidth, all queued
    before one synchronization. A DTensor's local shard is copied and wrapped again on the same mesh (DCP saves
    host DTensors); host tensors (the offload engine's masters and moments) are copied too, since training goes
    on updating them while the copy is written."""

    def __init__(self, device: torch.device):
        self.device, self.pin = device, device.type == "cuda"
        self._buffers: dict[tuple, torch.Tensor] = {}

    def layout(self, state: dict) -> dict[tuple, tuple[torch.Size, torch.dtype]]:
        """The shape and dtype of every tensor of `state` (a DTensor's local shard), by path."""
        out = {}

        def visit(obj, path):
            if isinstance(obj, torch.Tensor):
                t = obj.to_local() if isinstance(obj, DTensor) else obj
                out[path] = (t.shape, t.dtype)
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    visit(v, (*path, k))
            elif isinstance(obj, (list, tuple)):
                for i, v in enumerate(obj):
                    visit(v, (*path, i))

        visit(state, ())
        return out

    def allocate(self, layout: dict[tuple, tuple[torch.Size, torch.dtype]]) -> None:
        """Allocates the buffers (in a thread of its own: on this rank's device, not the default one)."""
        if self.pin:
            torch.cuda.set_device(self.device)
        for path, (shape, dtype) in layout.items():
            if path not in self._buffers:
                self._buffers[path] = self._empty(shape, dtype)

    def take(self, state: dict) -> dict:
        copied = self._copy(state, ())
        if self.pin:
            torch.cuda.synchronize()
        return copied

    def _copy(self, obj, path: tuple):
        if isinstance(obj, DTensor):
            local = self._tensor(obj.to_local(), path)
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                      stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, (*path, i)) for i, v in enumerate(obj))
        return obj  # numbers, strings, None: immutable

    def _tensor(self, t: torch.Tensor, path: tuple) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._buffers[path] = self._empty(t.shape, t.dtype)
        buf.copy_(t.detach(), non_blocking=self.pin)
        return buf

    def _empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin and shape.numel() > 0)


class Checkpoints:
    """The run's disk checkpoints (checkpoint.every) and in-memory snapshots (checkpoint.memory_every), as the
    training loop uses them: which is due at a step, saving it, and their metrics."""

    def __init__(self, section: CheckpointConfig, env: DistEnv, run_dir: Path, total_steps: int):
        self.section, self.env, self.run_dir, self.total_steps = section, env, Path(run_dir), total_steps
        self.disk = Checkpointer(section, env, run_dir)
        self.memory = None
        if section.memory_every and env.world_size > env.local_world_size:
            # A snapshot in one node's RAM holds only that node's shards, and the replica on a peer node that would
            # make it whole is not built: every rank must see the same snapshot to resume from it.
            raise ConfigError(f"checkpoint.memory_every needs every rank on one node ({env.world_size} ranks, "
                              f"{env.local_world_size} on this node); set checkpoint.memory_every = 0")
        if section.memory_every:
            self.memory = Checkpointer(section, env, memory_root(run_dir), keep=1, cap_gb=section.memory_gb)
        self.run_id = run_id(run_dir)

    def due(self, done: int) -> Checkpointer | None:
        s = self.section
        if (s.every and done % s.every == 0) or (done == self.total_steps and s.save_final):
            return self.disk
        if self.memory is not None and done % s.memory_every == 0:
            return self.memory
        return None

    def prepare(self, optimizer) -> None:
        for c in self._all():
            c.prepare(optimizer)

    def save(self, which: Checkpointer, done: int, optimizer, extra_files: dict[str, str] | None) -> None:
        which.save(done, optimizer, {"step": done, "world_size": self.env.world_size, RUN_ID: self.run_id},
                   extra_files)

    def metrics(self, steps: int) -> dict:
        rows = [c.metrics(steps) for c in self._all()]
        written = [r["checkpoint.write_s"] for r in rows if r["checkpoint.write_s"] is not None]
        return {"time.checkpoint": sum(r["time.checkpoint"] for r in rows),
                "checkpoint.write_s": sum(written) if written else None}

    @property
    def blocking_total_s(self) -> float:
        return sum(c.blocking_total_s for c in self._all())

    def close(self) -> None:
        for c in self._all():
            c.close()

    def discard_memory(self) -> None:
        """After the run completed: its in-memory snapshots are no longer needed (main rank)."""
        if self.memory is not None and self.env.is_main:
            shutil.rmtree(self.memory.run_dir, ignore_errors=True)

    def _all(self) -> list[Checkpointer]:
        return [self.disk] + ([self.memory] if self.memory is not None else [])
