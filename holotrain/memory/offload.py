"""ZeRO-Offload: fp32 master weights and AdamW states in host memory, working weights on the GPU, and the CPU
step overlapped with backward and with the next forward. Switched on by `memory.offload = true`; built by
`build_optimizer`, driven by `TrainStep` (begin_step before the micro-batches, finish_step after them).

A step, on one GPU:

  backward     A post-accumulate-grad hook counts each offloaded parameter's gradient. When a bucket (one unit
               of holotrain/memory/plan.py: the embedding, one block, or the final norm + output head) has all
               of its gradients, the GPU takes their squared norm (one landing per step; microseconds), then they
               are copied on a side stream ("D2H") into the bucket's pinned staging buffer, the norm after them,
               and freed on the GPU, so at most a few buckets' gradients exist on the GPU at a time.
  CPU worker   One thread. It *lands* each bucket (its copy is done: with one landing per step that is all,
               since the norm came with it; with accumulation it adds the micro-batch into an fp32 accumulator,
               and at the last one takes the sum's squared norm in the same pass), then *updates* it: AdamW on
               flat fp32 buffers in one pass that reads the gradient in its own dtype (bf16) and writes the new
               weights in the working dtype into an upload buffer as it goes. The loops are C compiled once per
               host (`cpu_kernels`, torch's fused AdamW math), called through ctypes once per bucket: the call
               releases the GIL and runs the bucket on `memory.offload_threads` native threads, so Python on the
               training thread never holds it up; without a C compiler, torch ops in chunks (three passes). The
               upload buffer is copied into the working weights on a second side stream ("H2D").
  order        Landings whose copy is done come first; then, among landed buckets, the update the next forward
               needs first; a landing still waiting for its copy only when there is nothing else (the host runs
               ahead of the GPU in backward and queues every copy early: waiting for each in turn would keep the
               updates until backward ends). During backward the update taken is that of the bucket that landed
               last; once backward ends it is the embedding, then block 0, block 1, ..., so the next forward
               starts as soon as its first bucket is back and the buckets left over are those it needs last.
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
import ctypes
import functools
import hashlib
import math
import os
import platform
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
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
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _advise_huge_pages(t: torch.Tensor) -> None:
    """Ask for 2 MiB pages for the whole 2 MiB-aligned interior of a fresh (untouched) host tensor. The optimizer
    streams tens of GB per step through masters and moments; with 4 KiB pages every 4 KiB is a TLB miss (THP in
    "madvise" mode, a common default, gives huge pages only where asked). A no-op where unsupported."""
    libc = _libc()
    nbytes = t.numel() * t.element_size()
    if libc is None or platform.system() != "Linux" or nbytes < 2 * _HUGE:
        return
    start = -(-t.data_ptr() // _HUGE) * _HUGE
    end = (t.data_ptr() + nbytes) // _HUGE * _HUGE
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_HUGEPAGE))


def _host_empty(numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """Host memory for the optimizer's state, on huge pages where the OS gives them (advised before first touch)."""
    t = torch.empty(numel, dtype=dtype)
    _advise_huge_pages(t)
    return t.zero_() if zero else t


def _pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory of exactly this size. torch's pinned allocator rounds each allocation up to a power
    of two (a 630 MB bucket would pin 1 GB); page-locking an ordinary allocation with cudaHostRegister does not.
    Falls back to torch's allocator if registering fails."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    span = -(-nbytes // _PAGE) * _PAGE
    raw = torch.empty(span + _PAGE, dtype=torch.uint8)
    _advise_huge_pages(raw)  # before cudaHostRegister faults the pages in
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


# --------------------------------------------------------------------------------------------
# The CPU step's loops

# One pass over memory per bucket: AdamW reads the gradient in its own dtype (bf16 from the staging buffer) and
# writes the new weights in the working dtype into the upload buffer as it goes, with torch's fused CPU AdamW
# math (the same float operations in the same order: bitwise equal to torch._fused_adamw_ where the two compile
# alike). torch ops would need three passes per chunk (bf16 -> fp32 scratch, AdamW, fp32 -> bf16), each a
# parallel region forked from the worker thread, which also has to take the GIL back between them. Compiled once
# per host with the system C compiler and called through ctypes, which releases the GIL for the call; the call
# runs the whole bucket on native threads (a pool of Python threads would each need the GIL back between slices).
_KERNEL_SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN -> quiet NaN, as c10::BFloat16 */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? (uint16_t)0x7FC0 : r;
}
#define LOAD_G16(x, i) bf16_to_f32((x)[i])
#define LOAD_G32(x, i) ((x)[i])
#define STORE_O0(o, i, val) (void)(o)
#define STORE_O16(o, i, val) (o)[i] = f32_to_bf16(val)
#define STORE_O32(o, i, val) (o)[i] = (val)

