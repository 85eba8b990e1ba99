"""The tiled byte transpose behind precision/transpose.py's op (CUDA only; imported on first use).

Each program transposes one BLOCK_M x BLOCK_N tile of bytes, loading along the source's rows and storing along the
destination's, 16 bytes a thread on both sides. Two ways, chosen per shape by timing on first use:
  bytes  Triton moves the tile between the two layouts through shared memory a byte at a time (64 one-byte
         shared-memory loads a thread for a 128x128 tile, compiled for sm_90): those instructions bound it.
  words  the tile is read as four int32 tiles, rows 4i+0..3, and each destination word (four bytes of one source
         column, from four consecutive rows) is assembled inside a thread by shifts and masks; only 32-bit words
         cross shared memory. Needs both sizes and the pointers divisible by 4.
DIAGONAL walks the tiles in diagonal order, so that the programs running together spread over the memory's
partitions when rows are powers of two apart (the 1.4b's widths are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


_BYTE_TILES = ((64, 64, 4), (128, 128, 8), (128, 64, 4), (64, 128, 4), (256, 128, 8))
_WORD_TILES = ((128, 128, 4), (256, 128, 8), (128, 256, 8), (256, 256, 8))
_BYTES = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WORDS": False, "DIAGONAL": False}, num_warps=w)
          for bm, bn, w in _BYTE_TILES]
_WORDS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WORDS": True, "DIAGONAL": d}, num_warps=w)
          for bm, bn, w in _WORD_TILES for d in (False, True)]


@triton.jit
def _transpose(src, dst, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
               DIAGONAL: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DIAGONAL:
        pid_n = (pid_n + pid_m) % tl.num_programs(1)
    if WORDS:
        _transpose_words(src, dst, M, N, pid_m, pid_n, BLOCK_M, BLOCK_N)
    else:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tile = tl.load(src + rows[:, None].to(tl.int64) * N + cols[None, :],
                       mask=(rows[:, None] < M) & (cols[None, :] < N))
        tl.store(dst + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(tile),
                 mask=(cols[:, None] < N) & (rows[None, :] < M))


@triton.jit
def _byte(word, k: tl.constexpr):
    return (word >> (8 * k)) & 0xFF


@triton.jit
def _transpose_words(src, dst, M, N, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Source as int32 [M, N/4], destination as int32 [N, M/4]. quad i of the tile is source rows 4i..4i+3;
    # word column j is source bytes 4j..4j+3 of a row.
    src_w = src.to(tl.pointer_type(tl.int32))
    dst_w = dst.to(tl.pointer_type(tl.int32))
    n_w, m_w = N // 4, M // 4
    quads = pid_m * (BLOCK_M // 4) + tl.arange(0, BLOCK_M // 4)
    wcols = pid_n * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)
    inside = (quads[:, None] < m_w) & (wcols[None, :] < n_w)
    at = (quads[:, None].to(tl.int64) * 4) * n_w + wcols[None, :]
    r0 = tl.load(src_w + at, mask=inside)
    r1 = tl.load(src_w + at + n_w, mask=inside)
    r2 = tl.load(src_w + at + 2 * n_w, mask=inside)
    r3 = tl.load(src_w + at + 3 * n_w, mask=inside)
    # Destination row 4j+k, word i: byte k of source rows 4i..4i+3 at word column j.
    out_at = (wcols[:, None].to(tl.int64) * 4) * m_w + quads[None, :]
    out_inside = (wcols[:, None] < n_w) & (quads[None, :] < m_w)
    for k in tl.static_range(4):
        word = _byte(r0, k) | (_byte(r1, k) << 8) | (_byte(r2, k) << 16) | (_byte(r3, k) << 24)
        tl.store(dst_w + out_at + k * m_w, tl.trans(word), mask=out_inside)


# Two tuners over one kernel: the word way only where its int32 accesses are aligned (a tuner caches its choice
# per (M, N), so alignment must pick the tuner, not prune its configs).
_transpose_any = triton.autotune(configs=_BYTES + _WORDS, key=["M", "N"])(_transpose)
_transpose_by_bytes = triton.autotune(configs=_BYTES, key=["M", "N"])(_transpose)


def transpose_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst [N, M] = src [M, N]^T, both contiguous uint8."""
    m, n = src.shape
    words = m % 4 == 0 and n % 4 == 0 and src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    (_transpose_any if words else _transpose_by_bytes)[grid](src, dst, m, n)
