"""The offload engine's CPU worker: one thread that lands gradients on the host, updates the masters (AdamW,
speculative or final, with rollbacks) and uploads the new weights, in the order the next forward needs them.

`CpuWorker` is a mixin of OffloadEngine (engine.py), which sets up what it reads: `buckets` (forward order),
`hyper` (AdamWHyper), `threads`, `cuda`, `device`, `_kernels`, `_scratch`, `_scratch2`, and on a GPU the `_h2d`
stream and the two `_uploads` buffers. The state the two threads share is created here (`_init_worker`) and
guarded by `_lock`, a condition variable that every change notifies.
"""

from __future__ import annotations

import collections
import math
import threading
import time

import torch

from holotrain.memory.offload.buckets import FINAL, LANDED, SPECULATED, Bucket, Step, UploadBuffer, local
from holotrain.memory.offload.kernels import accumulate_flat, adamw_flat, chunks
from holotrain.memory.offload.state import leave_held


class CpuWorker:
    def _init_worker(self) -> None:
        self._lock = threading.Condition()
        self._arrivals: collections.deque = collections.deque()  # (bucket, step, micro-batch, copy event)
        self._error: BaseException | None = None
        self._stop = False
        self._stats = collections.Counter()
        self._waited = 0.0  # worker only: seconds blocked on copies so far
        self._transfers: list[tuple[str, object, object]] = []  # (stat, start event, end event) of copies
        self._thread = threading.Thread(target=self._work, name="holotrain-offload", daemon=True)

    def _work(self) -> None:
        try:
            torch.set_num_threads(self.threads)  # this thread's intra-op pool only
            if self.cuda:
                torch.cuda.set_device(self.device)
            with torch.no_grad():
                while (task := self._next_task()) is not None:
                    kind, item = task
                    t0, waited = time.perf_counter(), self._waited
                    if kind == "land":
                        self._land(*item)
                    else:
                        self._update(item)
                    # Time blocked on copies (a gradient still on its way, an upload buffer still being read) is
                    # counted apart: it is the GPU's pace, not CPU work.
                    waited = self._waited - waited
                    with self._lock:
                        self._stats["land_s" if kind == "land" else "cpu_s"] += time.perf_counter() - t0 - waited
                        self._stats["copy_wait_s"] += waited
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def _next_task(self):
        """Landings whose copies are done first (they free staging buffers and bring the norm closer), then the
        update the next forward needs first, and only when there is nothing else, a landing whose copy is still
        on its way. Backward queues its copies well ahead of the GPU (the host runs ahead), so waiting for each
        in turn would leave every update until backward ends. None: stopped and nothing left that can run."""
        with self._lock:
            while True:
                if self._arrivals and self._arrived(self._arrivals[0]):
                    return "land", self._arrivals.popleft()
                # Forward order; delayed, backward's (the next backward releases the last bucket first).
                for b in (reversed(self.buckets) if self.delayed else self.buckets):
                    step = b.step
                    if (b.state == LANDED and (step.speculate or step.decision is not None)) or (
                            b.state == SPECULATED and step.decision is not None):
                        return "update", b
                if self._arrivals:
                    return "land", self._arrivals.popleft()  # copies finish in order: the oldest one first
                if self._stop:
                    return None
                self._lock.wait()

    @staticmethod
    def _arrived(arrival) -> bool:
        copied = arrival[3]
        return copied is None or copied.query()

    def _sync(self, event) -> None:
        """Waits for a CUDA event, the wait counted as copy_wait_s."""
        if event is None or event.query():
            return
        t0 = time.perf_counter()
        event.synchronize()
        self._waited += time.perf_counter() - t0

    def _land(self, b: Bucket, step: Step, m: int, copied) -> None:
        self._sync(copied)
        if step.landings == 1:
            grad = b.staging
            sq = float(b.sq_host.item())  # taken on the device; copied after the gradient
        else:
            # Micro-batches add up in fp32, one pass each; the last one also takes the sum's squared norm.
            last = m == step.landings - 1
            sq = accumulate_flat(b.acc, b.staging, m == 0, kernels=self._kernels, threads=self.threads,
                                 scratch=self._scratch, want_sq=last)
            grad = b.acc
            with self._lock:
                b.staging_free = True
                self._lock.notify_all()
            if not last:
                return
        with self._lock:
            b.grad, b.sq_norm, b.step, b.speculated = grad, sq, step, False
            b.state = LANDED
            self._lock.notify_all()

    def _update(self, b: Bucket) -> None:
        if self.delayed:
            self._update_delayed(b)
            return
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

    def _update_delayed(self, b: Bucket) -> None:
        """Delayed update: the step's final update (the norm is known), the new weights written over the gradient
        in the staging buffer as it goes; the next backward uploads them (engine._upload_staged). A skipped step
        leaves the working weights as they are."""
        step = b.step
        if not step.decision.skip:
            self._adamw(b, step, step.decision.scale, to_upload=False, out=b.staging)
        with self._lock:
            b.state = FINAL
            b.pending_upload = not step.decision.skip
            b.staging_free = True
            self._lock.notify_all()

    def _adamw(self, b: Bucket, step: Step, scale: float, to_upload: bool,
               out: torch.Tensor | None = None) -> UploadBuffer | None:
        """One AdamW step of the bucket's masters, gradient divided by `scale`. With to_upload (on a GPU), also
        writes the new weights in the working dtype into an upload buffer as it goes, and returns it; with `out`,
        into `out` (which may be the gradient's own buffer: each value is read before it is written)."""
        upload = self._upload_buffer() if (to_upload and self.cuda) else None
        if upload is not None:
            out = upload.data[:b.numel]
        hyper = self.hyper
        t0 = time.perf_counter()
        source = leave_held(self, b, step)  # a checkpoint reads the current set: write the spare one
        adamw_flat(b.master, b.exp_avg, b.exp_avg_sq, b.grad, out,
                   lr=step.lr, betas=hyper.betas, weight_decay=hyper.weight_decay, eps=hyper.eps, t=step.t,
                   scale=scale, kernels=self._kernels, threads=self.threads, scratch=self._scratch, source=source)
        self._count("adamw_s", time.perf_counter() - t0)
        b.version += 1
        return upload

    def _rollback(self, b: Bucket, step: Step) -> None:
        """Undoes this step's unclipped AdamW update of the bucket, given the same gradient:
        p = (p' + lr/bc1 * m' / (sqrt(v')/sqrt(bc2) + eps)) / (1 - lr*wd), m = (m' - (1-b1) g) / b1,
        v = (v' - (1-b2) g^2) / b2."""
        b1, b2 = self.hyper.betas
        eps = self.hyper.eps
        step_size = step.lr / (1 - b1 ** step.t)
        bc2_sqrt = math.sqrt(1 - b2 ** step.t)
        decay = 1 - step.lr * self.hyper.weight_decay
        for lo, hi in chunks(b.numel):
            p, m, v = b.master[lo:hi], b.exp_avg[lo:hi], b.exp_avg_sq[lo:hi]
            g = b.grad[lo:hi]
            if g.dtype != torch.float32:
                g = self._scratch[:hi - lo].copy_(g)
            denom = torch.sqrt(v, out=self._scratch2[:hi - lo]).div_(bc2_sqrt).add_(eps)
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

    def _upload(self, b: Bucket, upload: UploadBuffer | None = None) -> None:
        """Masters -> working weights (through a pinned upload buffer and the H2D stream on a GPU)."""
        if not self.cuda:
            self._to_working(b, b.master)
        else:
            if upload is None:
                upload = self._upload_buffer()
                for lo, hi in chunks(b.numel):
                    upload.data[lo:hi].copy_(b.master[lo:hi])
            upload.in_use = self._to_working(b, upload.data)
        b.uploaded = b.version

    def _to_working(self, b: Bucket, flat: torch.Tensor):
        """The bucket's working weights = flat (host; pinned, in the working dtype, on a GPU). On a GPU the copy runs
        on the H2D stream once backward has finished reading the old weights; returns its end event (None on the
        CPU, where the copy is done)."""
        if not self.cuda:
            for i, p in enumerate(b.params):
                local(p).copy_(b.view(flat, i))
            return None
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._h2d):
            if b.grads_ready is not None:
                self._h2d.wait_event(b.grads_ready)
            start.record()
            for i, p in enumerate(b.params):
                local(p).copy_(b.view(flat, i), non_blocking=True)
            done.record()
        b.upload_event = done
        with self._lock:
            self._transfers.append(("h2d_s", start, done))
        return done

    def _upload_buffer(self) -> UploadBuffer:
        """The next of two pinned upload buffers, once the copy that last read it has finished."""
        upload = self._uploads[self._next_upload]
        self._next_upload = (self._next_upload + 1) % len(self._uploads)
        self._sync(upload.in_use)
        return upload

    # ----------------------------------------------------------------------------------------
    # Shared by both threads

    def _wait(self, ready) -> None:
        """Blocks until ready() (evaluated under the lock), raising the worker's error if it failed meanwhile."""
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
