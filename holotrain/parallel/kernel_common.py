"""What the fused GEMMs' two cores share: the Triton kernels (overlap_kernels.py) and the warp-specialized Gluon one
(gluon_gemm.py).

Device side: the scalar helpers of a persistent GEMM over arriving data (tile order, spinning on a flag, the proxy
fence after it), written as Triton functions; gluon_gemm compiles the same source as Gluon (gluon.jit(fn.fn)), as
Gluon's own standard library does. Host side: the operand checks and buffers of a GEMM call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------------
# Device side


@triton.jit
def wait_at_least(ptr, target, spin_limit, err_ptr, code):
    """Spin until *ptr >= target (acquire, system scope); after spin_limit polls, record `code` and go on."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    n = 0
    while (v < target) & (n < spin_limit):
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        n += 1
    if v < target:
        tl.atomic_xchg(err_ptr, code)


@triton.jit
def tile_coords(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile t of one chunk in grouped order (GROUP_M row tiles sweep the columns together: L2 reuse)."""
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % rows_in_group
    pid_n = (t % per_group) // rows_in_group
    return pid_m, pid_n


@triton.jit
def proxy_fence(x):
    # Orders the generic-proxy acquire before the async-proxy (TMA) loads that follow it.
    return tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


# --------------------------------------------------------------------------------------------------------
# Host side


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 16-byte aligned start (TMA descriptors need it)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def output_buffer(t: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, device) -> torch.Tensor:
    """`t` checked as a GEMM's output (contiguous, 16-byte aligned, this shape and dtype), or a new tensor."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"fused TP: output must be a contiguous, 16-byte aligned {dtype} tensor of shape {shape}, "
                         f"got {t.dtype} {tuple(t.shape)}")
    return t


def check_operands(name: str, a: torch.Tensor, w: torch.Tensor, layout: str) -> tuple[int, int]:
    """(K, N) of a @ B, with w = B as [N, K] ("nk") or [K, N] ("kn"); raises on operands the kernels do not take."""
    if a.dtype not in (torch.bfloat16, torch.float16) or w.dtype != a.dtype:
        raise TypeError(f"fused {name}: bf16/fp16 operands of one dtype needed, got {a.dtype} and {w.dtype}")
    if a.ndim != 2 or w.ndim != 2:
        raise ValueError(f"fused {name}: 2-D operands needed, got {tuple(a.shape)} and {tuple(w.shape)}")
    K = a.shape[1]
    N, Kw = (w.shape[0], w.shape[1]) if layout == "nk" else (w.shape[1], w.shape[0])
    if Kw != K:
        raise ValueError(f"fused {name}: inner dimensions differ, a {tuple(a.shape)}, w {tuple(w.shape)} ({layout})")
    if K % 8 or N % 8:
        raise ValueError(f"fused {name}: K={K} and N={N} must be multiples of 8 (TMA needs 16-byte row strides)")
    return K, N