/* AdamW: the gradient divided by scale, decoupled weight decay (decay = 1 - lr * wd), exp_avg lerped towards the
   gradient by w1 = 1 - beta1 (as torch's vectorized lerp), c2 = 1 - beta2, step_size = lr / bias_correction1. */
#define ADAMW(NAME, GT, LOAD, OT, STORE)                                                                        \
  void NAME(float* restrict p, float* restrict m, float* restrict v, const GT* restrict g, OT* restrict out,    \
            int64_t n, float decay, float w1, int small, float b2, float c2, float step_size, float bc2_sqrt,    \
            float eps, float scale) {                                                                            \
    const float coeff = small ? w1 : w1 - 1.0f;                                                                  \
    for (int64_t i = 0; i < n; i++) {                                                                            \
      const float gi = LOAD(g, i) / scale;                                                                       \
      const float mi = fmaf(coeff, gi - m[i], small ? m[i] : gi);                                                \
      const float vi = fmaf(c2 * gi, gi, v[i] * b2);                                                             \
      const float pi = p[i] * decay - (step_size * mi) / (sqrtf(vi) / bc2_sqrt + eps);                           \
      m[i] = mi;                                                                                                 \
      v[i] = vi;                                                                                                 \
      p[i] = pi;                                                                                                 \
      STORE(out, i, pi);                                                                                         \
    }                                                                                                            \
  }
ADAMW(adamw_g16_o0, uint16_t, LOAD_G16, uint16_t, STORE_O0)
ADAMW(adamw_g16_o16, uint16_t, LOAD_G16, uint16_t, STORE_O16)
ADAMW(adamw_g16_o32, uint16_t, LOAD_G16, float, STORE_O32)
ADAMW(adamw_g32_o0, float, LOAD_G32, uint16_t, STORE_O0)
ADAMW(adamw_g32_o16, float, LOAD_G32, uint16_t, STORE_O16)
ADAMW(adamw_g32_o32, float, LOAD_G32, float, STORE_O32)

/* acc = s (first) or acc + s, in fp32; returns the sum of squares of the new acc (fp64, 16 partial sums). */
#define ACCUMULATE(NAME, ST, LOAD)                                                                              \
  double NAME(float* restrict acc, const ST* restrict s, int64_t n, int first) {                                \
    double part[16] = {0};                                                                                       \
    const int64_t nb = n - n % 16;                                                                               \
    int64_t i = 0;                                                                                               \
    if (first) {                                                                                                 \
      for (; i < nb; i += 16)                                                                                    \
        for (int j = 0; j < 16; j++) {                                                                           \
          const float x = LOAD(s, i + j);                                                                        \
          acc[i + j] = x;                                                                                        \
          part[j] += (double)x * x;                                                                              \
        }                                                                                                        \
    } else {                                                                                                     \
      for (; i < nb; i += 16)                                                                                    \
        for (int j = 0; j < 16; j++) {                                                                           \
          const float x = acc[i + j] + LOAD(s, i + j);                                                           \
          acc[i + j] = x;                                                                                        \
          part[j] += (double)x * x;                                                                              \
        }                                                                                                        \
    }                                                                                                            \
    for (; i < n; i++) {                                                                                         \
      const float x = first ? LOAD(s, i) : acc[i] + LOAD(s, i);                                                  \
      acc[i] = x;                                                                                                \
      part[0] += (double)x * x;                                                                                  \
    }                                                                                                            \
    double total = 0.0;                                                                                          \
    for (int j = 0; j < 16; j++) total += part[j];                                                               \
    return total;                                                                                                \
  }
ACCUMULATE(accumulate_g16, uint16_t, LOAD_G16)
ACCUMULATE(accumulate_g32, float, LOAD_G32)

/* The threaded drivers: one call per bucket runs it on `threads` native threads (the caller and threads - 1
   helpers), so the GIL is released once for the whole bucket rather than taken back by every slice: a training
   thread that runs Python all through backward no longer holds up the update. Blocks of BLOCK elements (a
   multiple of 64, cache-line aligned in every buffer) are handed out by an atomic counter, so a thread that
   loses its core delays only the block it holds. The accumulation's sums of squares are kept per block and added
   in block order: the same result whatever the thread count or timing. */
