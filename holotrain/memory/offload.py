"""ZeRO-Offload: fp32 master weights and AdamW states in host memory, working weights on the GPU, and the CPU
step overlapped with backward and with the next forward. Switched on by `memory.offload = true`; built by
`build_optimizer`, driven by `TrainStep` (begin_step before the micro-batches, finish_step after them).

A step, on one GPU:

  backward     A post-accumulate-grad hook counts each offloaded parameter's gradient. When a bucket (one unit
               of holotrain/memory/plan.py: the embedding, one block, or the final norm + output head) has all
               of its gradients, they are copied on a side stream ("D2H") into the bucket's pinned staging
               buffer and freed on the GPU, so at most a few buckets' gradients exist on the GPU at a time.
  CPU worker   One thread (its own intra-op thread pool, `memory.offload_threads`). It *lands* each bucket
               (waits for its copy, adds micro-batches into an fp32 accumulator, takes its squared norm), then
               *updates* it with torch's fused CPU AdamW on flat fp32 buffers, in chunks that stay in cache:
               bf16 gradient -> fp32 scratch, AdamW, fp32 master -> bf16 upload buffer. The upload buffer is
               copied into the working weights on a second side stream ("H2D").
  order        Among landed buckets the worker always updates the one the next forward needs first. During
               backward that is the one that landed last; once backward ends it is the embedding, then block 0,
               block 1, ..., so the next forward starts as soon as its first bucket is back.
  next forward A forward pre-hook per unit waits until that unit's final weights are uploaded (host wait, then
               the compute stream waits on the upload's CUDA event). The wait is timed as `time.offload_wait`:
               the exposed, non-overlapped part of offloading.

Gradient clipping needs the global norm, known only when backward ends, while the point of the worker is to
update buckets before that. The engine speculates: when the previous step was not clipped (norms usually stay
below the threshold once training settles), each bucket is updated as soon as it lands, unclipped, and
uploaded. When backward ends the norm is summed from the buckets' norms (and the GPU-side gradients, and over
the ranks). If it needs no clipping the speculative updates are final. If it does (or is not finite), every
speculatively updated bucket is rolled back, since AdamW's step is invertible given the gradient (kept until
the next step), and redone with the clipped gradient (or left as it was: the step is skipped). After a
clipped step the next one does not speculate: it lands everything, waits for the norm and updates once, in
forward order, overlapping only the next forward. So a misprediction costs one extra pass over the buckets,
and only at the step where the norm first crosses the threshold. The alternative, computing the norm before
any update, would leave the CPU idle for all of backward on every step. A rollback restores the weights to
within fp32 rounding; for bit-exact reproducibility every bucket of a mispredicted step takes the same path
(update, roll back, redo) whether or not it had been updated when the norm arrived.

Partial offload (`memory.offload_ratio`): the last units in forward order run on the CPU, the rest (and all
norm weights) are ordinary fp32 parameters with a fused AdamW on the device, clipped with the same norm.

Several ranks (FSDP2): each rank holds 1/N of every parameter, so the engine on the local shards is the ZeRO
partition: 1/N of the masters and moments per rank. FSDP2 reduce-scatters gradients and calls the
post-accumulate-grad hooks of the sharded parameters itself; working shards stay fp32 (FSDP2 gathers them in
bf16). FSDP2 starts its all-gathers on its own streams, synchronized with the compute stream once, at the
root's forward, so with several ranks the engine waits for all buckets there instead of per unit.

On the CPU device (tests) the same code runs without streams: copies are synchronous, working weights fp32.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import math
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from holotrain.memory.plan import model_units, offloadable, offloaded_units

CHUNK = 1 << 22  # elements per AdamW call: a chunk's gradient scratch (16 MB fp32) stays in cache

# Bucket states within a step: LANDED (gradient on the host, norm known), SPECULATED (updated unclipped and
# uploaded before the norm was known), FINAL (this step's update is uploaded; the next forward may use it).
LANDED, SPECULATED, FINAL = "landed", "speculated", "final"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _fqn(name: str) -> str:
    """A parameter's name as the model's state dict spells it (without wrapper modules' prefixes)."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


_PAGE = 4096


def _pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly this size. torch's pinned allocator rounds each allocation up to a power
    of two (a 630 MB bucket would pin 1 GB); page-locking an ordinary allocation with cudaHostRegister does not.
    Falls back to torch's allocator if registering fails."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    span = -(-nbytes // _PAGE) * _PAGE
    raw = torch.empty(span + _PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE  # page-aligned, so no page is shared with another registration
    region = raw[start:start + span]
    try:
        registered = span > 0 and int(torch.cuda.cudart().cudaHostRegister(region.data_ptr(), span, 0)) == 0
    except (AttributeError, RuntimeError, TypeError):
        registered = False
    if not registered:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    tensor = region[:nbytes].view(dtype)
    tensor._holotrain_registered = True  # unregistered by OffloadEngine.close
    return tensor


def _unregister(tensor: torch.Tensor) -> None:
    if getattr(tensor, "_holotrain_registered", False):
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        tensor._holotrain_registered = False


def _chunks(n: int):
    for lo in range(0, n, CHUNK):
        yield lo, min(n, lo + CHUNK)


@dataclass
class _Step:
    lr: float
    t: int  # AdamW step number of this step's update (1-based)
    landings: int  # gradient arrivals per bucket per step: micro-batches on one device, 1 with FSDP2
    speculate: bool
    decision: _Decision | None = None


@dataclass
class _Decision:
    scale: float  # gradients are divided by it (1.0: no clipping)
    skip: bool  # the norm is not finite: no update

    @property
    def unchanged(self) -> bool:
        return self.scale == 1.0 and not self.skip


class _Bucket:
    """One unit's offloaded parameters as flat host buffers."""

    def __init__(self, name: str, index: int, named: list[tuple[str, nn.Parameter]], working_dtype, pin: bool):
        self.name, self.index = name, index
        self.params = [p for _, p in named]
        self.fqns = [_fqn(n) for n, _ in named]
        self.shapes = [_local(p).shape for p in self.params]
        self.spans, offset = [], 0
        for shape in self.shapes:
            n = shape.numel()
            self.spans.append((offset, n))
            offset += n
        self.numel = offset
        self.master = torch.empty(offset, dtype=torch.float32)
        self.exp_avg = torch.zeros(offset, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(offset, dtype=torch.float32)
        # The D2H target; pinned so that the copies run asynchronously, on the copy engine.
        self.staging = _pinned_empty(offset, working_dtype) if pin else torch.empty(offset, dtype=working_dtype)
        self.acc: torch.Tensor | None = None  # fp32 sum of micro-batch gradients (one device, accumulation)
        # Per step: the engine's lock guards these.
        self.state = FINAL
        self.step: _Step | None = None
        self.arrived = 0  # gradients counted in this backward (autograd thread only)
        self.staged = 0  # staging copies issued this step
        self.staging_free = True
        self.grad: torch.Tensor | None = None  # the landed gradient (staging or acc)
        self.sq_norm = 0.0
        self.speculated = False  # masters hold this step's unclipped update
        self.version = self.uploaded = 0  # master changes / the change the working weights show
        self.grads_ready = None  # CUDA event: backward is done with this bucket's weights and gradients
        self.upload_event = None  # CUDA event: the latest upload has landed

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        off, n = self.spans[i]
        return flat[off:off + n].view(self.shapes[i])


class _UploadBuffer:
    def __init__(self, numel: int, dtype: torch.dtype):
        self.data = _pinned_empty(numel, dtype)
        self.in_use = None  # CUDA event of the copy that reads it


class OffloadEngine:
    """Takes the optimizer's place for a model whose (last `offload_ratio` of) parameters are offloaded."""

    def __init__(self, model: nn.Module, cfg, env, compute_dtype: torch.dtype):
        t, mem = cfg.training, cfg.memory
        self.model, self.device = model, env.device
        self.cuda = env.device.type == "cuda"
        self.sharded = env.world_size > 1
        self.clip = t.grad_clip if t.grad_clip > 0 else math.inf
        self.betas, self.eps, self.weight_decay = (t.beta1, t.beta2), t.eps, t.weight_decay
        self.clock = None  # TrainStep's PhaseClock, for time.offload_wait
        # One GPU: working weights in the compute dtype (bf16 halves their memory and the transfers); FSDP2 keeps
        # fp32 shards and gathers them in bf16 itself; on the CPU the working dtype is the compute dtype (fp32).
        self.working_dtype = compute_dtype if not self.sharded else torch.float32
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.threads = mem.offload_threads or max(1, cores // local_ranks - 1)

        units = model_units(model)
        cpu_units = offloaded_units(units, mem.offload_ratio)
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
            self.buckets = []
            for u, named in offloaded:
                b = _Bucket(u.name, u.index, named, self.working_dtype, self.cuda)
                for i, p in enumerate(b.params):
                    b.view(b.master, i).copy_(_local(p))
                    if not self.sharded and (p.device != self.device or p.dtype != self.working_dtype):
                        p.data = b.view(b.master, i).to(self.device, self.working_dtype)  # frees the host fp32 copy
                self.buckets.append(b)
        self.device_params = [p for _, p in on_device]
        self.device_optimizer = None
        if self.device_params:
            decay = [p for p in self.device_params if p.ndim >= 2]
            no_decay = [p for p in self.device_params if p.ndim < 2]
            groups = [g for g in ({"params": decay, "weight_decay": t.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
            self.device_optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=self.betas, eps=t.eps, fused=True)
        self.offloaded_fqns = {f for b in self.buckets for f in b.fqns}

        self.step_count = 0  # AdamW steps applied (skipped steps do not count)
        self.speculate_next = True
        self._step: _Step | None = None
        self._lock = threading.Condition()
        self._arrivals: collections.deque = collections.deque()
        self._error: BaseException | None = None
        self._stop = False
        self._stats = collections.Counter()
        self._transfers: list[tuple[str, object, object]] = []
        if self.cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
            biggest = max((b.numel for b in self.buckets), default=0)
            self._uploads = [_UploadBuffer(biggest, self.working_dtype) for _ in range(2)] if biggest else []
            self._next_upload = 0
        self._scratch = torch.empty(min(CHUNK, max((b.numel for b in self.buckets), default=0)), dtype=torch.float32)
        self._scratch2 = torch.empty_like(self._scratch)

        self._handles = []
        for b in self.buckets:
            for p in b.params:
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, b)))
        self._install_gates()
        self._thread = threading.Thread(target=self._work, name="holotrain-offload", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # ----------------------------------------------------------------------------------------
    # Main thread: the step

    def begin_step(self, lr: float, accum: int) -> None:
        """Before the first micro-batch of a step."""
        self._raise_if_failed()
        landings = 1 if self.sharded else accum  # FSDP2 reduce-scatters (and calls the hooks) once per step
        if landings > 1:
            for b in self.buckets:
                if b.acc is None:
                    b.acc = torch.empty(b.numel, dtype=torch.float32)
        for b in self.buckets:
            b.staged = b.arrived = 0
        self._step = _Step(lr=lr, t=self.step_count + 1, landings=landings, speculate=self.speculate_next)

    def wait_landed(self) -> None:
        """After the last backward: waits until every bucket's gradient is on the host, its norm taken."""
        step = self._step
        missing = [b.name for b in self.buckets if b.staged != step.landings]
        if missing:
            raise RuntimeError(f"offload: parameters of {missing} received no gradient in this backward")
        with self._phase("offload_wait"):
            self._wait(lambda: all(b.step is step for b in self.buckets))

    def finish_step(self) -> torch.Tensor:
        """Clips with the global norm, steps the device-side parameters and lets the worker finish the CPU
        side. Returns the gradient norm (a device tensor)."""
        step = self._step
        self.wait_landed()
        sq = torch.tensor(sum(b.sq_norm for b in self.buckets), dtype=torch.float64, device=self.device)
        grads = [_local(p.grad) for p in self.device_params if p.grad is not None]
        if grads:
            sq = sq + torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        if self.sharded:
            dist.all_reduce(sq)
        norm = sq.sqrt()
        value = norm.item()  # the host needs it to steer the worker; the device is idle here anyway
        norm = norm.float()
        finite = math.isfinite(value)
        decision = _Decision(scale=max(value / self.clip, 1.0) if finite else 1.0, skip=not finite)

        opt = self.device_optimizer
        if opt is not None:
            for group in opt.param_groups:
                group["lr"] = step.lr
            if not self.sharded:
                # As TrainStep does without offload: clip inside the fused kernel, skip on a non-finite norm.
                opt.grad_scale = torch.clamp(norm / self.clip, min=1.0)
                opt.found_inf = (~torch.isfinite(norm)).float()
                opt.step()
                opt.grad_scale = opt.found_inf = None
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
        self.speculate_next = math.isinf(self.clip) or (finite and value <= self.clip)
        if not decision.skip:
            self.step_count += 1
        return norm

    def synchronize(self) -> None:
        """Waits until every bucket's update is final and uploaded."""
        self._wait(lambda: all(b.state == FINAL for b in self.buckets))
        if self.cuda:
            self._h2d.synchronize()

    def metrics(self, steps: int) -> dict:
        """Per-step means since the last call: the CPU step (AdamW, rollbacks, conversions), landing (waits for
        copies, accumulation, norms), the transfers (GPU time of the copies, overlapped with compute unless
        time.offload_wait shows otherwise), rolled-back buckets, and the share of steps that speculated."""
        self._resolve_transfers()
        with self._lock:
            s, self._stats = self._stats, collections.Counter()
        n = max(1, steps)
        return {
            "offload.cpu_step_s": s["cpu_s"] / n,
            "offload.land_s": s["land_s"] / n,
            "offload.d2h_s": s["d2h_s"] / n,
            "offload.h2d_s": s["h2d_s"] / n,
            "offload.rollbacks": s["rollbacks"] / n,
            "offload.speculated": s["speculated"] / max(1, s["steps"]),
        }

    def close(self) -> None:
        """Lets the worker finish what it can and stops it (also at interpreter exit)."""
        if not self._thread.is_alive():
            return
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no copy may still read or write the host buffers
            for buf in [b.staging for b in self.buckets] + [u.data for u in self._uploads]:
                _unregister(buf)

    # ----------------------------------------------------------------------------------------
    # Checkpoints

    def checkpoint_state(self) -> dict:
        """What a checkpoint holds: the model state dict with the fp32 masters in place of the offloaded working
        weights, the device optimizer's state, and the offloaded moments, all keyed by parameter name (DTensors
        of the local shards with several ranks, so the layout does not depend on the world size). The tensors
        are the engine's own buffers: DCP saves from them and loads into them in place."""
        self.synchronize()
        optimizers = [self.device_optimizer] if self.device_optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self.model, optimizers)
        moments = {}
        for b in self.buckets:
            for i, (p, fqn) in enumerate(zip(b.params, b.fqns)):
                views = [b.view(flat, i) for flat in (b.master, b.exp_avg, b.exp_avg_sq)]
                if isinstance(p, DTensor):
                    views = [DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                stride=p.stride()) for v in views]
                if fqn not in model_sd:
                    raise KeyError(f"offload: {fqn} is not in the model's state dict")
                model_sd[fqn] = views[0]
                moments[fqn] = {"exp_avg": views[1], "exp_avg_sq": views[2]}
        meta = {"step": torch.tensor(self.step_count), "speculate": torch.tensor(int(self.speculate_next))}
        return {"model": model_sd, "optim": optim_sd, "offload": {"state": moments, **meta}}

    def load_checkpoint_state(self, state: dict) -> None:
        """After DCP loaded into checkpoint_state()'s tensors: restores the rest and uploads the masters."""
        device_sd = {k: v for k, v in state["model"].items() if k not in self.offloaded_fqns}
        optimizers = [self.device_optimizer] if self.device_optimizer is not None else []
        set_state_dict(self.model, optimizers, model_state_dict=device_sd, optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))
        self.step_count = int(state["offload"]["step"])
        self.speculate_next = bool(state["offload"]["speculate"])
        with torch.no_grad():
            for b in self.buckets:
                b.version += 1
                self._upload(b)
        self.synchronize()

    # ----------------------------------------------------------------------------------------
    # Autograd thread: gradients leave the GPU

    def _on_grad(self, b: _Bucket, param: torch.Tensor) -> None:
        b.arrived += 1
        if b.arrived < len(b.params):
            return
        b.arrived = 0
        step, m = self._step, b.staged
        b.staged += 1
        self._wait(lambda: b.staging_free)  # the previous micro-batch's gradient has been added up
        b.staging_free = False
        grads = [_local(p.grad) for p in b.params]
        copied = None
        if self.cuda:
            # On the stream that produced the gradients (FSDP2: its reduce-scatter stream).
            b.grads_ready = torch.cuda.current_stream().record_event()
            self._d2h.wait_event(b.grads_ready)
            start, copied = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._d2h):
                start.record()
                for i, g in enumerate(grads):
                    b.view(b.staging, i).copy_(g, non_blocking=True)
                copied.record()
            for g in grads:
                g.record_stream(self._d2h)  # freed below, but not reused before the copy has read it
        else:
            for i, g in enumerate(grads):
                b.view(b.staging, i).copy_(g)
        for p in b.params:
            p.grad = None
        with self._lock:
            if copied is not None:
                self._transfers.append(("d2h_s", start, copied))
            self._arrivals.append((b, step, m, copied))
            self._lock.notify_all()

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

    def _gate(self, buckets: list[_Bucket]) -> None:
        with self._phase("offload_wait"):
            self._wait(lambda: all(b.state == FINAL for b in buckets))
            if self.cuda:
                for b in buckets:
                    if b.upload_event is not None:
                        torch.cuda.current_stream().wait_event(b.upload_event)

    # ----------------------------------------------------------------------------------------
    # Worker thread

    def _work(self) -> None:
        try:
            torch.set_num_threads(self.threads)  # this thread's intra-op pool only
            if self.cuda:
                torch.cuda.set_device(self.device)
            with torch.no_grad():
                while (task := self._next_task()) is not None:
                    kind, item = task
                    t0 = time.perf_counter()
                    if kind == "land":
                        self._land(*item)
                        self._count("land_s", time.perf_counter() - t0)
                    else:
                        self._update(item)
                        self._count("cpu_s", time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def _next_task(self):
        """Landings first (they free staging buffers and bring the norm closer), then the update the next
        forward needs first. None: stopped and nothing left that can run."""
        with self._lock:
            while True:
                if self._arrivals:
                    return "land", self._arrivals.popleft()
                for b in self.buckets:  # forward order
                    step = b.step
                    if (b.state == LANDED and (step.speculate or step.decision is not None)) or (
                            b.state == SPECULATED and step.decision is not None):
                        return "update", b
                if self._stop:
                    return None
                self._lock.wait()

    def _land(self, b: _Bucket, step: _Step, m: int, copied) -> None:
        if copied is not None:
            copied.synchronize()
        grad = b.staging
        if step.landings > 1:
            if m == 0:
                b.acc.copy_(b.staging)
            else:
                b.acc.add_(b.staging)
            grad = b.acc
            with self._lock:
                b.staging_free = True
                self._lock.notify_all()
        if m < step.landings - 1:
            return
        sq = 0.0
        for lo, hi in _chunks(b.numel):
            sq += torch.linalg.vector_norm(grad[lo:hi], dtype=torch.float32).item() ** 2
        with self._lock:
            b.grad, b.sq_norm, b.step, b.speculated = grad, sq, step, False
            b.state = LANDED
            self._lock.notify_all()

    def _update(self, b: _Bucket) -> None:
        step = b.step
        decision = step.decision
        upload = None
        if step.speculate and b.state == LANDED:
            if math.isfinite(b.sq_norm):  # a non-finite bucket is never applied: the step will be skipped
                upload = self._adamw(b, step, 1.0, to_upload=decision is None or decision.unchanged)
                b.speculated = True
            if decision is None:
                if b.version != b.uploaded:
                    self._upload(b, upload)
                with self._lock:
                    b.state = SPECULATED
                return
        if step.speculate:
            if not decision.unchanged:
                if b.speculated:
                    self._rollback(b, step)
                    self._count("rollbacks", 1)
                if not decision.skip:
                    upload = self._adamw(b, step, decision.scale, to_upload=True)
        elif not decision.skip:
            upload = self._adamw(b, step, decision.scale, to_upload=True)
        if b.version != b.uploaded:
            self._upload(b, upload)
        with self._lock:
            b.state = FINAL
            if step.landings == 1:
                b.staging_free = True  # the gradient stayed in the staging buffer until now (rollbacks need it)
            self._lock.notify_all()

    def _adamw(self, b: _Bucket, step: _Step, scale: float, to_upload: bool) -> _UploadBuffer | None:
        """One AdamW step of the bucket's masters, gradient divided by `scale`. With to_upload (on a GPU), also
        writes the new weights in the working dtype into an upload buffer, chunk by chunk while they are in
        cache, and returns it."""
        upload = self._upload_buffer() if (to_upload and self.cuda) else None
        grad_scale = None if scale == 1.0 else torch.tensor(scale, dtype=torch.float32)
        t = torch.tensor(float(step.t))
        for lo, hi in _chunks(b.numel):
            g = b.grad[lo:hi]
            if g.dtype != torch.float32:
                g = self._scratch[:hi - lo].copy_(g)
            torch._fused_adamw_(
                [b.master[lo:hi]], [g], [b.exp_avg[lo:hi]], [b.exp_avg_sq[lo:hi]], [], [t],
                lr=step.lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.weight_decay, eps=self.eps,
                amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None,
            )
            if upload is not None:
                upload.data[lo:hi].copy_(b.master[lo:hi])
        b.version += 1
        return upload

    def _rollback(self, b: _Bucket, step: _Step) -> None:
        """Undoes this step's unclipped AdamW update of the bucket, given the same gradient:
        p = (p' + lr/bc1 * m' / (sqrt(v')/sqrt(bc2) + eps)) / (1 - lr*wd), m = (m' - (1-b1) g) / b1,
        v = (v' - (1-b2) g^2) / b2."""
        b1, b2 = self.betas
        step_size = step.lr / (1 - b1 ** step.t)
        bc2_sqrt = math.sqrt(1 - b2 ** step.t)
        decay = 1 - step.lr * self.weight_decay
        for lo, hi in _chunks(b.numel):
            p, m, v = b.master[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi]
            g = b.grad[lo:hi]
            if g.dtype != torch.float32:
                g = self._scratch[:hi - lo].copy_(g)
            denom = torch.sqrt(v, out=self._scratch2[:hi - lo]).div_(bc2_sqrt).add_(self.eps)
            p.addcdiv_(m, denom, value=step_size).div_(decay)
            if b1 > 0:
                m.sub_(g, alpha=1 - b1).div_(b1)
            else:
                m.zero_()
            if b2 > 0:
                v.addcmul_(g, g, value=-(1 - b2)).div_(b2).clamp_(min=0)
            else:
                v.zero_()
        b.version += 1

    def _upload(self, b: _Bucket, upload: _UploadBuffer | None = None) -> None:
        """Masters -> working weights (through a pinned upload buffer and the H2D stream on a GPU)."""
        if not self.cuda:
            for i, p in enumerate(b.params):
                _local(p).copy_(b.view(b.master, i))
            b.uploaded = b.version
            return
        if upload is None:
            upload = self._upload_buffer()
            for lo, hi in _chunks(b.numel):
                upload.data[lo:hi].copy_(b.master[lo:hi])
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._h2d):
            if b.grads_ready is not None:
                self._h2d.wait_event(b.grads_ready)  # backward has finished reading the old weights
            start.record()
            for i, p in enumerate(b.params):
                _local(p).copy_(b.view(upload.data, i), non_blocking=True)
            done.record()
        upload.in_use = b.upload_event = done
        b.uploaded = b.version
        with self._lock:
            self._transfers.append(("h2d_s", start, done))

    def _upload_buffer(self) -> _UploadBuffer:
        """The next of two pinned upload buffers, once the copy that last read it has finished."""
        upload = self._uploads[self._next_upload]
        self._next_upload = (self._next_upload + 1) % len(self._uploads)
        if upload.in_use is not None:
            upload.in_use.synchronize()
        return upload

    # ----------------------------------------------------------------------------------------
    # Helpers

    def _wait(self, ready) -> None:
        with self._lock:
            while not ready():
                self._raise_if_failed()
                self._lock.wait(timeout=1.0)
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("offload: the CPU worker failed") from self._error

    def _count(self, key: str, value: float) -> None:
        with self._lock:
            self._stats[key] += value

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
