"""The fused tensor-parallel GEMMs (parallel.tp_overlap = "fused"): persistent Triton GEMMs over symmetric memory.

All-gather + GEMM (`ag_gemm_kernel`)
  Each rank copies its rows a_shard [m, K] into its symmetric buffer (double-buffered by call parity), then
  one symmetric-memory barrier says every shard is in place. The copy engine pulls the peers' shards over
  NVLink into the gathered output [M, K] (an ordinary tensor, kept for the weight gradient), piece by piece
  on a side stream, and after each piece a stream memory operation (cuStreamWriteValue32, with its
  system-wide fence, no SM needed) raises that piece's flag. One persistent GEMM, launched at once beside
  them, walks its tiles in arrival order: its own rows first, read straight from the shard (no wait), then
  the peers' in the order the copy stream delivers them, spinning on a piece's flag (acquire) before its
  first load from it. The local shard reaches the gathered tensor in one copy on a second stream. The GEMM
  leaves `reserve_sms` SMs free for the barrier kernel; results leave it through TMA stores.

GEMM + reduce-scatter (`gemm_rs_kernel`)
  One persistent GEMM computes the rows that belong to the peers first and its own rows last. A peer's
  tile goes straight into that peer's symmetric staging buffer (NVLink stores from the epilogue); when a
  CTA moves on from a peer's rows, one release atomic on that peer's per-source counter adds the tiles it
  stored there (one system-scope fence per CTA and peer, not per tile). The own rows' epilogues wait
  (acquire) until every peer's counter shows all its tiles of the call, add those partial sums to the
  accumulator in fp32 and write the result: the reduction is fused into the epilogue, and the transfers
  run while the remaining tiles compute. Counters are cumulative (no reset, so no barrier per
  call); staging is double-buffered by call parity, which the kernels' own ordering makes safe. Tiles are
  handed out by an atomic counter in index order, so every peer tile is computed by a running CTA before any
  CTA can wait on a peer: no deadlock, whatever else shares the GPU.

Both spin loops give up after `spin_limit` polls (parallel.tp_spin_limit) and record the failed wait in an error
word that FusedTP.check() turns into an exception (every 64 calls without synchronizing, or on demand).

Workspaces are symmetric buffers (symm.SymmBuffer, made and checked collectively: symm.py), made when an op first
needs one, or a bigger one. The all-gather GEMM has two cores, chosen by Tiles.core: the Triton kernel here (0) and
the warp-specialized Gluon one (1, gluon_gemm.py); FusedTP launches either through its `ag_launcher`.
Runs on Hopper-class GPUs with Triton >= 3.4 (host-side TMA descriptors); bf16/fp16 operands, fp32 accumulation.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from holotrain.parallel.kernel_common import (
    aligned, cdiv, check_operands, output_buffer, proxy_fence, tile_coords, wait_at_least,
)
from holotrain.parallel.symm import SYMM_HEADER, SymmBuffer, write_flag
from holotrain.parallel.tiles import Tiles

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's CPU interpreter: no inline PTX (the fence)


# --------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _signal(bases_ptr, peer, rank, count):
    """counters[rank] += count on `peer`, released at system scope after this CTA's stores to it."""
    tl.debug_barrier()  # every thread's stores issued before the release
    peer_base = tl.load(bases_ptr + peer)
    tl.atomic_add(peer_base.to(tl.pointer_type(tl.int64)) + rank, count, sem="release", scope="sys")