#define BLOCK ((int64_t)1 << 16)
typedef struct {
  int kind; /* 0..5: adamw_g{16,32}_o{0,16,32}; 6, 7: accumulate_g{16,32} */
  float *p, *m, *v;
  const void* g;
  void* out;
  int64_t n;
  float decay, w1, b2, c2, step_size, bc2_sqrt, eps, scale;
  int small, first;
  double* block_sq;
  int64_t next; /* the next block to take (atomic) */
} job_t;

static void run_block(job_t* j, int64_t b) {
  const int64_t lo = b * BLOCK, len = (j->n - lo < BLOCK) ? j->n - lo : BLOCK;
  const uint16_t* g16 = (const uint16_t*)j->g + lo;
  const float* g32 = (const float*)j->g + lo;
  float *p = j->p + lo, *m = j->m + lo, *v = j->v + lo;
#define ARGS len, j->decay, j->w1, j->small, j->b2, j->c2, j->step_size, j->bc2_sqrt, j->eps, j->scale
  switch (j->kind) {
    case 0: adamw_g16_o0(p, m, v, g16, (uint16_t*)j->out, ARGS); break;
    case 1: adamw_g16_o16(p, m, v, g16, (uint16_t*)j->out + lo, ARGS); break;
    case 2: adamw_g16_o32(p, m, v, g16, (float*)j->out + lo, ARGS); break;
    case 3: adamw_g32_o0(p, m, v, g32, (uint16_t*)j->out, ARGS); break;
    case 4: adamw_g32_o16(p, m, v, g32, (uint16_t*)j->out + lo, ARGS); break;
    case 5: adamw_g32_o32(p, m, v, g32, (float*)j->out + lo, ARGS); break;
    case 6: j->block_sq[b] = accumulate_g16(p, g16, len, j->first); break;
    default: j->block_sq[b] = accumulate_g32(p, g32, len, j->first); break;
  }
#undef ARGS
}

static void* drain(void* arg) {
  job_t* j = (job_t*)arg;
  const int64_t blocks = (j->n + BLOCK - 1) / BLOCK;
  for (;;) {
    const int64_t b = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
    if (b >= blocks) return NULL;
    run_block(j, b);
  }
}

/* Runs the job on up to `threads` threads: the caller drains blocks too, so the job completes even if no helper
   thread could be started. Returns 0. */
static int run_job(job_t* j, int threads) {
  const int64_t blocks = (j->n + BLOCK - 1) / BLOCK;
  if (threads > blocks) threads = (int)blocks;
  if (threads > 256) threads = 256;
  pthread_t helpers[256];
  int started = 0;
  j->next = 0;
  for (int t = 1; t < threads; t++) {
    if (pthread_create(&helpers[started], NULL, drain, j) == 0) started++;
  }
  drain(j);
  for (int t = 0; t < started; t++) pthread_join(helpers[t], NULL);
  return 0;
}

int adamw_mt(int kind, float* p, float* m, float* v, const void* g, void* out, int64_t n, float decay, float w1,
             int small, float b2, float c2, float step_size, float bc2_sqrt, float eps, float scale, int threads) {
  job_t j = {kind, p, m, v, g, out, n, decay, w1, b2, c2, step_size, bc2_sqrt, eps, scale, small, 0, NULL, 0};
  return run_job(&j, threads);
}

