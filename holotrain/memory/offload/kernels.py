"""The CPU step's loops: AdamW and the gradient accumulation on flat host buffers.

Two implementations behind `adamw_flat` and `accumulate_flat`. The compiled one (csrc/adamw.cpp, a torch C++
extension built on first use) makes one pass over memory per bucket on native threads, with the GIL released for
the whole call. The torch-op one works chunk by chunk (three passes per AdamW chunk); it is what runs where the
extension cannot be built, or with memory.offload_kernel = "torch".

The extension is built with -march=native, so each CPU gets its own build: the build's name (and directory, under
torch's extensions root) carries a hash of the CPU's model and flags, the compiler flags, the torch and Python
versions and the source (path and text). torch's file lock in that directory lets one of several ranks build
while the others wait; a later process finds the build done and only loads it. The build, and a check of its
results against torch's fused AdamW, happen once per process, at the first use.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import torch

from holotrain.errors import ConfigError

CHUNK = 1 << 22  # elements per torch-op AdamW call: a chunk's gradient scratch (16 MB fp32) stays in cache
SOURCE = Path(__file__).resolve().parent / "csrc" / "adamw.cpp"
KERNEL_CHOICES = ("auto", "native", "torch")
_DTYPES = (torch.bfloat16, torch.float32)  # what the compiled loops take, for gradients and outputs


def chunks(n: int):
    for lo in range(0, n, CHUNK):
        yield lo, min(n, lo + CHUNK)


class CpuKernels:
    """The built extension. Its functions release the GIL for the whole call and run it on native threads."""

    def __init__(self, module, flags: list[str]):
        self.module, self.flags = module, flags
        self.path = getattr(module, "__file__", None)

    @staticmethod
    def takes(*dtypes: torch.dtype | None) -> bool:
        """Whether the compiled loops take tensors of these dtypes (None: no output tensor)."""
        return all(d is None or d in _DTYPES for d in dtypes)


# --------------------------------------------------------------------------------------------
# Building


class KernelUnavailable(RuntimeError):
    """The extension cannot be built or loaded here; the message says why, in one line."""


def _cpu_signature() -> str:
    """The host CPU's model and flags: -march=native code is only valid on the CPU it was built for."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _flag_attempts(machine: str, signature: str) -> list[list[str]]:
    """-march=native first; if the compiler does not know this CPU, the x86 vector and FMA extensions it reports
    (without FMA in hardware fmaf would be a library call per element: torch ops are faster then), or plain -O3
    elsewhere."""
    attempts = [["-O3", "-march=native"]]
    if machine in ("x86_64", "amd64"):
        flags = set(" ".join(ln.split(":", 1)[-1] for ln in signature.splitlines() if ln.startswith("flags")).split())
        if {"avx2", "fma"} <= flags:
            attempts.append(["-O3", "-mavx2", "-mfma"])
    else:
        attempts.append(["-O3"])
    return attempts


# The float arithmetic must stay as written: no contraction into FMAs beyond the explicit fmaf calls (torch's
# fused AdamW compiles the same way); sqrtf without errno so that it vectorizes.
_COMMON_CFLAGS = ["-ffp-contract=off", "-fno-math-errno", "-pthread"]


def _build_root() -> str:
    """torch's extensions root (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), where the build persists
    across runs and test sessions; a temporary directory if that is not writable."""
    from torch.utils.cpp_extension import get_default_build_root

    torch_root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    for root in (torch_root, os.path.join(tempfile.gettempdir(), "torch_extensions")):
        try:
            os.makedirs(root, exist_ok=True)
            if os.access(root, os.W_OK):
                return root
        except OSError:
            pass
    raise KernelUnavailable("no writable directory for the build (set TORCH_EXTENSIONS_DIR)")


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage().splitlines()[0] if record.getMessage() else "")


@contextlib.contextmanager
def _quiet_build():
    """torch's build logs its complaints (an unusual compiler, a failed version check, with a traceback); they are
    kept for the one-line reason of a failed build instead of printed."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    handler, propagate = _Collect(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _one_line(text: str, limit: int = 300) -> str:
    """The last `limit` characters of an error, on one line (a compiler's complaint is at its end)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else "..." + text[-limit:]


def _build_error(message: str, logged: list[str]) -> str:
    """A failed build in one line: the compiler's first error if it reported one, else what torch said."""
    errors = [ln.strip() for ln in message.splitlines() if "error" in ln.lower() and "error building" not in ln.lower()]
    return _one_line(errors[0] if errors else " ".join([*logged, message]))


def _build() -> CpuKernels:
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler ({compiler!r} is not on PATH; set CXX)")
    if not cpp_extension.is_ninja_available():
        raise KernelUnavailable("ninja is not installed (pip install ninja)")
    machine, signature = platform.machine().lower(), _cpu_signature()
    root = _build_root()
    source_text = SOURCE.read_text()
    errors = []
    for flags in _flag_attempts(machine, signature):
        cflags = [*flags, *_COMMON_CFLAGS]
        # The source's path and text too: checkouts on one host do not rebuild over each other's build.
        key = hashlib.sha256("\0".join([machine, signature, compiler, torch.__version__, sys.version, *cflags,
                                        str(SOURCE), source_text]).encode()).hexdigest()[:12]
        name = f"holotrain_offload_{key}"
        build_dir = os.path.join(root, name)
        with _quiet_build() as logged:
            try:
                os.makedirs(build_dir, exist_ok=True)
                module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=cflags,
                                            extra_ldflags=["-pthread"], build_directory=build_dir, verbose=False)
            except Exception as e:  # noqa: BLE001 - a failed build: the next flags, or the reason
                errors.append(f"{' '.join(flags)}: {_build_error(str(e), logged)}")
                continue
        return CpuKernels(module, cflags)
    raise KernelUnavailable("; ".join(errors) or "no compiler flags worked")


