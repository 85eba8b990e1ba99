"""The offload engine's checkpoint state: what DCP saves from and loads into, in place; and a finished step's
host-resident state held for a checkpoint writer while training goes on (HeldState)."""

from __future__ import annotations

import threading

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from holotrain.memory.offload.buckets import FINAL
from holotrain.memory.offload.kernels import chunks
from holotrain.memory.offload.host import host_empty
from holotrain.memory.plan import HOST_USABLE, host_available_bytes


def engine_state(engine, buffers: dict | None = None) -> dict:
    """An OffloadEngine's checkpoint: the model state dict with the fp32 masters in place of the offloaded working
    weights, the device optimizer's state, and the offloaded moments, all keyed by parameter name (DTensors of the
    local shards with several ranks, so the layout does not depend on the world size). The tensors are the
    engine's own buffers (`buffers`: bucket -> (master, exp_avg, exp_avg_sq), by default the ones the updates write,
    once they are final): DCP saves from them and loads into them in place."""
    if buffers is None:
        engine.synchronize()
        buffers = {b: b.buffers for b in engine.buckets}
    optimizers = [engine.device_optimizer] if engine.device_optimizer is not None else []
    model_sd, optim_sd = get_state_dict(engine.model, optimizers)
    moments = {}
    for b in engine.buckets:
        for i, (p, fqn) in enumerate(zip(b.params, b.fqns)):
            views = [b.view(flat, i) for flat in buffers[b]]
            if isinstance(p, DTensor):
                views = [DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride()) for v in views]
            if fqn not in model_sd:
                raise KeyError(f"offload: {fqn} is not in the model's state dict")
            model_sd[fqn] = views[0]
            moments[fqn] = {"exp_avg": views[1], "exp_avg_sq": views[2]}
    meta = {"step": torch.tensor(engine.step_count), "speculate": torch.tensor(int(engine.speculate_next))}
    offload = {"state": moments, **meta}
    if engine.delayed:
        # The weights the next step computes on, a step behind the masters: an exact resume needs both.
        offload["working"] = {fqn: p.detach() for b in engine.buckets for p, fqn in zip(b.params, b.fqns)}
    return {"model": model_sd, "optim": optim_sd, "offload": offload}


def load_engine_state(engine, state: dict) -> None:
    """After DCP loaded into engine_state()'s tensors: restores the rest and uploads the masters."""
    device_sd = {k: v for k, v in state["model"].items() if k not in engine.offloaded_fqns}
    optimizers = [engine.device_optimizer] if engine.device_optimizer is not None else []
    set_state_dict(engine.model, optimizers, model_state_dict=device_sd, optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    engine.step_count = int(state["offload"]["step"])
    engine.speculate_next = bool(state["offload"]["speculate"])
    with torch.no_grad():
        for b in engine.buckets:
            b.version += 1
            if "working" in state["offload"]:
                # Delayed update, saved by a delayed run: the working weights were loaded in place; the masters
                # are the next backward's upload, as they were when the checkpoint was taken.
                for lo, hi in chunks(b.numel):
                    b.staging[lo:hi].copy_(b.master[lo:hi])
                b.pending_upload = True
            else:
                b.pending_upload = False
                engine._upload(b)
    engine.synchronize()


_allocating = threading.Lock()  # the disk checkpointer and the in-memory snapshots prepare at the same time


def allocate_spares(engine) -> str | None:
    """A second set of masters and moments per bucket, so that a checkpoint can read one finished step's state while
    the next steps update the other. None when allocated; otherwise why not (the host has no room for it)."""
    with _allocating:
        need = sum(3 * b.numel * 4 for b in engine.buckets if b.spare is None)
        room = host_available_bytes() * HOST_USABLE
        if need > room:
            return (f"a second copy of the offloaded optimizer state needs {need / 1e9:.1f} GB of host RAM, "
                    f"{room / 1e9:.1f} GB is usable")
        for b in engine.buckets:
            if b.spare is None:  # zeroed: its pages are faulted in now, not by the first update that writes it
                b.spare = tuple(host_empty(b.numel, torch.float32, zero=True) for _ in range(3))
        return None


def held_paths(engine) -> frozenset:
    """Where HeldState's tensors are in engine_state()."""
    return frozenset(path for b in engine.buckets for fqn in b.fqns for path in
                     (("model", fqn), ("offload", "state", fqn, "exp_avg"), ("offload", "state", fqn, "exp_avg_sq")))


class HeldState:
    """The offloaded masters and moments as they are at the end of the step just finished, held for a checkpoint
    writer while training goes on. Holding them costs the training loop nothing: the CPU worker may still be
    finishing that step's updates (ready() waits for them, on the writer's thread), and each bucket's next update
    reads this set and writes the bucket's spare set (out of place; as many passes over memory as in place), which
    becomes the set the updates write from then on. release() lets a later checkpoint hold a set again."""

    def __init__(self, engine):
        self.engine = engine
        with engine._lock:
            self.step = engine._step  # the step whose final values are held (None: before the first step)
            self.buffers = {b: b.buffers for b in engine.buckets}
            for b in engine.buckets:
                b.held, b.held_for = True, self.step if self.step is not None else self
        self.state = engine_state(engine, self.buffers)
        self.paths = held_paths(engine)  # where the held tensors are in `state`

    def _final(self, b) -> bool:
        # Moved on to the next set, or on to a later step without an update, or done with the held step.
        return b.held_for is None or b.step is not self.step or b.state == FINAL

    def ready(self) -> None:
        """Waits until every held buffer has the held step's final values."""
        self.engine._wait(lambda: all(self._final(b) for b in self.engine.buckets))

    def release(self) -> None:
        with self.engine._lock:
            for b in self.engine.buckets:
                b.held, b.held_for = False, None


def hold_state(engine, wait: bool) -> HeldState | None:
    """The finished step's state, held (see HeldState); None when there is no spare set to move on to, or (unless
    `wait`: until it releases it) another checkpoint holds one."""
    with engine._lock:
        if any(b.spare is None for b in engine.buckets):
            return None
        if any(b.held for b in engine.buckets):
            if not wait:
                return None
            engine._wait(lambda: not any(b.held for b in engine.buckets))  # the lock is re-entrant
    return HeldState(engine)


def leave_held(engine, b, step) -> tuple | None:
    """Worker, before an update of bucket b in `step`: when b's current set is held for an earlier step, the update
    moves to the spare set; returns the held set to read from (None: update in place)."""
    if b.held_for is None or b.held_for is step:
        return None
    with engine._lock:
        held = b.buffers
        b.master, b.exp_avg, b.exp_avg_sq = b.spare
        b.spare, b.held_for = held, None
        engine._lock.notify_all()
    return held