/* acc = s (first) or acc + s; *sq = the sum of squares of the new acc. Returns 0, or -1 if out of memory. */
int accumulate_mt(int kind, float* acc, const void* s, int64_t n, int first, int threads, double* sq) {
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  double* block_sq = (double*)calloc(blocks > 0 ? (size_t)blocks : 1, sizeof(double));
  if (block_sq == NULL) return -1;
  job_t j = {kind, acc, NULL, NULL, s, NULL, n, 0, 0, 0, 0, 0, 0, 0, 1.0f, 0, first, block_sq, 0};
  run_job(&j, threads);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; b++) total += block_sq[b];
  free(block_sq);
  *sq = total;
  return 0;
}
"""

_KERNEL_DTYPES = {torch.bfloat16: "16", torch.float32: "32"}


class CpuKernels:
    """The compiled loops (ctypes functions: they release the GIL while they run)."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib, self.path = lib, path
        f, p, i64 = ctypes.c_float, ctypes.c_void_p, ctypes.c_int64
        for g in ("16", "32"):
            for o in ("0", "16", "32"):
                fn = getattr(lib, f"adamw_g{g}_o{o}")
                fn.argtypes = [p, p, p, p, p, i64, f, f, ctypes.c_int, f, f, f, f, f, f]
                fn.restype = None
            fn = getattr(lib, f"accumulate_g{g}")
            fn.argtypes = [p, p, i64, ctypes.c_int]
            fn.restype = ctypes.c_double
        i = ctypes.c_int
        lib.adamw_mt.argtypes = [i, p, p, p, p, p, i64, f, f, i, f, f, f, f, f, f, i]
        lib.adamw_mt.restype = i
        lib.accumulate_mt.argtypes = [i, p, p, i64, i, i, ctypes.POINTER(ctypes.c_double)]
        lib.accumulate_mt.restype = i

    @staticmethod
    def adamw_kind(grad_dtype: torch.dtype, out_dtype: torch.dtype | None) -> int | None:
        """The C driver's index of adamw_g{16,32}_o{0,16,32}, or None for dtypes it does not take."""
        g, o = _KERNEL_DTYPES.get(grad_dtype), "0" if out_dtype is None else _KERNEL_DTYPES.get(out_dtype)
        return None if g is None or o is None else ("16", "32").index(g) * 3 + ("0", "16", "32").index(o)

    @staticmethod
    def accumulate_kind(src_dtype: torch.dtype) -> int | None:
        g = _KERNEL_DTYPES.get(src_dtype)
        return None if g is None else 6 + ("16", "32").index(g)


def _kernel_cache_dir() -> str:
    base = os.environ.get("HOLOTRAIN_CACHE") or os.path.join(  # the same cache as the corpus and tokenizer
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "holotrain")
    try:
        os.makedirs(base, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return tempfile.gettempdir()


def _cpu_signature() -> str:
    """The host CPU's model and flags: -march=native code is only valid on the CPU it was built for."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compile_kernels() -> CpuKernels:
    import shutil

    cc = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
    if cc is None:
        raise RuntimeError("no C compiler (CC, cc, gcc or clang) on PATH")
    # -march=native first; if the compiler does not know this CPU, the x86 vector and FMA extensions it reports
    # (without FMA in hardware fmaf would be a library call per element: torch ops are faster then).
    attempts = [["-O3", "-march=native"]]
    machine, signature = platform.machine().lower(), _cpu_signature()
    if machine in ("x86_64", "amd64"):
        flags = set(" ".join(ln.split(":", 1)[-1] for ln in signature.splitlines() if ln.startswith("flags")).split())
        if {"avx2", "fma"} <= flags:
            attempts.append(["-O3", "-mavx2", "-mfma"])
    else:
        attempts.append(["-O3"])
    common = ["-std=gnu11", "-pthread", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
    errors = []
    for flags in attempts:
        key = hashlib.sha256("\0".join([_KERNEL_SOURCE, cc, *flags, *common, machine, signature]).encode()).hexdigest()[:20]
        path = os.path.join(_kernel_cache_dir(), f"holotrain_offload_{key}.so")
        if not os.path.isfile(path):
            with tempfile.TemporaryDirectory() as tmp:
                src, tmp_so = os.path.join(tmp, "kernels.c"), os.path.join(tmp, "kernels.so")
                with open(src, "w") as f:
                    f.write(_KERNEL_SOURCE)
                proc = subprocess.run([cc, *flags, *common, src, "-o", tmp_so, "-lm", "-lpthread"],
                                      capture_output=True, text=True, timeout=120, check=False)
                if proc.returncode != 0:
                    errors.append(f"{cc} {' '.join(flags)}: {proc.stderr.strip()[-300:]}")
                    continue
                staged = f"{path}.{os.getpid()}.{threading.get_ident()}"
                with open(tmp_so, "rb") as fin, open(staged, "wb") as fout:
                    fout.write(fin.read())
                os.replace(staged, path)  # atomic: ranks compiling at once each install a complete file
        kernels = CpuKernels(ctypes.CDLL(path), path)
        _self_test(kernels)
        return kernels
    raise RuntimeError("; ".join(errors) or "no compiler flags worked")


def _self_test(kernels: CpuKernels) -> None:
    """The compiled AdamW against torch's fused CPU AdamW (clipped, on a ragged length), and the accumulation."""
    gen = torch.Generator().manual_seed(0)
    n = 1000 + 13
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
    ref = [p.clone(), m.clone(), v.clone()]
    torch._fused_adamw_([ref[0]], [g.float()], [ref[1]], [ref[2]], [], [torch.tensor(3.0)], lr=1e-3, beta1=0.9,
                        beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
                        grad_scale=torch.tensor(2.0), found_inf=None)
    out = torch.empty(n, dtype=torch.bfloat16)
    adamw_flat(p, m, v, g, out, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, t=3, scale=2.0,
               kernels=kernels)
    for got, want in zip((p, m, v), ref):
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-7):
            raise RuntimeError("the compiled AdamW disagrees with torch._fused_adamw_")
    if not torch.equal(out, p.to(torch.bfloat16)):
        raise RuntimeError("the compiled bf16 rounding disagrees with torch")
    acc = torch.randn(n, generator=gen)
    want = acc + g.float()
    sq = accumulate_flat(acc, g, first=False, kernels=kernels)
    if not torch.equal(acc, want) or not math.isclose(sq, want.double().square().sum().item(), rel_tol=1e-9):
        raise RuntimeError("the compiled accumulation disagrees with torch")


