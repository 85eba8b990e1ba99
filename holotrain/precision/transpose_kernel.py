"""The tiled byte transposes behind precision/transpose.py's op (CUDA only; imported on first use).

Two kernels, both copying whole tiles so that reads and writes are whole cache lines, tiles taken in diagonal order
(the 1.4b's widths are powers of two, and programs that run together would otherwise read and write the same
columns, so the same memory partitions):
  bytes   loads a tile of bytes along the source's rows and stores it along the destination's; Triton moves it
          through shared memory between the two layouts, a byte an element.
  words   loads the tile as 32-bit words, transposes each 4x4 block of bytes within the registers (shifts and
          masks), so only words, a quarter of the elements, go through shared memory. It needs both sides'
          widths to be multiples of 4 bytes.
Which is faster depends on the shape: the first call at a shape times both and keeps the faster (`transpose_bytes`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing


@triton.jit
def _diagonal_tile(pid, tiles_m, tiles_n):
    tm = pid % tiles_m
    return tm, (pid // tiles_m + tm) % tiles_n


@triton.jit
def _transpose_bytes(src, dst, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tm, tn = _diagonal_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N))
    rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    tile = tl.load(src + rows[:, None].to(tl.int64) * N + cols[None, :],
                   mask=(rows[:, None] < M) & (cols[None, :] < N))
    tl.store(dst + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(tile),
             mask=(cols[:, None] < N) & (rows[None, :] < M))


@triton.jit
def _transpose_words(src, dst, M, N4, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """src [M, N4] and dst [4 * N4, M // 4] are the byte matrices [M, 4 * N4] and [4 * N4, M] as int32 words. Byte
    j of src word (r, c) goes to byte r % 4 of dst word (4c + j, r // 4)."""
    Q: tl.constexpr = BLOCK_M // 4
    tm, tw = _diagonal_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N4, BLOCK_W))
    rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    words = tw * BLOCK_W + tl.arange(0, BLOCK_W)
    tile = tl.load(src + rows[:, None].to(tl.int64) * N4 + words[None, :],
                   mask=(rows[:, None] < M) & (words[None, :] < N4), other=0)
    tile = tl.reshape(tile, (Q, 4, BLOCK_W))  # [r // 4, r % 4, c]
    shift = (tl.arange(0, 4) * 8)[None, :, None]
    parts = []
    for j in tl.static_range(4):  # dst words of rows 4c + j: byte j of 4 src words, one from each row r % 4
        parts.append(tl.sum(((tile >> (8 * j)) & 0xFF) << shift, axis=1))  # disjoint bits: the sum is their OR
    # [Q, BLOCK_W, 2, 2], the new axis last: element [.., i, o] is parts[2i + o], so j is the flattened index.
    out = tl.join(tl.join(parts[0], parts[2]), tl.join(parts[1], parts[3]))
    out = tl.reshape(tl.permute(tl.reshape(out, (Q, BLOCK_W, 4)), (1, 2, 0)), (BLOCK_W * 4, Q))
    out_rows = tw * BLOCK_W * 4 + tl.arange(0, BLOCK_W * 4)
    out_cols = tm * Q + tl.arange(0, Q)
    tl.store(dst + out_rows[:, None].to(tl.int64) * (M // 4) + out_cols[None, :], out,
             mask=(out_rows[:, None] < N4 * 4) & (out_cols[None, :] < M // 4))


def _bytes(src: torch.Tensor, dst: torch.Tensor, block_m: int = 128, block_n: int = 128, warps: int = 8) -> None:
    m, n = src.shape
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _transpose_bytes[grid](src, dst, m, n, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)


def _words(src: torch.Tensor, dst: torch.Tensor, block_m: int = 128, block_w: int = 32, warps: int = 4) -> None:
    m, n = src.shape
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n // 4, block_w),)
    _transpose_words[grid](src.view(torch.int32), dst.view(torch.int32), m, n // 4, BLOCK_M=block_m,
                           BLOCK_W=block_w, num_warps=warps)


def _ways(src: torch.Tensor) -> dict:
    """The kernels (and tile shapes) that can take src."""
    ways = {f"bytes {bm}x{bn}/{w}": lambda s, d, a=(bm, bn, w): _bytes(s, d, *a)
            for bm, bn, w in ((64, 64, 4), (128, 128, 8), (64, 256, 8), (256, 64, 8))}
    m, n = src.shape
    if m % 4 == 0 and n % 4 == 0 and src.data_ptr() % 4 == 0:
        ways.update({f"words {bm}x{bw * 4}/{w}": lambda s, d, a=(bm, bw, w): _words(s, d, *a)
                     for bm, bw, w in ((64, 16, 4), (128, 32, 4), (128, 32, 8), (256, 16, 8))})
    return ways


_chosen: dict[tuple, str] = {}


def transpose_bytes(src: torch.Tensor, dst: torch.Tensor, way: str | None = None) -> str:
    """dst [N, M] = src [M, N]^T, both contiguous uint8. `way` names one of _ways (the bench compares them);
    by default the fastest at this shape, timed on its first call. Returns the way taken."""
    ways = _ways(src)
    if way is None:
        key = (tuple(src.shape), src.data_ptr() % 4 == 0, src.device.index)
        if key not in _chosen:
            times = {name: triton.testing.do_bench(lambda fn=fn: fn(src, dst), warmup=5, rep=20)
                     for name, fn in ways.items()}
            _chosen[key] = min(times, key=times.get)
        way = _chosen[key]
    ways[way](src, dst)
    return way
