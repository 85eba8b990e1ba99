"""Tensor-parallel GEMMs with their communication: all-gather + GEMM and GEMM + reduce-scatter.

Operands are 2-D and rows are tokens. Between tensor-parallel regions a rank holds one contiguous block of
m rows (its share of the micro-batch's B*T tokens); the group's blocks, in rank order, are the whole
M = tp * m. Weights come as nn.Linear stores them, w [N, K] with y = x @ w.T (layout "nk"), or as a
[K, N] matrix with y = x @ w (layout "kn": the transposed use of the same weight in backward).

  all_gather_matmul(a_shard, w)      gathered = all_gather(a_shard) [M, K];  y = gathered @ B   [M, N]
  matmul_reduce_scatter(a, w)        y = reduce_scatter(a @ B), summed over the group        [m, N]

`parallel.tp_overlap` picks how the communication meets the GEMM:
  "none"      the collective (NCCL on GPU, gloo on CPU), then the GEMM: the reference, and the CPU path.
  "async_tp"  torch's micro-pipelined ops over symmetric memory (torch.ops.symm_mem.fused_all_gather_matmul,
              fused_matmul_reduce_scatter): the GEMM split per source rank, copies on a side stream.
  "fused"     ours (overlap_kernels.py): one persistent Triton GEMM per op over symmetric memory. The
              all-gather's chunks are pulled by the copy engine with a flag per piece, and the GEMM takes its
              tiles in the order the pieces arrive (local first); the reduce-scatter's GEMM computes the
              peers' rows first, stores each tile straight into the owner's memory and signals it, and adds
              the peers' partial sums into its own rows as it finishes them.

ag_linear / linear_rs wrap these in autograd: all-gather + GEMM's backward is GEMM + reduce-scatter (input
gradient) plus a GEMM with the saved gathered input (weight gradient); GEMM + reduce-scatter's backward is
all-gather + GEMM.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from holotrain.errors import ConfigError
from holotrain.parallel.tiles import Tiles, parse_tiles

MODES = ("none", "async_tp", "fused")


class TPComm:
    """A tensor-parallel process group with its overlap mode; owns the fused path's symmetric workspaces.

    tiles, spin_limit, barrier_ms, piece_mb: the fused kernels' settings (parallel.tp_tiles, tp_spin_limit,
    tp_barrier_ms, tp_piece_mb; overlap_kernels.FusedTP says what each does); the defaults are the config's."""

    def __init__(self, group: dist.ProcessGroup, mode: str = "none", tiles: str = "", *, spin_limit: int = 1 << 26,
                 barrier_ms: int = 120000, piece_mb: float = 4.0):
        if mode not in MODES:
            raise ConfigError(f"parallel.tp_overlap must be one of {', '.join(MODES)}, got {mode!r}")
        self.group, self.mode = group, mode
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.group_name = group.group_name
        self.tiles = tiles
        self.spin_limit, self.barrier_ms, self.piece_mb = spin_limit, barrier_ms, piece_mb
        self._fused = None
        if mode != "none":
            if not torch.cuda.is_available() or dist.get_backend(group) != "nccl":
                raise ConfigError(f"parallel.tp_overlap={mode!r} runs on CUDA GPUs (NCCL) only; use 'none' on the CPU")
            import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem

            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:  # needed before torch 2.9, a deprecated no-op after
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    enable(self.group_name)

    @property
    def fused(self):
        """The fused kernels' workspace (overlap_kernels.FusedTP), made on first use."""
        if self._fused is None:
            from holotrain.parallel.overlap_kernels import FusedTP  # needs Triton: imported on first use

            tiles = Tiles(**parse_tiles(self.tiles)) if self.tiles else Tiles()
            self._fused = FusedTP(self.group, tiles, spin_limit=self.spin_limit, barrier_ms=self.barrier_ms,
                                  piece_mb=self.piece_mb)
        return self._fused


def _b(w: torch.Tensor, layout: str) -> torch.Tensor:
    return w.t() if layout == "nk" else w


def all_gather_matmul(a_shard: torch.Tensor, w: torch.Tensor, comm: TPComm, layout: str = "nk",
                      mode: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gathered [M, K], gathered @ B [M, N]) from this rank's rows a_shard [m, K]."""
    mode = mode or comm.mode
    a_shard = a_shard.contiguous()
    if mode == "none":
        gathered = a_shard.new_empty((a_shard.shape[0] * comm.world, a_shard.shape[1]))
        dist.all_gather_into_tensor(gathered, a_shard, group=comm.group)
        return gathered, gathered @ _b(w, layout)
    if mode == "async_tp":
        gathered, outs = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [_b(w, layout)], 0, comm.group_name,
                                                                     return_A=True)
        return gathered, outs[0]
    if mode == "fused":
        return comm.fused.all_gather_matmul(a_shard, w, layout)
    raise ValueError(f"unknown tensor-parallel overlap mode {mode!r}")