_kernels_lock = threading.Lock()
_kernels_state: list = []  # [CpuKernels | None] once tried


def cpu_kernels() -> CpuKernels | None:
    """The compiled loops, or None (HOLOTRAIN_OFFLOAD_KERNEL=torch, or no working C compiler: torch ops then, with a
    warning). Compiled once per process (a cached shared library per host and source after the first)."""
    with _kernels_lock:
        if not _kernels_state:
            kernels = None
            if os.environ.get("HOLOTRAIN_OFFLOAD_KERNEL", "c") != "torch":
                try:
                    kernels = _compile_kernels()
                except Exception as e:  # noqa: BLE001 - any failure means the torch-op path
                    warnings.warn(f"offload: the compiled CPU step is unavailable ({str(e)[:300]}); using torch ops, "
                                  "which make more passes over host memory", stacklevel=2)
            _kernels_state.append(kernels)
        return _kernels_state[0]


def _ptr(t: torch.Tensor | None, lo: int):
    return None if t is None else t.data_ptr() + lo * t.element_size()


def adamw_flat(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
               out: torch.Tensor | None, *, lr: float, betas: tuple[float, float], weight_decay: float, eps: float,
               t: int, scale: float = 1.0, kernels: CpuKernels | None = None, threads: int = 1,
               scratch: torch.Tensor | None = None) -> None:
    """One AdamW step (torch's fused math) of flat contiguous fp32 buffers, the gradient (fp32 or bf16) divided by
    `scale`; with `out`, also writes the new weights in out's dtype. The compiled loop in one pass on `threads`
    native threads when `kernels` has it (the GIL released once for the whole call), else torch ops chunk by chunk
    (gradient -> fp32 scratch, fused AdamW, weights -> out)."""
    b1, b2 = betas
    kind = kernels.adamw_kind(grad.dtype, None if out is None else out.dtype) if kernels is not None else None
    if kind is not None:
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        w1 = 1 - b1
        small = int(abs(struct.unpack("f", struct.pack("f", w1))[0]) < 0.5)  # w1 as the float32 the loop uses
        kernels.lib.adamw_mt(kind, _ptr(master, 0), _ptr(exp_avg, 0), _ptr(exp_avg_sq, 0), _ptr(grad, 0),
                             _ptr(out, 0), master.numel(), 1 - lr * weight_decay, w1, small, b2, 1 - b2, lr / bc1,
                             math.sqrt(bc2), eps, scale, max(1, threads))
        return
    n = master.numel()
    if scratch is None and grad.dtype != torch.float32:
        scratch = torch.empty(min(CHUNK, n), dtype=torch.float32)
    grad_scale = None if scale == 1.0 else torch.tensor(scale, dtype=torch.float32)
    step = torch.tensor(float(t))
    for lo, hi in _chunks(n):
        g = grad[lo:hi]
        if g.dtype != torch.float32:
            g = scratch[:hi - lo].copy_(g)
        torch._fused_adamw_(
            [master[lo:hi]], [g], [exp_avg[lo:hi]], [exp_avg_sq[lo:hi]], [], [step], lr=lr, beta1=b1, beta2=b2,
            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None,
        )
        if out is not None:
            out[lo:hi].copy_(master[lo:hi])