@triton.jit
def _mainloop(a_desc, b_desc, off_am, off_bn, k_tiles,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, B_NK: tl.constexpr, WS: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in tl.range(0, k_tiles, warp_specialize=WS):
        k = kt * BK
        a = a_desc.load([off_am, k])
        if B_NK:  # weight stored [N, K] (nn.Linear): y = a @ w.T
            b = b_desc.load([off_bn, k])
            acc = tl.dot(a, b.T, acc)
        else:  # [K, N]
            b = b_desc.load([k, off_bn])
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _store_tile(c_desc, chunk, row, col, acc, BM: tl.constexpr, BN: tl.constexpr, EPI: tl.constexpr):
    """acc into C[chunk, row:row + BM, col:col + BN] by TMA, whole or in two column halves."""
    out = acc.to(c_desc.dtype)
    if EPI == 2:
        left, right = out.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()
        c_desc.store([chunk, row, col], left.reshape(1, BM, BN // 2))
        c_desc.store([chunk, row, col + BN // 2], right.reshape(1, BM, BN // 2))
    else:
        c_desc.store([chunk, row, col], out.reshape(1, BM, BN))


@triton.jit(do_not_specialize=["rank", "world", "m", "N", "K", "piece_rows", "splits", "spin_limit", "nprog"])
def ag_gemm_kernel(own_desc, a_desc, b_desc, c_desc, flags_ptr, err_ptr,
                   rank, world, m, N, K, piece_rows, splits, spin_limit, nprog,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   B_NK: tl.constexpr, FENCE: tl.constexpr, WS: tl.constexpr = False, FLAT: tl.constexpr = False,
                   EPI: tl.constexpr = 1):
    """C[M, N] = A[M, K] @ B with A the gathered rows, arriving chunk by chunk (chunk c = rows of rank c).

    This rank's own rows are read from own_desc (its shard, [m, K]), so their tiles start at once; the peers'
    rows from a_desc (the gathered [M, K]) as they land there. c_desc describes C as [world, m, N] (blocks
    [1, BM, BN]): a tile's TMA store stops at its chunk's last row. flags[(s - 1) * splits + p] becomes 1 when
    piece p of the s-th peer chunk to arrive (s = 1: rank + 1's) is in A. Pieces hold whole groups of GROUP_M
    row tiles, so a CTA meets them in non-decreasing order and polls each piece's flag once.
    FLAT: the tile and K loops flattened into one software pipeline (the next tile's loads overlap this tile's
    epilogue). EPI = 2: the epilogue stores two [BM, BN / 2] halves (c_desc's blocks), which halves its shared
    memory and leaves room for a fourth pipeline stage.
    """
    tiles_m = tl.cdiv(m, BM)
    tiles_n = tl.cdiv(N, BN)
    per_chunk = tiles_m * tiles_n
    total = per_chunk * world
    k_tiles = tl.cdiv(K, BK)
    pid = tl.program_id(0)
    # Two loops over this CTA's tiles (pid, pid + nprog, ...; nprog = the grid size), one GEMM loop each: a
    # single loop choosing its source per tile would merge two accumulators, which serializes the wgmma pipeline.
    for t in tl.range(pid, per_chunk, nprog, flatten=FLAT):  # own rows, read from the shard
        pid_m, pid_n = tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = _mainloop(own_desc, b_desc, pid_m * BM, pid_n * BN, k_tiles, BM, BN, BK, B_NK, WS)
        # The epilogue through TMA: no per-element addresses in registers (a pointer store's [BM, BN] offsets
        # push the kernel past 255 registers, into spills).
        _store_tile(c_desc, rank, pid_m * BM, pid_n * BN, acc, BM, BN, EPI)
    first_peer = pid if pid >= per_chunk else pid + tl.cdiv(per_chunk - pid, nprog) * nprog
    seen = -1
    for t in tl.range(first_peer, total, nprog, flatten=FLAT):  # the peers' rows: rank + 1, rank + 2, ...
        slot = t // per_chunk
        pid_m, pid_n = tile_coords(t % per_chunk, tiles_m, tiles_n, GROUP_M)
        chunk = (rank + slot) % world
        row = pid_m * BM
        piece = (slot - 1) * splits + row // piece_rows
        if piece != seen:
            wait_at_least(flags_ptr + piece, 1, spin_limit, err_ptr, 1 + chunk)
            if FENCE:
                proxy_fence(piece)
            seen = piece
        acc = _mainloop(a_desc, b_desc, chunk * m + row, pid_n * BN, k_tiles, BM, BN, BK, B_NK, WS)
        _store_tile(c_desc, chunk, row, pid_n * BN, acc, BM, BN, EPI)


@triton.jit(do_not_specialize=["rank", "world", "m", "N", "K", "parity", "expected", "spin_limit", "nprog"])
def gemm_rs_kernel(a_desc, b_desc, out_desc, stage_desc, bases_ptr, counter_ptr, err_ptr,
                   rank, world, m, N, K, parity, expected, spin_limit, nprog,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   B_NK: tl.constexpr, HEADER_BYTES: tl.constexpr, DYNAMIC: tl.constexpr, FENCE: tl.constexpr,
                   WS: tl.constexpr = False, LOCAL_STORES: tl.constexpr = False):
    """out[m, N] = sum over ranks r of (A_r @ B_r)[rows of this rank], A [M = world * m, K].

    bases[r] is rank r's symmetric buffer (mapped here): int64 counters[world] at its start, then staging
    [2 parities][world sources][m, N]; stage_desc describes this rank's own staging as [2 * world, m, N] (blocks
    [1, BM, BN]), out_desc the output [m, N].
    LOCAL_STORES (a diagnostic; the result is wrong): the peers' tiles go to this rank's own staging, with no
    signal and no wait, so the same kernel runs without NVLink stores or cross-rank synchronization.
    """
    DT = out_desc.dtype
    tiles_m = tl.cdiv(m, BM)
    tiles_n = tl.cdiv(N, BN)
    per_chunk = tiles_m * tiles_n
    total = per_chunk * world
    k_tiles = tl.cdiv(K, BK)
    chunk_elems = m.to(tl.int64) * N
    my_base = tl.load(bases_ptr + rank)
    ready = 0
    pending = 0  # tiles stored into peer `pending_chunk` and not yet signalled
    pending_chunk = rank
    if DYNAMIC:
        t = tl.atomic_add(counter_ptr, 1)
    else:
        t = tl.program_id(0)
    while t < total:
        slot = t // per_chunk  # the peers' rows first (rank+1, rank+2, ...), this rank's own rows last
        chunk = (rank + 1 + slot) % world
        if (pending > 0) & (chunk != pending_chunk):  # one release per peer and CTA, not per tile
            _signal(bases_ptr, pending_chunk, rank, pending)
            pending = 0
        pid_m, pid_n = tile_coords(t % per_chunk, tiles_m, tiles_n, GROUP_M)
        row = pid_m * BM
        acc = _mainloop(a_desc, b_desc, chunk * m + row, pid_n * BN, k_tiles, BM, BN, BK, B_NK, WS)
        if chunk != rank:
            # Into the peer's staging over NVLink: plain stores (the peer's memory has no TMA descriptor here),
            # addressed as a 64-bit tile start plus 32-bit offsets within the tile: 64-bit offsets per element
            # would push the kernel into register spills.
            rows = tl.arange(0, BM)
            cols = tl.arange(0, BN)
            mask = (row + rows < m)[:, None] & (pid_n * BN + cols < N)[None, :]
            peer_base = my_base if LOCAL_STORES else tl.load(bases_ptr + chunk)
            dst = ((peer_base + HEADER_BYTES).to(tl.pointer_type(DT)) + (parity * world + rank) * chunk_elems
                   + row.to(tl.int64) * N + pid_n * BN)
            tl.store(dst + rows[:, None] * N + cols[None, :], acc.to(DT), mask=mask)
            if not LOCAL_STORES:
                pending += 1
                pending_chunk = chunk
        else:
            counters = my_base.to(tl.pointer_type(tl.int64))
            if LOCAL_STORES:
                ready = 1
            if ready == 0:  # once all peers' tiles of this call are in, later own tiles need not poll
                for p in range(0, world):
                    if p != rank:
                        wait_at_least(counters + p, expected, spin_limit, err_ptr, 100 + p)
                if FENCE:
                    proxy_fence(ready)  # the acquires above before the TMA loads of the peers' tiles
                ready = 1
            for p in range(0, world):
                if p != rank:
                    part = stage_desc.load([parity * world + p, row, pid_n * BN])
                    acc += part.reshape(BM, BN).to(tl.float32)
            out_desc.store([row, pid_n * BN], acc.to(DT))
        if DYNAMIC:
            t = tl.atomic_add(counter_ptr, 1)
        else:
            t += nprog
    if pending > 0:
        _signal(bases_ptr, pending_chunk, rank, pending)


# --------------------------------------------------------------------------------------------------------
# Host side


def b_desc(w: torch.Tensor, layout: str, tiles: Tiles) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(w, [tiles.bn, tiles.bk] if layout == "nk" else [tiles.bk, tiles.bn])


def c_desc(y: torch.Tensor, world: int, m: int, N: int, tiles: Tiles) -> TensorDescriptor:
    """The all-gather GEMM's output [world * m, N] as [world, m, N]: a tile's store stops at its chunk's end."""
    return TensorDescriptor.from_tensor(y.view(world, m, N), [1, tiles.bm, tiles.bn // tiles.epi])


def ag_launcher(own: torch.Tensor, gathered: torch.Tensor, y: torch.Tensor, flags: torch.Tensor, error: torch.Tensor,
                rank: int, world: int, m: int, N: int, K: int, piece_rows: int, splits: int, spin_limit: int,
                grid: int, tiles: Tiles):
    """The fused all-gather GEMM on the Triton core (ag_gemm_kernel), its activation and output descriptors made
    once: launch(w, layout, fence) runs it. own: this rank's rows [m, K]; gathered: the group's [world * m, K];
    y: the output [world * m, N]; flags, piece_rows, splits: the pieces' arrival (see ag_gemm_kernel)."""
    own_desc = TensorDescriptor.from_tensor(own, [tiles.bm, tiles.bk])
    a_desc = TensorDescriptor.from_tensor(gathered, [tiles.bm, tiles.bk])
    y_desc = c_desc(y, world, m, N, tiles)

    def launch(w: torch.Tensor, layout: str, fence: bool) -> None:
        ag_gemm_kernel[(grid,)](
            own_desc, a_desc, b_desc(w, layout, tiles), y_desc, flags, error, rank, world, m, N, K,
            piece_rows, splits, spin_limit, grid, BM=tiles.bm, BN=tiles.bn, BK=tiles.bk,
            GROUP_M=tiles.group_m, B_NK=layout == "nk", FENCE=fence, WS=bool(tiles.ws), FLAT=bool(tiles.flat),
            EPI=tiles.epi, num_stages=tiles.stages, num_warps=tiles.warps,
        )

    return launch


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


class FusedTP:
    """The fused path of one tensor-parallel group: workspaces, streams, and the two ops.

    spin_limit: polls of a peer's flag or counter before a kernel gives up (parallel.tp_spin_limit); barrier_ms: the
    timeout of the all-gather's symmetric-memory barrier (parallel.tp_barrier_ms); piece_mb: about how many MiB of
    a peer's rows arrive, and are signalled, at a time (parallel.tp_piece_mb). The defaults are the config's."""

    def __init__(self, group: dist.ProcessGroup, tiles: Tiles | None = None, *, spin_limit: int = 1 << 26,
                 barrier_ms: int = 120000, piece_mb: float = 4.0):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.tiles = tiles or Tiles()
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.copy_stream = torch.cuda.Stream(self.device, priority=-1)
        self.local_stream = torch.cuda.Stream(self.device, priority=-1)
        self.error = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._error_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._error_event = None
        self.spin_limit = int(spin_limit)
        self.piece_bytes = int(float(piece_mb) * 2**20)
        self.barrier_timeout_ms = int(barrier_ms)
        self._ag: SymmBuffer | None = None
        self._rs: SymmBuffer | None = None
        self._retired: list[SymmBuffer] = []  # outgrown buffers: peers' in-flight work may still touch them
        self.ag_calls = self.rs_calls = 0
        self.rs_expected = 0
        self._rs_counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._calls = 0
        self._kn_transposed = False
        self._fence = not _INTERPRET

    # -- workspaces

    def _workspace(self, which: str, nbytes: int) -> SymmBuffer:
        ws = getattr(self, which)
        if ws is None or ws.nbytes < nbytes:
            if ws is not None:
                self._retired.append(ws)
            what = "all-gather workspace" if which == "_ag" else "reduce-scatter workspace"
            ws = SymmBuffer(self.group, nbytes, self.device, what)
            setattr(self, which, ws)
            if which == "_rs":
                self.rs_expected = 0  # fresh counters
        return ws

    def state(self) -> str:
        """One line on this rank's fused state, for a failure's diagnostic (reads the device: call it only
        while the CUDA context is usable)."""
        parts = [f"rank {self.rank}/{self.world}", f"tiles {self.tiles}", f"ag_calls {self.ag_calls}",
                 f"rs_calls {self.rs_calls}", f"rs_expected {self.rs_expected}", f"fence {self._fence}",
                 f"kn_transposed {self._kn_transposed}", f"retired {len(self._retired)}",
                 f"spin_limit {self.spin_limit}", f"barrier_ms {self.barrier_timeout_ms}"]
        for ws in (self._ag, self._rs):
            if ws is not None:
                parts.append(ws.describe())
        try:
            parts.append(f"error word {int(self.error.item())}")
            if self._rs is not None:
                counters = self._rs.tensor[:8 * self.world].view(torch.int64).tolist()
                parts.append(f"rs counters (tiles received per source rank) {counters}")
        except Exception as e:  # a dead context: say so, do not raise from a diagnostic
            parts.append(f"device unreadable: {_first_line(e)}")
        return "; ".join(parts)

    # -- errors

    def check(self, sync: bool = True) -> None:
        """Raises if a kernel gave up waiting for a peer. sync=False reads the word copied at an earlier call."""
        if sync:
            torch.cuda.current_stream(self.device).synchronize()
            code = int(self.error.item())
        else:
            if self._error_event is None or not self._error_event.query():
                return
            code = int(self._error_host.item())
        if code:
            self.error.zero_()
            what = (f"all-gather piece from rank {code - 1}" if code < 100 else
                    f"reduce-scatter partial sums from rank {code - 100}")
            raise RuntimeError(f"fused TP on rank {dist.get_rank()}: a kernel gave up waiting for the {what} after "
                               f"{self.spin_limit} polls (parallel.tp_spin_limit); a peer is missing or the "
                               "ranks' calls went out of step. Results of that call are wrong.")

    def _watch(self) -> None:
        self._calls += 1
        if self._calls % 64 == 0:
            self.check(sync=False)
            self._error_host.copy_(self.error, non_blocking=True)
            self._error_event = torch.cuda.Event()
            self._error_event.record()

    # -- kernel launch, with fallbacks

    def _launch(self, launch, w: torch.Tensor, layout: str) -> None:
        """launch(w, layout, fence). Should a variant fail to compile on this Triton, the next is tried, and the
        one that works is kept (reported once): without the proxy fence, then with the [K, N] weight transposed
        into a [N, K] copy (small beside the activations)."""
        if layout == "kn" and self._kn_transposed:
            w, layout = w.t().contiguous(), "nk"
        try:
            return launch(w, layout, self._fence)
        except Exception as first:
            errors = [first]
        variants = []
        if self._fence:
            variants.append((w, layout, False, "without the proxy fence"))
        if layout == "kn":
            variants.append((w.t().contiguous(), "nk", self._fence, "with the weight transposed"))
        for w2, layout2, fence, what in variants:
            try:
                launch(w2, layout2, fence)
            except Exception as e:
                errors.append(e)
                continue
            self._fence = fence
            self._kn_transposed = self._kn_transposed or layout2 != layout
            print(f"holotrain fused TP (rank {dist.get_rank()}): kernel failed ({_first_line(errors[0])}); "
                  f"running {what} from now on", file=sys.stderr, flush=True)
            return None
        raise errors[0]

    # -- all-gather + GEMM

    def _pieces(self, m: int, row_bytes: int) -> tuple[int, int]:
        """(rows per piece, pieces per chunk): pieces of about piece_bytes, whole groups of row tiles each."""
        unit = self.tiles.bm * self.tiles.group_m
        splits = max(1, min(64, cdiv(m * row_bytes, self.piece_bytes)))
        piece_rows = cdiv(cdiv(m, splits), unit) * unit
        return piece_rows, cdiv(m, piece_rows)

    def all_gather_matmul(self, a_shard: torch.Tensor, w: torch.Tensor, layout: str = "nk",
                          out: torch.Tensor | None = None, gathered: torch.Tensor | None = None, diag: str = ""):
        """(gathered [M, K], gathered @ B [M, N]); `out` / `gathered`: contiguous outputs to write into.
        diag, for benchmarks (the result is wrong): "no_wait" raises every piece's flag before the GEMM starts (the
        copies still run beside it), "no_comm" also leaves out the copies and the barrier: what waiting for pieces,
        and the copies' traffic, cost the GEMM."""
        K, N = check_operands("all_gather_matmul", a_shard, w, layout)
        a_shard, w = aligned(a_shard), aligned(w)
        m, W, rank, tiles = a_shard.shape[0], self.world, self.rank, self.tiles
        dtype, elt = a_shard.dtype, a_shard.element_size()
        gathered = output_buffer(gathered, (W * m, K), dtype, self.device)
        y = output_buffer(out, (W * m, N), dtype, self.device)
        if m == 0:
            return gathered, y
        slot_bytes = cdiv(m * K * elt, SYMM_HEADER) * SYMM_HEADER
        ws = self._workspace("_ag", SYMM_HEADER + 2 * slot_bytes)
        parity = self.ag_calls & 1
        self.ag_calls += 1
        slot_off = SYMM_HEADER + parity * slot_bytes
        piece_rows, splits = self._pieces(m, K * elt)
        flags = (torch.ones if diag else torch.zeros)(max(1, (W - 1) * splits), dtype=torch.int32, device=self.device)

        # The copies go first, on high-priority streams: the shard's copy into the symmetric buffer is what the
        # peer waits for. Same-device copies run on SMs, so the GEMM starts once they are done (~130 us); a GEMM
        # launched first would leave those copies only the SMs it does not hold, which delays them, and with them
        # the pieces the GEMM waits for.
        compute = torch.cuda.current_stream(self.device)
        self.local_stream.wait_stream(compute)
        self.copy_stream.wait_stream(compute)
        if diag != "no_comm":
            with torch.cuda.stream(self.local_stream):  # own rows into the gathered output (the GEMM reads the shard)
                gathered[rank * m: (rank + 1) * m].copy_(a_shard)
            with torch.cuda.stream(self.copy_stream):
                ws.view(rank, slot_off, (m, K), dtype).copy_(a_shard)
                ws.handle.barrier(channel=0, timeout_ms=self.barrier_timeout_ms)  # every shard is in its buffer
                for s in range(1, W):
                    src = (rank + s) % W
                    peer = ws.view(src, slot_off, (m, K), dtype)
                    for p in range(splits):
                        r0, r1 = p * piece_rows, min(m, (p + 1) * piece_rows)
                        gathered[src * m + r0: src * m + r1].copy_(peer[r0:r1])  # copy engine, over NVLink
                        write_flag(flags, (s - 1) * splits + p)

        total = cdiv(m, tiles.bm) * cdiv(N, tiles.bn) * W
        grid = max(1, min(total, self.num_sms - tiles.reserve_sms))
        if tiles.core == 1:  # imported here: the Gluon core needs a Triton with Gluon, the default core does not
            from holotrain.parallel.gluon_gemm import ag_launcher as core_launcher
        else:
            core_launcher = ag_launcher
        launch = core_launcher(a_shard, gathered, y, flags, self.error, rank, W, m, N, K, piece_rows, splits,
                               self.spin_limit, grid, tiles)
        self._launch(launch, w, layout)
        compute.wait_stream(self.copy_stream)
        compute.wait_stream(self.local_stream)
        for t in (a_shard, gathered, flags):
            t.record_stream(self.copy_stream)
            t.record_stream(self.local_stream)
        self._watch()
        return gathered, y

    # -- GEMM + reduce-scatter

    def matmul_reduce_scatter(self, a: torch.Tensor, w: torch.Tensor, layout: str = "nk",
                              out: torch.Tensor | None = None, diag_local_stores: bool = False) -> torch.Tensor:
        """This rank's rows of the group's sum of a @ B, [M / world, N]; `out`: a contiguous output to write into.
        diag_local_stores: a diagnostic for benchmarks (the result is wrong): the kernel stores the peers' tiles
        into this rank's own memory and never waits for the peers, which isolates the cost of NVLink stores and
        cross-rank synchronization."""
        K, N = check_operands("matmul_reduce_scatter", a, w, layout)
        a, w = aligned(a), aligned(w)
        W, tiles = self.world, self.tiles
        M = a.shape[0]
        if M % W:
            raise ValueError(f"fused matmul_reduce_scatter: {M} rows do not split over {W} ranks")
        m = M // W
        out = output_buffer(out, (m, N), a.dtype, self.device)
        if m == 0:
            return out
        stage_elems = W * m * N
        ws = self._workspace("_rs", SYMM_HEADER + 2 * stage_elems * a.element_size())
        parity = self.rs_calls & 1
        self.rs_calls += 1
        if not diag_local_stores:
            self.rs_expected += cdiv(m, tiles.bm) * cdiv(N, tiles.bn)  # tiles each peer sends per call
        self._rs_counter.zero_()
        grid = self.num_sms if tiles.dynamic else min(self.num_sms, W * cdiv(m, tiles.bm) * cdiv(N, tiles.bn))
        a_desc = TensorDescriptor.from_tensor(a, [tiles.bm, tiles.bk])
        out_desc = TensorDescriptor.from_tensor(out, [tiles.bm, tiles.bn])
        stage_desc = TensorDescriptor.from_tensor(ws.view(self.rank, SYMM_HEADER, (2 * W, m, N), a.dtype),
                                                  [1, tiles.bm, tiles.bn])

        def launch(w, layout, fence):
            gemm_rs_kernel[(grid,)](
                a_desc, b_desc(w, layout, tiles), out_desc, stage_desc, ws.bases, self._rs_counter, self.error,
                self.rank, W, m, N, K, parity, self.rs_expected, self.spin_limit, grid, BM=tiles.bm, BN=tiles.bn,
                BK=tiles.bk, GROUP_M=tiles.group_m, B_NK=layout == "nk", HEADER_BYTES=SYMM_HEADER,
                DYNAMIC=bool(tiles.dynamic), FENCE=fence, WS=bool(tiles.ws),
                LOCAL_STORES=diag_local_stores, num_stages=tiles.stages, num_warps=tiles.warps,
            )

        self._launch(launch, w, layout)
        self._watch()
        return out


def triton_matmul(a: torch.Tensor, w: torch.Tensor, layout: str = "nk", tiles: Tiles | None = None,
                  num_sms: int | None = None) -> torch.Tensor:
    """The fused kernels' GEMM alone (no communication): a [M, K] @ B, for tests and the benchmark."""
    tiles = tiles or Tiles()
    K, N = check_operands("matmul", a, w, layout)
    a, w = aligned(a), aligned(w)
    M = a.shape[0]
    if tiles.core == 1:
        from holotrain.parallel.gluon_gemm import ws_matmul

        return ws_matmul(a, w, layout, tiles, num_sms=num_sms)
    y = torch.empty((M, N), dtype=a.dtype, device=a.device)
    flags = torch.ones(1, dtype=torch.int32, device=a.device)  # unread: one rank's rows are all its own
    error = torch.zeros(1, dtype=torch.int32, device=a.device)
    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    rows = max(tiles.bm, cdiv(M, tiles.bm) * tiles.bm)
    total = cdiv(M, tiles.bm) * cdiv(N, tiles.bn)
    grid = max(1, min(total, num_sms))
    a_desc = TensorDescriptor.from_tensor(a, [tiles.bm, tiles.bk])
    ag_gemm_kernel[(grid,)](
        a_desc, a_desc, b_desc(w, layout, tiles), c_desc(y, 1, M, N, tiles), flags, error,
        0, 1, M, N, K, rows, 1, 1 << 20, grid,
        BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, GROUP_M=tiles.group_m, B_NK=layout == "nk",
        FENCE=a.is_cuda and not _INTERPRET, WS=bool(tiles.ws), FLAT=bool(tiles.flat), EPI=tiles.epi,
        num_stages=tiles.stages, num_warps=tiles.warps,
    )
    return y

