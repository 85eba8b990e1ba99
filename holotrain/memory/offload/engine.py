"""OffloadEngine: the StepOptimizer (holotrain/optim) of memory.offload. It sets up the buckets, hooks backward
(gradients leave the GPU as their bucket completes) and the next forward (each unit waits for its new weights),
decides the step from the global gradient norm, and hands the CPU side to its worker (worker.py)."""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import math
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from holotrain.errors import ConfigError
from holotrain.memory.offload.buckets import FINAL, Bucket, Decision, Step, UploadBuffer, local, squared_norm
from holotrain.memory.offload.host import unregister
from holotrain.memory.offload.kernels import CHUNK, cpu_kernels
from holotrain.memory.offload.state import (
    allocate_spares,
    engine_state,
    held_paths,
    hold_state,
    load_engine_state,
)
from holotrain.memory.offload.worker import CpuWorker
from holotrain.memory.plan import model_units, offloadable, offloaded_units, usable_cores
from holotrain.optim import AdamWHyper, fused_adamw, step_clipped

if TYPE_CHECKING:
    from holotrain.memory.config import MemoryConfig
    from holotrain.parallel import DistEnv


class OffloadEngine(CpuWorker):
    """Takes the optimizer's place for a model whose (last `offload_ratio` of) parameters are offloaded. Driven as
    every StepOptimizer: begin(lr, accum) before the micro-batches, finish() after the last backward."""

    def __init__(self, model: nn.Module, section: MemoryConfig, hyper: AdamWHyper, lr: float, env: DistEnv,
                 compute_dtype: torch.dtype, clock=None):
        # The update and accumulation loops (memory.offload_kernel): compiled (one pass, GIL released) or torch
        # ops; `kernel` says which ("c" or "torch"), for the benchmark's rows. First, so that a "native" that cannot
        # be built fails before any memory is moved or allocated.
        self._kernels = cpu_kernels(section.offload_kernel)
        self.kernel = "c" if self._kernels is not None else "torch"
        self.model, self.device, self.hyper = model, env.device, hyper
        self.cuda = env.device.type == "cuda"
        self.sharded = env.world_size > 1
        self.clock = clock  # a PhaseClock: time.offload_wait and time.optimizer
        # One GPU: working weights in the compute dtype (bf16 halves their memory and the transfers); FSDP2 keeps
        # fp32 shards and gathers them in bf16 itself; on the CPU the working dtype is the compute dtype (fp32).
        self.working_dtype = compute_dtype if not self.sharded else torch.float32
        self.threads = section.offload_threads or max(1, usable_cores() // max(1, env.local_world_size) - 1)
        # The delayed parameter update (memory.offload_delayed_update; see the package's docstring).
        self.delayed = section.offload_delayed_update

        units = model_units(model)
        cpu_units = offloaded_units(units, section.offload_ratio)
        on_device, offloaded = [], []
        for u in units:
            mine = [(n, p) for n, p in u.params if u.name in cpu_units and offloadable(p)]
            on_device += [(n, p) for n, p in u.params if not (u.name in cpu_units and offloadable(p))]
            if mine:
                offloaded.append((u, mine))

        with torch.no_grad():
            # Device-side parameters and buffers first: on one device the model was built on the host, and moving
            # these frees their host memory before the offloaded buffers are allocated.
            for _, p in on_device:
                if p.device != self.device:
                    p.data = p.data.to(self.device)
            for module in model.modules():
                for key, buf in module._buffers.items():
                    if buf is not None and buf.device != self.device:
                        module._buffers[key] = buf.to(self.device)
            # One bucket at a time, so that the host never holds the model's fp32 copy and all the buckets at once.
            self.buckets: list[Bucket] = []
            for u, named in offloaded:
                b = Bucket(u.name, u.index, named, self.working_dtype, self.cuda)
                for i, p in enumerate(b.params):
                    b.view(b.master, i).copy_(local(p))
                    if not self.sharded and (p.device != self.device or p.dtype != self.working_dtype):
                        p.data = b.view(b.master, i).to(self.device, self.working_dtype)  # frees the host fp32 copy
                self.buckets.append(b)
        # The rest (all 1-D parameters, and the first units with offload_ratio < 1): fused AdamW on the device.
        self.device_params = [p for _, p in on_device]
        self.device_optimizer = fused_adamw(self.device_params, lr, hyper) if self.device_params else None
        self.offloaded_fqns = {f for b in self.buckets for f in b.fqns}

        self.step_count = 0  # AdamW steps applied (skipped steps do not count)
        self.speculate_next = True
        self._step: Step | None = None
        self._init_worker()
        if self.cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
            biggest = max((b.numel for b in self.buckets), default=0)
            self._uploads = [UploadBuffer(biggest, self.working_dtype) for _ in range(2)] if biggest else []
            self._next_upload = 0
        self._scratch = torch.empty(min(CHUNK, max((b.numel for b in self.buckets), default=0)), dtype=torch.float32)
        self._scratch2 = torch.empty_like(self._scratch)

        self._handles = []
        for b in self.buckets:
            for p in b.params:
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, b)))
        self._install_gates()
        # A shorter GIL switch interval while the engine runs: each time the worker needs the GIL back (after an
        # update, around each copy it queues) it waits at most this long for the training thread to yield it.
        self._switch_interval = None
        if section.offload_gil_switch_ms > 0:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, section.offload_gil_switch_ms / 1000.0))
        self._thread.start()
        atexit.register(self.close)

    # ----------------------------------------------------------------------------------------
    # Main thread: the step (StepOptimizer)

    def begin(self, lr: float, accum: int) -> None:
        """Before the first micro-batch of a step."""
        self._raise_if_failed()
        landings = 1 if self.sharded else accum  # FSDP2 reduce-scatters (and calls the hooks) once per step
        if self.delayed and landings > 1:
            raise ConfigError(f"memory.offload_delayed_update = true takes one micro-batch per step on one process, "
                              f"not {accum} (training.micro_batch_size = training.batch_size)")
        if landings > 1:
            for b in self.buckets:
                if b.acc is None:
                    b.acc = torch.empty(b.numel, dtype=torch.float32)
        for b in self.buckets:
            b.staged = b.arrived = 0
        # Delayed updates always know the norm first: the whole next step hides them.
        self._step = Step(lr=lr, t=self.step_count + 1, landings=landings,
                          speculate=self.speculate_next and not self.delayed)

    def finish(self) -> torch.Tensor:
        """After the last backward: waits for the gradients to land (the exposed wait, time.offload_wait), then
        clips with the global norm, steps the device-side parameters and lets the worker finish the CPU side
        (time.optimizer). Returns the gradient norm (a device tensor)."""
        self.wait_landed()
        with self._phase("optimizer"):
            return self._decide()

    def wait_landed(self) -> None:
        """After the last backward: waits until every bucket's gradient is on the host, its norm taken."""
        step = self._step
        missing = [b.name for b in self.buckets if b.staged != step.landings]
        if missing:
            raise RuntimeError(f"offload: parameters of {missing} received no gradient in this backward")
        with self._phase("offload_wait"):
            self._wait(lambda: all(b.step is step for b in self.buckets))

    def _decide(self) -> torch.Tensor:
        step = self._step
        sq = torch.tensor(sum(b.sq_norm for b in self.buckets), dtype=torch.float64, device=self.device)
        grads = [local(p.grad) for p in self.device_params if p.grad is not None]
        if grads:
            sq = sq + torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        if self.sharded:
            dist.all_reduce(sq)
        norm = sq.sqrt()
        value = norm.item()  # the host needs it to steer the worker; the device is idle here anyway
        norm = norm.float()
        finite = math.isfinite(value)
        decision = Decision(scale=self.hyper.clip_scale(value) if finite else 1.0, skip=not finite)

        opt = self.device_optimizer
        if opt is not None:
            for group in opt.param_groups:
                group["lr"] = step.lr
            if not self.sharded:
                step_clipped(opt, norm, self.hyper.clip)  # skips the step itself on a non-finite norm
            elif not decision.skip:
                if decision.scale > 1.0:
                    torch._foreach_div_(grads, decision.scale)
                opt.step()
            opt.zero_grad(set_to_none=True)

        with self._lock:
            step.decision = decision
            self._stats["steps"] += 1
            self._stats["speculated"] += step.speculate
            self._lock.notify_all()
        # Speculate on the next step unless this one was clipped (or, with clipping, not finite).
        self.speculate_next = math.isinf(self.hyper.clip) or (finite and value <= self.hyper.clip)
        if not decision.skip:
            self.step_count += 1
        return norm

    def synchronize(self) -> None:
        """Waits until every bucket's update is final and uploaded."""
        self._wait(lambda: all(b.state == FINAL for b in self.buckets))
        if self.cuda:
            self._h2d.synchronize()

    def metrics(self, steps: int) -> dict:
        """Per-step means since the last call: the CPU step (AdamW, rollbacks, conversions, uploads), landing
        (accumulation and its norm; next to nothing with one landing per step, whose norm the GPU takes), the
        worker's time blocked on copies (gradients the GPU has not produced yet, upload buffers still being read:
        the GPU's pace, not CPU work), the transfers (GPU time of the copies, overlapped with compute unless
        time.offload_wait shows otherwise), rolled-back buckets, and the share of steps that speculated."""
        self._resolve_transfers()
        with self._lock:
            s, self._stats = self._stats, collections.Counter()
        n = max(1, steps)
        return {
            "offload.cpu_step_s": s["cpu_s"] / n,
            "offload.adamw_s": s["adamw_s"] / n,  # of which the AdamW loops themselves (the rest: Python, the GIL)
            "offload.land_s": s["land_s"] / n,
            "offload.copy_wait_s": s["copy_wait_s"] / n,
            "offload.d2h_s": s["d2h_s"] / n,
            "offload.h2d_s": s["h2d_s"] / n,
            "offload.rollbacks": s["rollbacks"] / n,
            "offload.speculated": s["speculated"] / max(1, s["steps"]),
            # Delayed update: backward blocked until the CPU had finished the previous step's update of a bucket.
            "offload.release_wait_s": s["release_wait_s"] / n,
        }

    def state_dict(self) -> dict:
        """The checkpoint's tensors, the engine's own buffers among them (state.py)."""
        return engine_state(self)

    def load_state_dict(self, saved: dict) -> None:
        """After a checkpoint was loaded into state_dict()'s tensors: the rest, and the masters uploaded."""
        load_engine_state(self, saved)

    def prepare_hold(self) -> str | None:
        """A spare set of masters and moments (state.HeldState); why not, if the host has no room."""
        if self.delayed:
            return ("with memory.offload_delayed_update the working weights are a step behind the masters and are "
                    "saved with them")
        return allocate_spares(self)

    def hold(self, wait: bool = True):
        return hold_state(self, wait)

    @property
    def optional_paths(self) -> tuple:
        """State entries a checkpoint may lack: the working weights only a delayed run saves."""
        return (("offload", "working"),) if self.delayed else ()

    @property
    def held_paths(self) -> frozenset:
        return held_paths(self)

    def update_after(self, event) -> bool:
        return False  # the device weights are written by uploads during the next step, ahead of finish()

    def close(self) -> None:
        """Lets the worker finish what it can and stops it (also at interpreter exit); safe to call twice."""
        if not self._thread.is_alive():
            return
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no copy may still read or write the host buffers
            for buf in [b.staging for b in self.buckets] + [u.data for u in self._uploads]:
                unregister(buf)

    # ----------------------------------------------------------------------------------------
    # Autograd thread: gradients leave the GPU

    def _on_grad(self, b: Bucket, param: torch.Tensor) -> None:
        b.arrived += 1
        if b.arrived < len(b.params):
            return
        b.arrived = 0
        step, m = self._step, b.staged
        b.staged += 1
        t0 = time.perf_counter()
        # The previous micro-batch's gradient has been added up; delayed: the previous step's update is done.
        self._wait(lambda: b.staging_free)
        if self.delayed:
            self._count("release_wait_s", time.perf_counter() - t0)
        b.staging_free = False
        grads = [local(p.grad) for p in b.params]
        # One landing per step: the bucket's squared norm is taken here, on the device (a read of the gradient
        # that the GPU does in microseconds), so the host never makes a pass over it. With accumulation the norm is
        # that of the sum, taken on the host while it adds the last micro-batch.
        sq = squared_norm(grads) if step.landings == 1 else None
        if self.cuda:
            # On the stream that produced the gradients (FSDP2: its reduce-scatter stream), after their norm: the
            # copies below wait for this event, the norm's included.
            b.grads_ready = torch.cuda.current_stream().record_event()
        if b.pending_upload:
            self._upload_staged(b)
        copied = None
        if self.cuda:
            self._d2h.wait_event(b.grads_ready)
            start, copied = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._d2h):
                start.record()
                for i, g in enumerate(grads):
                    b.view(b.staging, i).copy_(g, non_blocking=True)
                if sq is not None:
                    b.sq_host.copy_(sq, non_blocking=True)
                copied.record()
            for g in grads:
                g.record_stream(self._d2h)  # freed below, but not reused before the copy has read it
            if sq is not None:
                sq.record_stream(self._d2h)
        else:
            for i, g in enumerate(grads):
                b.view(b.staging, i).copy_(g)
            b.sq_host = sq
        for p in b.params:
            p.grad = None
        with self._lock:
            if copied is not None:
                self._transfers.append(("d2h_s", start, copied))
            self._arrivals.append((b, step, m, copied))
            self._lock.notify_all()

    def _upload_staged(self, b: Bucket) -> None:
        """Delayed update: the new weights the bucket's last update wrote over its gradient in the staging buffer
        become its working weights, now that this backward is done with the old ones, before the buffer takes the
        new gradient (on a GPU, the D2H copy waits for the upload)."""
        done = self._to_working(b, b.staging)
        if done is not None:
            self._d2h.wait_event(done)
        with self._lock:
            b.pending_upload = False
            b.uploaded = b.version

    # ----------------------------------------------------------------------------------------
    # Main thread: the next forward waits for its weights

    def _install_gates(self) -> None:
        def gate(buckets, *hook_args):
            self._gate(buckets)

        def hook(buckets):
            # Compiled blocks run their hooks inside the compiled call: keep the wait out of the graph.
            return torch._dynamo.disable(functools.partial(gate, buckets))

        if not self.buckets:
            return
        if self.sharded:
            self._handles.append(self.model.register_forward_pre_hook(hook(self.buckets), prepend=True))
            return
        by_name = {b.name: b for b in self.buckets}
        layers = list(self.model.layers.items())
        if "pre" in by_name:
            self._handles.append(self.model.register_forward_pre_hook(hook([by_name["pre"]]), prepend=True))
        for key, block in layers:
            if f"layers.{key}" in by_name:
                self._handles.append(block.register_forward_pre_hook(hook([by_name[f"layers.{key}"]]), prepend=True))
        if "post" in by_name:  # the final norm and output head run right after the last block
            self._handles.append(layers[-1][1].register_forward_hook(hook([by_name["post"]])))

    def _gate(self, buckets: list[Bucket]) -> None:
        with self._phase("offload_wait"):
            if not self.delayed:  # delayed: the weights this forward takes were uploaded in the last backward
                self._wait(lambda: all(b.state == FINAL for b in buckets))
            if self.cuda:
                for b in buckets:
                    if b.upload_event is not None:
                        torch.cuda.current_stream().wait_event(b.upload_event)

    # ----------------------------------------------------------------------------------------
    # Helpers

    def _resolve_transfers(self) -> None:
        """Adds the GPU time of finished copies to the stats; copies still running count next time."""
        with self._lock:
            pending, self._transfers = self._transfers, []
        left = []
        for key, start, end in pending:
            if end.query():
                self._count(key, start.elapsed_time(end) / 1000.0)
            else:
                left.append((key, start, end))
        with self._lock:
            self._transfers = left + self._transfers

    def _phase(self, name: str):
        return self.clock.phase(name) if self.clock is not None else contextlib.nullcontext()
