"""Checkpoints that do not stop training. The step loop blocks only while the device-resident training state is
copied into host memory (pinned and kept across saves on a GPU). With memory.offload the host-resident masters and
moments are held instead of copied (StepOptimizer.hold: the engine's next updates write a second set), so the
loop does not wait for the CPU step either; the background thread waits for it. That thread then writes with DCP,
atomically as train/checkpoint.py does. One write at a time: a save that comes while the previous one is still being written
waits for it, so a checkpoint is never torn and the host copy is never overwritten while it is read. With several
ranks the writer runs its collectives on a gloo process group of its own, so it never interleaves with the
training's NCCL collectives. The process waits for the writer when training ends, on an error and on SIGTERM."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from holotrain.errors import ConfigError, SaveFailed
from holotrain.memory.offload.host import pinned_empty, unregister
from holotrain.memory.plan import HOST_USABLE, host_available_bytes
from holotrain.train.background import BackgroundWriter
from holotrain.train.checkpoint import (
    MANIFEST,
    RUN_ID,
    TRAINER_STATE,
    CheckpointMismatch,
    NotWritten,
    agreed,
    damage,
    list_checkpoints,
    load_checkpoint,
    memory_root,
    newest_intact,
    prepare_hold,
    run_id,
    training_state,
    why_unusable,
    write_checkpoint,
)
from holotrain.train.hostcopy import BehindTheStep, FlatLayout
from holotrain.train.snapshots import RamSnapshots, Restorer, discard, forget_newer

if TYPE_CHECKING:
    from holotrain.config import CheckpointConfig
    from holotrain.parallel import DistEnv

CONFIG = "config.toml"  # the run's config, in the run directory and in each checkpoint

# What loading a candidate came to, agreed on by every rank (the worst wins).
_LOADED, _UNUSABLE, _MISMATCH = 0, 1, 2


def _worst(verdict: int) -> int:
    """Collective over the default group: the worst verdict of any rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return verdict
    value = torch.tensor([verdict], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


# What a save costs training, as the planner predicts it. The device-resident state (fp32 weights and moments, 12
# bytes per parameter) is copied at the device-to-host rate (pinned, measured on an H200) behind the next step's
# forward and backward, which hide it but for what outlasts them; queueing it (the state dict, a copy per tensor)
# blocks the loop for QUEUE_S (0.059-0.078 s for the 1.4b's). On a CPU the copy runs at the host's copy rate
# while training waits; so does it beside the offload engine, which writes device weights during the step. Its
# host-resident state is held, not copied (bench/RESULTS.md). Offload state the host has no room to hold (nor a
# delayed update's, which is never held) is written to disk while training waits, at the rate the H200 machine's
# disk wrote a 1.4b checkpoint (under 0.6 GB/s), about 14 bytes a parameter (bf16 weights, fp32 masters and
# moments; 16 with a delayed update's working weights).
D2H_BYTES_S = 51e9
QUEUE_S = 0.07
HELD_SAVE_S = 0.05
DISK_BYTES_S = 0.6e9


def save_blocking_s(device_params: int, offloaded_params: int, held: bool, host_copy_bytes_s: float | None,
                    bytes_per_param: int = 14, overlap_s: float = 0.0) -> float:
    """Seconds a save costs the step loop: `host_copy_bytes_s` None on a GPU; `held`: the offload engine holds its
    state for the writer; `overlap_s`: the next step's forward and backward, which a GPU's copy runs behind."""
    if offloaded_params and not held:
        return (device_params + offloaded_params) * bytes_per_param / DISK_BYTES_S
    copy_s = device_params * 12 / (host_copy_bytes_s or D2H_BYTES_S)
    if offloaded_params:
        return copy_s + HELD_SAVE_S
    if host_copy_bytes_s is None:
        return QUEUE_S + max(0.0, copy_s - overlap_s)
    return copy_s


class Checkpointer(BackgroundWriter):
    def __init__(self, section: CheckpointConfig, env: DistEnv, run_dir: Path):
        super().__init__()
        self.section, self.env, self.run_dir = section, env, Path(run_dir)
        self.keep = section.keep
        self.protect: int | None = None  # a step whose checkpoint is never pruned (checkpoint.keep_best)
        # Files written at once per rank: one thread writes a 1.4b's 16.8 GB far below a disk's bandwidth.
        self.threads = max(1, min(8, (os.cpu_count() or 1) // env.local_world_size))
        self.background = section.async_save
        # Collective: every rank makes the group at the same point.
        self.group = dist.new_group(backend="gloo") if self.background and env.world_size > 1 else None
        self.snapshot = HostSnapshot(env.device)
        self._allocating: threading.Thread | None = None
        self.holds = False  # the optimizer can hold its host-resident state for the writer
        self._copy_fits = True  # this rank's host can hold the copy (what all ranks agree on is read at a save)
        self._agreed_fits: bool | None = None
        self.saves = 0  # saves started
        self.unwritten: dict[int, str] = {}  # step -> why its checkpoint was not written (read after close())

    def prepare(self, optimizer) -> None:
        """Allocates the host buffers in the background, once the optimizer's state exists (after the first step):
        pinning tens of GB takes seconds, which the first save would otherwise block for."""
        if self.background and self._allocating is None:
            # The state dict on this thread: FSDP2's state-dict hooks reshard the modules, which must not happen
            # beside a step.
            state = training_state(optimizer)
            self._allocating = threading.Thread(target=self._allocate, args=(optimizer, state),
                                                name="holotrain-checkpoint-buffers")
            self._allocating.start()

    def _allocate(self, optimizer, state: dict) -> None:
        self.holds = prepare_hold(optimizer, self.env)
        layout = FlatLayout.of(state, optimizer.held_paths if self.holds else frozenset())
        room = host_available_bytes() / self.env.local_world_size * HOST_USABLE
        self._copy_fits = layout.nbytes <= room
        if not self._copy_fits and self.env.is_main:
            print(f"holotrain: checkpoints are written while training waits: a host copy of the state needs "
                  f"{layout.nbytes / 1e9:.1f} GB per rank, {room / 1e9:.1f} GB is usable", flush=True)
        if self._copy_fits and self.snapshot.pin:
            self.snapshot.allocate(layout)

    def _in_background(self) -> bool:
        """checkpoint.async_save, where every rank's host can hold the copy (agreed at the first save)."""
        if not self.background:
            return False
        if self._agreed_fits is None:
            fits = torch.tensor([int(self._copy_fits)])
            if self.env.world_size > 1:
                fits = fits.to(self.env.device)
                dist.all_reduce(fits, op=dist.ReduceOp.MIN)
            self._agreed_fits = bool(fits.item())
        return self._agreed_fits

    def save(self, step: int, optimizer, trainer_state: dict, extra_files: dict[str, str] | None = None) -> None:
        """Collective. Returns once the state is copied or held (background) or written (checkpoint.async_save =
        false)."""
        t0 = time.perf_counter()
        if self._allocating is not None:
            self._allocating.join()
        self.wait()
        self.saves += 1
        if not self._in_background():
            if self._written_or_told(step, training_state(optimizer), trainer_state, extra_files, None):
                self._written(time.perf_counter() - t0)
        else:
            held = optimizer.hold() if self.holds else None
            state = training_state(optimizer, held)
            copied = self.snapshot.take(state, optimizer, held.paths if held is not None else frozenset())
            self._start(self._write, held, step, copied, trainer_state, extra_files, name="holotrain-checkpoint")
        self._blocked(t0)

    def _write(self, held, step: int, state: dict, trainer_state: dict, extra_files: dict[str, str] | None) -> None:
        try:
            self.snapshot.ready()
            if held is not None:
                held.ready()
            self._written_or_told(step, state, trainer_state, extra_files, self.group)
        finally:
            if held is not None:
                held.release()

    def _written_or_told(self, step: int, state: dict, trainer_state: dict, extra_files: dict[str, str] | None,
                         group) -> bool:
        """Collective. Writes the checkpoint; one that cannot be written (a full disk) is told in one line and
        training goes on. Whether it was written."""
        try:
            write_checkpoint(self.run_dir, step, state, trainer_state, self.keep, extra_files, group, self.threads,
                             self.protect)
            return True
        except NotWritten as e:
            self.unwritten[step] = str(e)
            if self.env.is_main:
                kept = newest_intact(self.run_dir)
                print(f"holotrain: warning: no checkpoint at step {step}: {e}; training goes on (newest intact "
                      f"checkpoint: {kept.name if kept is not None else 'none'})", flush=True)
            return False

    def close(self) -> None:
        if self._allocating is not None:
            self._allocating.join()
        self.wait()
        self.snapshot.release()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


class HostSnapshot:
    """A copy of a state dict in host memory, in one flat buffer allocated at the first save (or ahead of it) and
    reused after (a 1.4b's 16 GB once, not per save): page-locked on a GPU at its exact size, so the device-to-host
    copies run at full bandwidth, behind the step (hostcopy.BehindTheStep). Host tensors (the offload engine's
    masters and moments) are copied too, since training goes on updating them while the copy is written."""

    def __init__(self, device: torch.device):
        self.device, self.pin = device, device.type == "cuda"
        self.layout: FlatLayout | None = None
        self._buf: torch.Tensor | None = None
        self._copies = BehindTheStep(device)

    def allocate(self, layout: FlatLayout) -> None:
        """Allocates the buffer (in a thread of its own: on this rank's device, not the default one)."""
        if self.pin:
            torch.cuda.set_device(self.device)
        self.release()
        self._buf = pinned_empty(layout.nbytes, torch.uint8) if self.pin else torch.empty(layout.nbytes,
                                                                                           dtype=torch.uint8)
        self.layout = layout

    def take(self, state: dict, optimizer, skip: frozenset = frozenset()) -> dict:
        """`state` with its tensors (but those at the paths in `skip`, left as they are) replaced by copies, complete
        once `ready()` returns."""
        layout = FlatLayout.of(state, skip)
        if layout != self.layout:
            self.allocate(layout)
        return self._copies.copy(state, layout, self._buf, optimizer)

    def ready(self) -> None:
        self._copies.ready()

    def release(self) -> None:
        """No copy may still be reading the buffer."""
        self._copies.ready()
        if self._buf is not None:
            unregister(self._buf)
            self._buf, self.layout = None, None


BEST = "best.json"  # checkpoint.keep_best: the step and eval.loss of the kept best checkpoint


class Checkpoints:
    """The run's disk checkpoints (checkpoint.every) and in-memory snapshots (checkpoint.memory_every), as the
    training loop uses them: resuming from the newest, which is due at a step, saving it, their metrics, and at the
    end (finish) naming the newest intact checkpoint. A disk checkpoint that cannot be written (a full disk) is one
    warning line and training goes on; only the final one's loss ends the run with an error (SaveFailed)."""

    def __init__(self, section: CheckpointConfig, env: DistEnv, run_dir: Path, total_steps: int):
        self.section, self.env, self.run_dir, self.total_steps = section, env, Path(run_dir), total_steps
        self.disk = Checkpointer(section, env, run_dir)
        self.memory = RamSnapshots(section, env, run_dir) if section.memory_every else None
        self.run_id = run_id(run_dir)
        self.best: tuple[int, float] | None = None  # (step, eval.loss) of the best checkpoint (keep_best)
        best = self.run_dir / "checkpoints" / BEST
        if section.keep_best and best.is_file():  # a resumed run keeps its best so far
            saved = json.loads(best.read_text())
            self.best = (int(saved["step"]), float(saved["eval.loss"]))
            self.disk.protect = self.best[0]

    def consider_best(self, step: int, eval_loss: float) -> None:
        """checkpoint.keep_best: the checkpoint just saved at `step` becomes the one kept if its eval.loss is the
        lowest so far (rank 0 names it in checkpoints/best.json)."""
        if not self.section.keep_best or (self.best is not None and eval_loss >= self.best[1]):
            return
        self.best = (step, eval_loss)
        self.disk.protect = step
        if self.env.is_main:
            path = self.run_dir / "checkpoints" / BEST
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": step, "eval.loss": eval_loss,
                                       "checkpoint": str(self.run_dir / "checkpoints" / f"step-{step}")}) + "\n")
            os.replace(tmp, path)

    def restore(self, optimizer) -> tuple[str, dict, dict[str, str]] | None:
        """Collective. Loads the newest intact state of the run: an in-memory snapshot or a disk checkpoint (the
        snapshot first at the same step: it loads faster). One that is damaged on any rank (a file missing or
        truncated, metadata that does not load) or a snapshot that cannot be used (a checksum mismatch, another
        layout) is reported in one line and the next newest is tried. Returns (what was loaded, trainer state, the
        files saved with it), or None when the run has neither. ConfigError when a disk checkpoint is intact but
        not this job's (another model or setting: the older ones are the same run's), or when none is intact."""
        group = dist.new_group(backend="gloo") if self.env.world_size > 1 else None
        try:
            restorer = Restorer(self.run_dir, self.env, group)
            ram = memory_root(self.run_dir)
            candidates = sorted([(step, 1, path) for step, path in list_checkpoints(self.run_dir)]
                                + [(step, 2, None) for step in restorer.steps], reverse=True)
            failed, damaged = [], []
            for step, _, path in candidates:
                where = f"checkpoint {path}" if path is not None else f"the in-memory snapshot in {ram}"
                reason = agreed(damage(path)) if path is not None else None
                if reason is None:
                    verdict = _LOADED
                    try:
                        loaded = self._load(path, step, restorer, optimizer)
                    except CheckpointMismatch as e:
                        verdict, reason = _MISMATCH, str(e)
                    except (Exception, CheckpointException) as e:  # noqa: BLE001 - failing to read it makes it unusable
                        verdict, reason = _UNUSABLE, why_unusable(e)
                    agreed_verdict = _worst(verdict)  # every rank goes the same way
                    if agreed_verdict != verdict:
                        verdict, reason = agreed_verdict, "found on another rank"
                    if verdict == _MISMATCH:
                        raise ConfigError(self._mismatch(path, reason))
                    if verdict == _LOADED:
                        if self.env.is_main:
                            print(f"holotrain: resuming from {where} (step {step})", flush=True)
                        forget_newer(self.run_dir, self.env.rank, step)
                        return (where, *loaded)
                failed.append(f"{where} ({reason})")
                if path is not None:
                    damaged.append(str(path))
                if self.env.is_main:
                    state = "is damaged" if path is not None else "cannot be used"
                    print(f"holotrain: warning: {where} {state} ({reason}); trying the previous one", flush=True)
        finally:
            if group is not None:
                dist.destroy_process_group(group)
        if failed:
            way_out = (f"remove the damaged checkpoints ({', '.join(damaged)}) to start over, or choose another "
                       "job.run_dir" if damaged else "choose another job.run_dir")
            raise ConfigError(f"no intact checkpoint of {self.run_dir}: {'; '.join(failed)}. To go on: {way_out}")
        return None

    def _mismatch(self, path: Path, difference: str) -> str:
        """One line for a disk checkpoint that is intact but holds another job's tensors."""
        config = path / CONFIG if (path / CONFIG).is_file() else self.run_dir / CONFIG
        return (f"checkpoint {path} does not match this job ({difference}): {self.run_dir} was trained with another "
                f"model or setting. Resume it with the config it was trained with ({config}), or give this job "
                "another job.run_dir")

    @staticmethod
    def _load(path: Path | None, step: int, ram: Restorer, optimizer) -> tuple[dict, dict[str, str]]:
        if path is None:
            return ram.load(step, optimizer)
        trainer_state = load_checkpoint(path, optimizer)
        files = {p.name: p.read_text() for p in path.iterdir() if p.suffix == ".json" and p.name not in
                 (TRAINER_STATE, MANIFEST)}
        return trainer_state, files

    def due(self, done: int):
        s = self.section
        if (s.every and done % s.every == 0) or (done == self.total_steps and s.save_final):
            return self.disk
        if self.memory is not None and done % s.memory_every == 0:
            return self.memory
        return None

    def prepare(self, optimizer) -> None:
        """After the first step: host memory for the saves this run will make, allocated in the background."""
        if self.section.every or self.section.save_final:
            self.disk.prepare(optimizer)
        if self.memory is not None:
            self.memory.prepare(optimizer)

    def save(self, which, done: int, optimizer, extra_files: dict[str, str] | None) -> None:
        if which is self.disk and extra_files is not None and (self.run_dir / CONFIG).is_file():
            # The config the checkpoint was trained with travels with it: a later job that does not match it is
            # pointed there.
            extra_files = {**extra_files, CONFIG: (self.run_dir / CONFIG).read_text()}
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

    def wait_saved(self, step: int, timeout_s: float) -> tuple[Path | None, bool]:
        """After an interrupt's save of `step`: waits up to `timeout_s` for its write. Returns (the checkpoint, if it
        was written intact; else None, True when the wait ended in time)."""
        if not self.disk.join(timeout_s):
            return None, False
        try:
            self.disk.wait()
        except RuntimeError as e:  # its write failed: said in one line; the run still stops
            if self.env.is_main:
                print(f"holotrain: warning: the checkpoint of step {step} could not be written ({e.__cause__})",
                      flush=True)
            return None, True
        path = self.run_dir / "checkpoints" / f"step-{step}"
        return (path if path.is_dir() and damage(path) is None else None), True

    def newest_intact(self) -> Path | None:
        """The run's newest disk checkpoint whose files are all there (by its manifest), or None."""
        return newest_intact(self.run_dir)

    def final_unwritten(self) -> str | None:
        """After close(): why the final checkpoint (checkpoint.save_final) could not be written, or None."""
        return self.disk.unwritten.get(self.total_steps) if self.section.save_final else None

    def finish(self) -> None:
        """After close(), once the run completed: names the newest intact checkpoint in one line, or raises
        SaveFailed (one line, naming it) when the final checkpoint could not be written."""
        newest = self.newest_intact()
        named = f"{newest} (step {newest.name.removeprefix('step-')})" if newest is not None else "none"
        why = self.final_unwritten()
        if why is not None:
            kept = (f"The newest intact checkpoint is {named}; make room and run the same command again to go on "
                    "from it" if newest is not None else "No checkpoint of this run is intact")
            raise SaveFailed(f"the final checkpoint (step {self.total_steps}) could not be written: {why}. {kept}")
        if self.env.is_main and (newest is not None or self.disk.saves):
            print(f"holotrain: newest intact checkpoint: {named}", flush=True)

    def discard_memory(self) -> None:
        """After the run completed: its in-memory snapshots are no longer needed (each rank removes its own), unless
        the final checkpoint could not be written to disk: then they may hold the newest state there is."""
        if self.final_unwritten() is None:
            discard(self.run_dir, self.env.rank)

    def _all(self) -> list:
        return [self.disk] + ([self.memory] if self.memory is not None else [])