def matmul_reduce_scatter(a: torch.Tensor, w: torch.Tensor, comm: TPComm, layout: str = "nk",
                          mode: str | None = None) -> torch.Tensor:
    """reduce_scatter(a @ B) over the group: this rank's rows [M / tp, N], summed over the ranks."""
    mode = mode or comm.mode
    a = a.contiguous()
    if a.shape[0] % comm.world:
        raise ValueError(f"matmul_reduce_scatter: {a.shape[0]} rows do not split over {comm.world} ranks")
    if mode == "none":
        partial = a @ _b(w, layout)
        out = partial.new_empty((partial.shape[0] // comm.world, partial.shape[1]))
        dist.reduce_scatter_tensor(out, partial, group=comm.group)
        return out
    if mode == "async_tp":
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, _b(w, layout), "sum", 0, comm.group_name)
    if mode == "fused":
        return comm.fused.matmul_reduce_scatter(a, w, layout)
    raise ValueError(f"unknown tensor-parallel overlap mode {mode!r}")


# ------------------------------------------------------------------------------------------------------
# Autograd


class _AGLinear(torch.autograd.Function):
    """y = all_gather(x) @ w.T   (column-parallel: x [m, K] this rank's tokens, w [N/tp, K] its output columns)."""

    @staticmethod
    def forward(ctx, x, w, comm):
        gathered, y = all_gather_matmul(x, w, comm, "nk")
        ctx.save_for_backward(gathered, w)
        ctx.comm = comm
        return y

    @staticmethod
    def backward(ctx, dy):
        gathered, w = ctx.saved_tensors
        comm, dy = ctx.comm, dy.contiguous()
        if comm.mode == "none" and dy.is_cuda:
            # The reference path still hides the reduce-scatter behind the weight-gradient GEMM.
            partial = dy @ w
            dx = partial.new_empty((partial.shape[0] // comm.world, partial.shape[1]))
            work = dist.reduce_scatter_tensor(dx, partial, group=comm.group, async_op=True)
            dw = dy.t() @ gathered
            work.wait()
            return dx, dw, None
        dx = matmul_reduce_scatter(dy, w, comm, "kn")  # [M, N] @ [N, K], scattered to [m, K]
        return dx, dy.t() @ gathered, None


class _LinearRS(torch.autograd.Function):
    """y = reduce_scatter(x @ w.T)   (row-parallel: x [M, K/tp] all tokens, w [N, K/tp] its input columns)."""

    @staticmethod
    def forward(ctx, x, w, comm):
        ctx.save_for_backward(x, w)
        ctx.comm = comm
        return matmul_reduce_scatter(x, w, comm, "nk")

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        gathered_dy, dx = all_gather_matmul(dy.contiguous(), w, ctx.comm, "kn")  # [M, N] @ [N, K/tp]
        return dx, gathered_dy.t() @ x, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // comm.world, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=comm.group)
        return out

    @staticmethod
    def backward(ctx, dy):
        return _all_gather_rows(dy.contiguous(), ctx.comm), None


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather_rows(x.contiguous(), comm)

    @staticmethod
    def backward(ctx, dy):
        comm, dy = ctx.comm, dy.contiguous()
        out = dy.new_empty((dy.shape[0] // comm.world, *dy.shape[1:]))
        dist.reduce_scatter_tensor(out, dy, group=comm.group)
        return out, None


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; the gradient summed over the group (a replicated weight applied to a rank's own tokens)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous().clone()
        dist.all_reduce(dy, group=ctx.comm.group)
        return dy, None


class _GatherColumns(torch.autograd.Function):
    """[M, N/tp] per rank -> [M, N], rank order along the columns; backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        stacked = _all_gather_rows(x.contiguous(), comm).view(comm.world, *x.shape)
        return stacked.movedim(0, -2).reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        comm = ctx.comm
        return dy.chunk(comm.world, dim=-1)[comm.rank].contiguous(), None


def _all_gather_rows(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * comm.world, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=comm.group)
    return out


def ag_linear(x: torch.Tensor, w: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _AGLinear.apply(x, w, comm)


def linear_rs(x: torch.Tensor, w: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _LinearRS.apply(x, w, comm)


def reduce_scatter_rows(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _ReduceScatterRows.apply(x, comm)


def all_gather_rows(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """The group's row blocks in rank order; backward reduce-scatters."""
    return _AllGatherRows.apply(x, comm)


def grad_all_reduce(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _GradAllReduce.apply(x, comm)


def gather_columns(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _GatherColumns.apply(x, comm)
