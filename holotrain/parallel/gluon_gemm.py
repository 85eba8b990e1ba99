"""A warp-specialized persistent GEMM for Hopper, written in Gluon (Triton's lower-level dialect): the all-gather
GEMM's second core, selected with the tile option -c1 (parallel.tp_tiles).

Triton does not warp-specialize its own GEMMs on Hopper: every warp both issues the TMA loads and runs the wgmma
pipeline. Here one producer warp only issues TMA loads into a ring of shared-memory stages, running ahead across
tiles (also through the epilogue), and two consumer warpgroups only wait, multiply (wgmma, one in flight behind the
current one) and store; the producer gives up its registers (setmaxnreg) so the consumers hold a 128x256 fp32
accumulator without spilling. It is not the default: on the H200 it is no faster than the Triton kernel
(bench/RESULTS.md).

Partitions, synchronized by mbarriers per stage:
  ready[s]: the producer's TMA loads of stage s landed (transaction bytes);
  empty[s]: the consumers' wgmma that read stage s finished, so the producer may overwrite it.
Both partitions walk the same tile sequence (`_tile`), so no tile index passes between them.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from holotrain.parallel.kernel_common import proxy_fence, tile_coords, wait_at_least
from holotrain.parallel.tiles import Tiles


# Registers per thread over all 12 warps (the launch's maxnreg): the producer keeps 24, the consumers get 240.
MAXNREG = 168


# The shared scalar helpers (kernel_common.py), compiled as Gluon from the same source.
_tile = gluon.jit(tile_coords.fn)  # tile t in grouped order (GROUP_M row tiles sweep the columns together)
_wait_at_least = gluon.jit(wait_at_least.fn)  # spin on a flag (acquire, system scope), give up after a limit
_proxy_fence = gluon.jit(proxy_fence.fn)  # the acquire above before the TMA loads that follow it


@gluon.jit
def _load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, off_am, off_bn, k_tiles, i,
               B_NK: gl.constexpr):
    """The producer's TMA loads of one tile's K steps into the stage ring; i counts stages over the whole kernel."""
    BK: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    for kt in range(k_tiles):
        s = i % STAGES
        # mbarriers start in phase 1 complete: the first pass over the ring does not wait.
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_am, kt * BK], ready.index(s), a_bufs.index(s))
        if B_NK:
            tma.async_copy_global_to_shared(b_desc, [off_bn, kt * BK], ready.index(s), b_bufs.index(s))
        else:
            tma.async_copy_global_to_shared(b_desc, [kt * BK, off_bn], ready.index(s), b_bufs.index(s))
        i += 1
    return i


@gluon.jit
def _ag_producer(own_desc, a_desc, b_desc, a_bufs, b_bufs, ready, empty, flags_ptr, err_ptr,
                 rank, world, m, N, K, piece_rows, splits, spin_limit,
                 BN: gl.constexpr, GROUP_M: gl.constexpr, B_NK: gl.constexpr, FENCE: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    tiles_m = gl.cdiv(m, BM)
    tiles_n = gl.cdiv(N, BN)
    per_chunk = tiles_m * tiles_n
    k_tiles = gl.cdiv(K, BK)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    i = 0
    for t in range(pid, per_chunk, nprog):  # own rows, from the shard: no wait
        pid_m, pid_n = _tile(t, tiles_m, tiles_n, GROUP_M)
        i = _load_tile(own_desc, b_desc, a_bufs, b_bufs, ready, empty, pid_m * BM, pid_n * BN, k_tiles, i, B_NK)
    first_peer = gl.where(pid >= per_chunk, pid, pid + gl.cdiv(per_chunk - pid, nprog) * nprog)
    seen = -1
    for t in range(first_peer, per_chunk * world, nprog):  # the peers' rows as they land in the gathered A
        slot = t // per_chunk
        pid_m, pid_n = _tile(t % per_chunk, tiles_m, tiles_n, GROUP_M)
        chunk = (rank + slot) % world
        row = pid_m * BM
        piece = (slot - 1) * splits + row // piece_rows
        if piece != seen:  # only this warp polls; the consumers wait on the stage barriers as always
            _wait_at_least(flags_ptr + piece, 1, spin_limit, err_ptr, 1 + chunk)
            if FENCE:
                _proxy_fence(piece)
            seen = piece
        i = _load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, chunk * m + row, pid_n * BN, k_tiles, i, B_NK)


@gluon.jit
def _ag_consumer(a_bufs, b_bufs, ready, empty, c_desc, c_smem, rank, world, m, N, K,
                 GROUP_M: gl.constexpr, B_NK: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = c_desc.block_type.shape[1]
    BN: gl.constexpr = c_desc.block_type.shape[2]
    BK: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    # One warpgroup per 64 rows of the tile, each wgmma instruction as wide as the tile (n = BN).
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    tiles_m = gl.cdiv(m, BM)
    tiles_n = gl.cdiv(N, BN)
    per_chunk = tiles_m * tiles_n
    k_tiles = gl.cdiv(K, BK)
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
    i = 0
    # The producer's tile order (own rows, then the peers'), as one sequence: t -> (slot, tile in chunk).
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    own = gl.cdiv(per_chunk - pid, nprog)  # this CTA's own-row tiles
    first_peer = gl.where(pid >= per_chunk, pid, pid + own * nprog)
    n_own = gl.where(pid >= per_chunk, 0, own)
    n_tiles = n_own + gl.cdiv(gl.maximum(per_chunk * world - first_peer, 0), nprog)
    for j in range(n_tiles):
        t = gl.where(j < n_own, pid + j * nprog, first_peer + (j - n_own) * nprog)
        slot = t // per_chunk
        pid_m, pid_n = _tile(t % per_chunk, tiles_m, tiles_n, GROUP_M)
        for kt in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            if B_NK:
                b = b_bufs.index(s).permute((1, 0))
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), b, acc, use_acc=kt > 0, is_async=True)
            # Keep one wgmma in flight: once the previous one is done, its stage goes back to the producer.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=kt > 0)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
        # The previous tile's TMA store ran during this tile's main loop; c_smem is free once it has finished.
        tma.store_wait(pendings=0)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        # C is described as [world, m, N]: the store stops at the chunk's last row.
        tma.async_copy_shared_to_global(c_desc, [(rank + slot) % world, pid_m * BM, pid_n * BN],
                                        c_smem.reshape([1, BM, BN]))
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=["rank", "world", "m", "N", "K", "piece_rows", "splits", "spin_limit"])
def ag_gemm_ws_kernel(own_desc, a_desc, b_desc, c_desc, flags_ptr, err_ptr,
                      rank, world, m, N, K, piece_rows, splits, spin_limit,
                      GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_NK: gl.constexpr, FENCE: gl.constexpr,
                      num_warps: gl.constexpr):
    """C = A @ B with A the gathered rows [world * m, K], arriving chunk by chunk; the same contract as
    overlap_kernels.ag_gemm_kernel (own rows from own_desc at once, the peers' from a_desc once piece p of the
    s-th arriving peer chunk has flags[(s - 1) * splits + p] = 1; C as [world, m, N]). world = 1: a plain GEMM."""
    BM: gl.constexpr = c_desc.block_type.shape[1]
    BN: gl.constexpr = c_desc.block_type.shape[2]
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    # 2-D for the register store; the TMA store takes it as [1, BM, BN], c_desc's block.
    c_smem = gl.allocate_shared_memory(dtype, [BM, BN], gl.NVMMASharedLayout.get_default_for([BM, BN], dtype))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_ag_consumer, (a_bufs, b_bufs, ready, empty, c_desc, c_smem, rank, world, m, N, K, GROUP_M, B_NK,
                        num_warps)),
        (_ag_producer, (own_desc, a_desc, b_desc, a_bufs, b_bufs, ready, empty, flags_ptr, err_ptr, rank, world,
                        m, N, K, piece_rows, splits, spin_limit, BN, GROUP_M, B_NK, FENCE)),
    ], [1], [24])


# --------------------------------------------------------------------------------------------------------
# Host side


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def a_desc(a: torch.Tensor, tiles: Tiles) -> TensorDescriptor:
    return _desc(a, [tiles.bm, tiles.bk])


def b_desc(w: torch.Tensor, layout: str, tiles: Tiles) -> TensorDescriptor:
    return _desc(w, [tiles.bn, tiles.bk] if layout == "nk" else [tiles.bk, tiles.bn])


def c_desc(y: torch.Tensor, world: int, m: int, N: int, tiles: Tiles) -> TensorDescriptor:
    """The output [world * m, N] as [world, m, N]: a tile's store stops at its chunk's end."""
    return _desc(y.view(world, m, N), [1, tiles.bm, tiles.bn])


def ag_launcher(own: torch.Tensor, gathered: torch.Tensor, y: torch.Tensor, flags: torch.Tensor, error: torch.Tensor,
                rank: int, world: int, m: int, N: int, K: int, piece_rows: int, splits: int, spin_limit: int,
                grid: int, tiles: Tiles):
    """The fused all-gather GEMM on this core, its activation and output descriptors made once: launch(w, layout,
    fence) runs it (the same contract as overlap_kernels.ag_launcher)."""
    own_d, gathered_d = a_desc(own, tiles), a_desc(gathered, tiles)
    y_d = c_desc(y, world, m, N, tiles)

    def launch(w: torch.Tensor, layout: str, fence: bool) -> None:
        ag_gemm_ws_kernel[(grid,)](
            own_d, gathered_d, b_desc(w, layout, tiles), y_d, flags, error, rank, world, m, N, K,
            piece_rows, splits, spin_limit, GROUP_M=tiles.group_m, STAGES=tiles.stages,
            B_NK=layout == "nk", FENCE=fence, num_warps=8, maxnreg=MAXNREG)

    return launch


def ws_matmul(a: torch.Tensor, w: torch.Tensor, layout: str = "nk", tiles: Tiles | None = None,
              out: torch.Tensor | None = None, num_sms: int | None = None) -> torch.Tensor:
    """a [M, K] @ B, with w = B as [N, K] ("nk", nn.Linear's weight) or [K, N] ("kn"); bf16/fp16, fp32 accumulation.
    The all-gather kernel with one rank: every row is its own."""
    tiles = tiles or Tiles(core=1)
    M, K = a.shape
    N = w.shape[0] if layout == "nk" else w.shape[1]
    y = out if out is not None else torch.empty((M, N), dtype=a.dtype, device=a.device)
    a_d = a_desc(a, tiles)
    flags = torch.ones(1, dtype=torch.int32, device=a.device)  # unread: one rank's rows are all its own
    error = torch.zeros(1, dtype=torch.int32, device=a.device)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = max(1, min(num_sms, triton.cdiv(M, tiles.bm) * triton.cdiv(N, tiles.bn)))
    ag_gemm_ws_kernel[(grid,)](a_d, a_d, b_desc(w, layout, tiles), c_desc(y, 1, M, N, tiles), flags, error,
                               0, 1, M, N, K, max(tiles.bm, M), 1, 1 << 20, GROUP_M=tiles.group_m,
                               STAGES=tiles.stages, B_NK=layout == "nk", FENCE=True, num_warps=8,
                               maxnreg=MAXNREG)
    return y