def _self_check(kernels: CpuKernels) -> None:
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
            raise KernelUnavailable("the compiled AdamW disagrees with torch._fused_adamw_")
    if not torch.equal(out, p.to(torch.bfloat16)):
        raise KernelUnavailable("the compiled bf16 rounding disagrees with torch")
    source = [t.clone() for t in ref]
    moved = [torch.empty(n) for _ in range(3)]
    adamw_flat(*moved, g, None, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, t=4, kernels=kernels,
               source=source)
    adamw_flat(*ref, g, None, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, t=4, kernels=kernels)
    if not all(torch.equal(a, b) for a, b in zip(moved, ref)):
        raise KernelUnavailable("the compiled AdamW out of place disagrees with in place")
    acc = torch.randn(n, generator=gen)
    want = acc + g.float()
    sq = accumulate_flat(acc, g, first=False, kernels=kernels)
    if not torch.equal(acc, want) or not math.isclose(sq, want.double().square().sum().item(), rel_tol=1e-9):
        raise KernelUnavailable("the compiled accumulation disagrees with torch")


_lock = threading.Lock()
_loaded: list = []  # [(CpuKernels | None, reason | None)] once tried in this process
_warned = False


def _load() -> tuple[CpuKernels | None, str | None]:
    with _lock:
        if not _loaded:
            try:
                kernels = _build()
                _self_check(kernels)
                _loaded.append((kernels, None))
            except Exception as e:  # noqa: BLE001 - any failure means the torch-op path (or the user's error)
                _loaded.append((None, _one_line(e, 600)))
        return _loaded[0]


def cpu_kernels(choice: str = "auto") -> CpuKernels | None:
    """The compiled loops for memory.offload_kernel = `choice`, or None for the torch-op path. "auto": the
    extension, or None with one warning line if it cannot be built here; "native": the extension, or a
    ConfigError saying why not; "torch": None. Built and checked once per process, at the first call."""
    global _warned
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"memory.offload_kernel must be auto, native or torch, got {choice!r}")
    if choice == "torch":
        return None
    kernels, reason = _load()
    if kernels is not None:
        return kernels
    if choice == "native":
        raise ConfigError(f"memory.offload_kernel = 'native', but the compiled CPU step is unavailable: {reason} "
                          "(set memory.offload_kernel = 'torch' to use torch ops)")
    with _lock:
        if not _warned:
            _warned = True
            print(f"holotrain: warning: offload: the compiled CPU step is unavailable ({reason}); using torch ops, "
                  "which make more passes over host memory (memory.offload_kernel)", file=sys.stderr, flush=True)
    return None


# --------------------------------------------------------------------------------------------
# The loops


def adamw_flat(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
               out: torch.Tensor | None, *, lr: float, betas: tuple[float, float], weight_decay: float, eps: float,
               t: int, scale: float = 1.0, kernels: CpuKernels | None = None, threads: int = 1,
               scratch: torch.Tensor | None = None, source: tuple[torch.Tensor, ...] | None = None) -> None:
    """One AdamW step (torch's fused math) of flat contiguous fp32 buffers, the gradient (fp32 or bf16) divided by
    `scale`; with `out`, also writes the new weights in out's dtype. With `source` (master, exp_avg, exp_avg_sq),
    the old state is read from there and the source is left as it was (out of place). The compiled loop in one pass
    on `threads` native threads when `kernels` is given (the GIL released once for the whole call), else torch ops
    chunk by chunk (gradient -> fp32 scratch, fused AdamW, weights -> out)."""
    b1, b2 = betas
    if kernels is not None and kernels.takes(grad.dtype, None if out is None else out.dtype):
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        kernels.module.adamw(master, exp_avg, exp_avg_sq, grad, out, None if source is None else list(source),
                             decay=1 - lr * weight_decay, w1=1 - b1, b2=b2,
                             c2=1 - b2, step_size=lr / bc1, bc2_sqrt=math.sqrt(bc2), eps=eps, scale=scale,
                             threads=max(1, threads))
        return
    n = master.numel()
    grad_scale = None if scale == 1.0 else torch.tensor(scale, dtype=torch.float32)
    # The fused op unscales its gradient in place: a scaled one goes through the scratch, so `grad` stays as it is.
    via_scratch = grad.dtype != torch.float32 or grad_scale is not None
    if scratch is None and via_scratch:
        scratch = torch.empty(min(CHUNK, n), dtype=torch.float32)
    step = torch.tensor(float(t))
    for lo, hi in chunks(n):
        if source is not None:
            for dst, src in zip((master, exp_avg, exp_avg_sq), source):
                dst[lo:hi].copy_(src[lo:hi])
        g = grad[lo:hi]
        if via_scratch:
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
    if kernels is not None and kernels.takes(src.dtype):
        return kernels.module.accumulate(acc, src, first, max(1, threads))
    n = acc.numel()
    if scratch is None and src.dtype != torch.float32:
        scratch = torch.empty(min(CHUNK, n), dtype=torch.float32)
    dots = []
    for lo, hi in chunks(n):
        s = src[lo:hi]
        if s.dtype != torch.float32:  # into the scratch: a mixed-dtype add would allocate a temporary per chunk
            s = scratch[:hi - lo].copy_(s)
        a = acc[lo:hi]
        a.copy_(s) if first else a.add_(s)
        if want_sq:
            dots.append(torch.dot(a, a))  # parallel, unlike vector_norm's CPU reduction
    return math.fsum(d.item() for d in dots) if dots else 0.0