def accumulate_flat(acc: torch.Tensor, src: torch.Tensor, first: bool, *, kernels: CpuKernels | None = None,
                    threads: int = 1, scratch: torch.Tensor | None = None, want_sq: bool = True) -> float:
    """acc = src (first) or acc + src (fp32; src fp32 or bf16), in one pass; returns the new acc's sum of squares
    (0.0 without want_sq on the torch-op path)."""
    kind = kernels.accumulate_kind(src.dtype) if kernels is not None else None
    if kind is not None:
        sq = ctypes.c_double(0.0)
        if kernels.lib.accumulate_mt(kind, _ptr(acc, 0), _ptr(src, 0), acc.numel(), int(first), max(1, threads),
                                     ctypes.byref(sq)) != 0:
            raise MemoryError("offload: the accumulation could not allocate its per-block sums")
        return sq.value
    n = acc.numel()
    if scratch is None and src.dtype != torch.float32:
        scratch = torch.empty(min(CHUNK, n), dtype=torch.float32)
    dots = []
    for lo, hi in _chunks(n):
        s = src[lo:hi]
        if s.dtype != torch.float32:  # into the scratch: a mixed-dtype add would allocate a temporary per chunk
            s = scratch[:hi - lo].copy_(s)
        a = acc[lo:hi]
        a.copy_(s) if first else a.add_(s)
        if want_sq:
            dots.append(torch.dot(a, a))  # parallel, unlike vector_norm's CPU reduction
    return math.fsum(d.item() for d in dots) if dots else 0.0


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' summed squared L2 norm as an fp64 scalar on their device (each norm taken in fp32)."""
    try:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    except (TypeError, RuntimeError):
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    return torch.stack(norms).double().square().sum()


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
        self.master = _host_empty(offset, torch.float32)
        self.exp_avg = _host_empty(offset, torch.float32, zero=True)
        self.exp_avg_sq = _host_empty(offset, torch.float32, zero=True)
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
        # The squared norm of this step's gradient, taken on the device before the copy (one landing per step):
        # a pinned fp64 slot the D2H stream writes after the gradient (on the CPU device, the norm tensor itself).
        self.sq_host = torch.zeros(1, dtype=torch.float64, pin_memory=True) if pin else None
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
        self._waited = 0.0  # worker only: seconds blocked on copies so far
        self._transfers: list[tuple[str, object, object]] = []
        if self.cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
            biggest = max((b.numel for b in self.buckets), default=0)
            self._uploads = [_UploadBuffer(biggest, self.working_dtype) for _ in range(2)] if biggest else []
            self._next_upload = 0
        self._scratch = torch.empty(min(CHUNK, max((b.numel for b in self.buckets), default=0)), dtype=torch.float32)
        self._scratch2 = torch.empty_like(self._scratch)
        # The update and accumulation loops: compiled (one pass, GIL released) unless unavailable; `kernel` says
        # which, for the metrics' readers.
        self._kernels = cpu_kernels()
        self.kernel = "c" if self._kernels is not None else "torch"

        self._handles = []
        for b in self.buckets:
            for p in b.params:
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, b)))
        self._install_gates()
        # A shorter GIL switch interval while the engine runs: each time the worker needs the GIL back (after an
        # update, around each copy it queues) it waits at most this long for the training thread to yield it.
        self._switch_interval = None
        if mem.offload_gil_switch_ms > 0:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, mem.offload_gil_switch_ms / 1000.0))
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
        if not all(b.step is step for b in self.buckets):  # TrainStep waits first, timing it as exposed time
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
        }

    def close(self) -> None:
        """Lets the worker finish what it can and stops it (also at interpreter exit)."""
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
        # One landing per step: the bucket's squared norm is taken here, on the device (a read of the gradient
        # that the GPU does in microseconds), so the host never makes a pass over it. With accumulation the norm is
        # that of the sum, taken on the host while it adds the last micro-batch.
        sq = _squared_norm(grads) if step.landings == 1 else None
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
                for b in self.buckets:  # forward order
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

    def _land(self, b: _Bucket, step: _Step, m: int, copied) -> None:
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
        t0 = time.perf_counter()
        adamw_flat(b.master, b.exp_avg, b.exp_avg_sq, b.grad, None if upload is None else upload.data[:b.numel],
                   lr=step.lr, betas=self.betas, weight_decay=self.weight_decay, eps=self.eps, t=step.t, scale=scale,
                   kernels=self._kernels, threads=self.threads, scratch=self._scratch)
        self._count("adamw_s", time.perf_counter() - t0)
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
        self._sync(upload.in_use)
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
