"""The tiled byte transpose behind precision/transpose.py's op (CUDA only; imported on first use).

Each program loads a tile along the source's rows (contiguous, 16 bytes a thread) and stores it along the
destination's rows; Triton moves the tile through shared memory between the two layouts, so both sides of the copy
are whole cache lines. That move is a byte an element (compiled for sm_90: 64 one-byte shared-memory loads a thread
for a 128x128 tile), which bounds the kernel well below the memory's bandwidth (bench/RESULTS.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w)
             for bm, bn, w in ((64, 64, 4), (128, 128, 8), (128, 64, 4), (64, 128, 4), (256, 128, 8))],
    key=["M", "N"],
)
@triton.jit
def _transpose(src, dst, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tile = tl.load(src + rows[:, None].to(tl.int64) * N + cols[None, :],
                   mask=(rows[:, None] < M) & (cols[None, :] < N))
    tl.store(dst + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(tile),
             mask=(cols[:, None] < N) & (rows[None, :] < M))


def transpose_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst [N, M] = src [M, N]^T, both contiguous uint8."""
    m, n = src.shape
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    _transpose[grid](src, dst, m, n)
