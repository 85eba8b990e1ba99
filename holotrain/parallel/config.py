"""The config's [parallel] section: data, tensor, context, pipeline and expert parallelism, and the checks on its
own keys."""

from __future__ import annotations

from dataclasses import dataclass

from holotrain.parallel.tiles import parse_tiles
from holotrain.section import Section, need

PP_SCHEDULES = ("auto", "1f1b", "interleaved", "zb1p", "zbv")


@dataclass
class ParallelConfig(Section):
    # Data parallelism over all ranks of a torchrun launch (world size / tp of them); world size 1 runs unsharded.
    dp: str = "fsdp"  # fsdp
    reshard_after_forward: bool = True
    # Tensor parallelism (holotrain/parallel/tp.py): ranks per model replica, splitting heads and FFN columns, with
    # sequence-parallel norms; ranks tp*i .. tp*i+tp-1 form one group (one node's GPUs). 1 = off.
    tp: int = 1
    # How a TP layer's all-gather / reduce-scatter meets its GEMM (holotrain/parallel/overlap.py): "none" (NCCL
    # collective, then the GEMM; the only CPU path), "async_tp" (torch's symmetric-memory async-TP ops) or
    # "fused" (our Triton kernels: the GEMM consumes gathered tiles as they arrive and scatters as it goes).
    tp_overlap: str = "none"
    # Tiles of the fused kernels, "BMxBNxBK" with optional "-sSTAGES-wWARPS-gGROUP_M-rRESERVED_SMS-dDYNAMIC-xWS"
    # "-fFLAT-eEPILOGUE_PIECES-cCORE" (holotrain/parallel/tiles.py; -c1: the all-gather GEMM on the
    # warp-specialized Gluon core); empty = the built-in default (bench/overlap.py tries a few).
    tp_tiles: str = ""
    # The fused kernels' safety limits and piece size. A wait that polls a peer's flag more than tp_spin_limit times
    # ends the kernel with an error (a peer is missing) instead of hanging; tp_barrier_ms bounds the host-side
    # barrier before each op; tp_piece_mb is the unit in which the all-gather's copies land and are signalled.
    tp_spin_limit: int = 1 << 26
    tp_barrier_ms: int = 120000
    tp_piece_mb: float = 4.0
    # Context parallelism (holotrain/parallel/cp.py): ranks that split each sequence, load-balanced (each rank holds
    # chunks i and 2N-1-i of 2N). "ring": keys and values pass around the group, each hop overlapped with attention on
    # the block at hand; "alltoall": all-to-all from sequence to heads (the heads, and kv heads, of a TP rank must divide
    # by cp) and attention over the whole sequence; "auto": alltoall where heads divide, else ring. 1 = off.
    cp: int = 1
    cp_mode: str = "auto"
    # Pipeline parallelism (holotrain/parallel/pp.py): ranks that each hold a contiguous share of the blocks (stages
    # balanced by cost, the embedding on the first and the head on the last), on torch.distributed.pipelining's
    # schedules: "1f1b", "interleaved" (2 stages per rank, looped), "zb1p" (interleaved zero bubble), "zbv" (zero bubble,
    # 2 stages per rank in a V); "auto": interleaved when training.compile, else zbv (1f1b with too few blocks for two
    # stages a rank). pp_microbatches: micro-batches per step through the pipeline, the step's gradient accumulation
    # (0: as training.micro_batch_size makes them, else the fewest of at least 2 x pp that split a replica's rows).
    # Not yet with memory.offload, activation offload or delayed FP8. 1 = off.
    pp: int = 1
    pp_schedule: str = "auto"
    pp_microbatches: int = 0
    # Expert parallelism (holotrain/parallel/ep.py), for mixture-of-experts models: each mixture-of-experts layer's
    # experts split over this many of the data-parallel ranks (adjacent ones; they must divide model.n_experts and
    # the data-parallel size), each token's copies sent to its experts' ranks and back by all-to-all. The expert
    # weights are then FSDP-sharded over the remaining data-parallel ranks. Not yet with cp, tp or pp. 1 = off.
    ep: int = 1

    def check(self) -> None:
        need(self.dp == "fsdp", f"parallel.dp must be 'fsdp', got {self.dp!r}")
        need(self.tp >= 1, f"parallel.tp must be >= 1, got {self.tp}")
        need(self.tp_overlap in ("none", "async_tp", "fused"),
             f"parallel.tp_overlap must be none, async_tp or fused, got {self.tp_overlap!r}")
        need(self.cp >= 1, f"parallel.cp must be >= 1, got {self.cp}")
        need(self.pp >= 1, f"parallel.pp must be >= 1, got {self.pp}")
        need(self.ep >= 1, f"parallel.ep must be >= 1, got {self.ep}")
        need(self.pp_schedule in PP_SCHEDULES, f"parallel.pp_schedule must be one of {', '.join(PP_SCHEDULES)}, "
             f"got {self.pp_schedule!r}")
        need(self.pp_microbatches >= 0, f"parallel.pp_microbatches must be >= 0, got {self.pp_microbatches}")
        need(self.cp_mode in ("auto", "ring", "alltoall"),
             f"parallel.cp_mode must be auto, ring or alltoall, got {self.cp_mode!r}")
        need(self.tp_spin_limit > 0, f"parallel.tp_spin_limit must be positive, got {self.tp_spin_limit}")
        need(self.tp_barrier_ms > 0, f"parallel.tp_barrier_ms must be positive, got {self.tp_barrier_ms}")
        need(self.tp_piece_mb > 0, f"parallel.tp_piece_mb must be positive, got {self.tp_piece_mb}")
        if self.tp_tiles:
            parse_tiles(self.tp_tiles)  # raises ConfigError naming parallel.tp_tiles
