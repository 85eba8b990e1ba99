"""The mixture-of-experts terms of the cost model, for both planners (plan/cost.py on this machine, plan/cluster.py on
paper). A MoE block (model/moe.py) routes each token to k = n_active_experts of E = n_experts experts, sorts the N x k
token copies by expert, runs the experts as grouped GEMMs over the sorted rows and puts the outputs back in token
order; under expert parallelism (parallel.ep, parallel/ep.py) a rank holds E / ep experts and the copies travel to
their experts' ranks and back by all-to-all. Per step, on the busiest rank:

  experts     the routed experts' GEMMs (model/costs.py: expert_flops_per_token, their 6 FLOPs per active weight) at
              the dense GEMM rate (the machine's, times the calibrated efficiency) times grouped_efficiency(rows), rows
              the mean rows a local expert gets per micro-batch: tokens x k / E, times ep under expert parallelism (a
              rank's experts take the copies of ep ranks' tokens). The router and shared experts are plain GEMMs.
              Under ep the busiest rank waits EP_IMBALANCE (parallel/cost.py) times the mean. What checkpointing runs
              again: a third of them for each block recomputed whole, or "pointwise" where torch._grouped_mm is not a
              kept op (memory/plan.py: grouped_gemms_kept)
  routing     memory traffic at MEMORY_BYTES_S (routing_bytes_per_token): the router's fp32 scores and top-k, the
              permutation's gather, the un-permutation's index_copy and weighted sum, and under ep the received rows'
              sort and the outputs' reorder; backward moves about twice forward's bytes
  all-to-all  parallel/cost.py's ep_bytes_per_step at the link's rate, times EP_IMBALANCE, plus EP_SYNC_S per exchange
              (dispatch reads the counts on the host); EP_OVERLAP of it hidden behind the experts' compute

Priors, not yet measured on a GPU: GROUPED_PEAK, GROUPED_HALF_ROWS, EP_SYNC_S, EP_OVERLAP (parallel/ep.py pipelines
the exchange in EP_CHUNKS chunks of the local experts: all but the first chunk's dispatch and the last one's combine
can run behind another chunk's GEMMs), EP_IMBALANCE. MEMORY_BYTES_S is the H200's fused AdamW (plan/cost.py: DEVICE_ADAMW_S_PER_PARAM, about
28 bytes a parameter), the device's copy rate the cost model already holds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from holotrain.model.args import ModelArgs
from holotrain.model.costs import expert_flops_per_token, model_params
from holotrain.parallel.cost import EP_IMBALANCE, ep_bytes_per_step
from holotrain.parallel.ep import EP_CHUNKS

# The grouped GEMMs' share of the dense GEMM rate at `rows` rows an expert: GROUPED_PEAK x rows / (rows +
# GROUPED_HALF_ROWS). Small per-expert GEMMs fill partial tiles (128 rows on Hopper) and run short of work per SM.
GROUPED_PEAK = 0.85
GROUPED_HALF_ROWS = 64
MEMORY_BYTES_S = {"cuda": 28 * 1.364e9 / 12.9e-3, "cpu": 10e9}
EP_SYNC_S = 100e-6  # a dispatch's wait for the counts: the GPU's queue drains and the host issues the experts' kernels
EP_OVERLAP = (EP_CHUNKS - 1) / EP_CHUNKS  # share of the all-to-all (at most the experts' compute) hidden behind it


def grouped_efficiency(rows: float) -> float:
    """The experts' grouped GEMMs' rate as a share of the dense GEMMs' at `rows` rows an expert (the curve above)."""
    return GROUPED_PEAK * rows / (rows + GROUPED_HALF_ROWS) if rows > 0 else GROUPED_PEAK


def routing_bytes_per_token(args: ModelArgs, elem_bytes: int, ep: int = 1, imbalance: float = 1.0) -> float:
    """Bytes of memory traffic per token and step of every MoE block's routing, forward and backward (3 x forward):
    the router's fp32 scores written and read by the softmax (or sigmoid) and the top-k (4 x 4 E), the k copies
    gathered (read and written, 2 k dim), un-permuted by index_copy (2 k dim) and summed with their weights (k dim read,
    dim written); under ep > 1 the received rows sorted by local expert and the outputs reordered for the combine
    (4 k dim, x imbalance)."""
    k, D, e = args.n_active_experts, args.dim, elem_bytes
    forward = 16 * args.n_experts + e * D * (5 * k + 1) + (4 * k * D * e * imbalance if ep > 1 else 0)
    return 3 * forward * args.moe_layers


@dataclass
class MoeTerms:
    """A mixture-of-experts model's terms of one step on the busiest rank (seconds, bytes), for the plan's output."""

    total_params: int
    active_params: int  # those one token goes through (model/costs.py: model_params(active=True))
    ep: int
    imbalance: float  # the busiest rank's token copies over the mean (1 without ep)
    rows_per_expert: float  # a local expert's mean rows per micro-batch
    grouped_efficiency: float  # the grouped GEMMs' share of the dense GEMM rate at those rows
    expert_s: float  # the routed experts' GEMMs, forward and backward
    recompute_s: float  # of them, run again by activation checkpointing
    routing_s: float  # the routing's memory traffic
    all_to_all_bytes: float  # a rank's sends (mean routing), dispatch + combine, forward + backward (+ recomputed)
    all_to_all_s: float  # their time at the link's rate on the busiest rank, with the waits for the counts
    hidden_s: float  # of all_to_all_s, hidden behind the experts' compute

    @property
    def exposed_s(self) -> float:
        return self.all_to_all_s - self.hidden_s

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "exposed_s": self.exposed_s}


def moe_terms(args: ModelArgs, tokens: float, micro_batches: int, ep: int, elem_bytes: int, gemm_rate: float,
              link_bytes_s: float, recomputed: float = 0.0, device: str = "cuda",
              imbalance: float = EP_IMBALANCE) -> MoeTerms | None:
    """The terms of a step of `micro_batches` micro-batches of `tokens` tokens each on this rank, with experts over
    `ep` ranks; `gemm_rate`: the dense GEMMs' FLOP/s (the machine's rate times the efficiency); `recomputed`: the
    share of the MoE blocks whose experts checkpointing runs again. None for a dense model."""
    if not args.moe_layers:
        return None
    imb = imbalance if ep > 1 else 1.0
    rows = tokens * args.n_active_experts * ep / args.n_experts
    eff = grouped_efficiency(rows)
    expert_s = expert_flops_per_token(args) * tokens * micro_batches / (gemm_rate * eff) * imb
    routing = routing_bytes_per_token(args, elem_bytes, ep, imb) * tokens * micro_batches * (1 + recomputed / 3)
    sent = ep_bytes_per_step(int(tokens), args.dim, args.n_active_experts, args.moe_layers, ep, micro_batches,
                             elem_bytes, recomputed)
    exchange_s = sent * imb / link_bytes_s
    if ep > 1:
        exchange_s += EP_SYNC_S * args.moe_layers * micro_batches * (1 + recomputed)
    recompute_s = expert_s * recomputed / 3
    return MoeTerms(model_params(args), model_params(args, active=True), ep, imb, rows, eff, expert_s, recompute_s,
                    routing / MEMORY_BYTES_S[device], sent, exchange_s,
                    EP_OVERLAP * min(exchange_s, expert_s + recompute_s))


def expert_parallel_sizes(args: ModelArgs, dp: int) -> list[int]:
    """The expert-parallel sizes a layout of `dp` data-parallel ranks can take: 1, and for a mixture of experts every
    ep > 1 that divides both dp and n_experts."""
    return [1] + [ep for ep in range(2, dp + 1) if args.moe_layers and dp % ep == 0 and args.n_experts % ep == 0]


def describe_moe(t: MoeTerms) -> str:
    """One line for the plan's printout."""
    line = (f"mixture of experts: {t.total_params / 1e9:.2f}B parameters, {t.active_params / 1e9:.2f}B active a token; "
            f"grouped GEMMs at {t.grouped_efficiency:.2f} of the dense rate ({t.rows_per_expert:,.0f} rows an expert), "
            f"{t.expert_s + t.recompute_s:.3f} s, routing {t.routing_s:.3f} s")
    if t.ep > 1:
        line += (f"; ep {t.ep}: all-to-all {t.all_to_all_bytes / 1e9:.2f} GB a step, {t.all_to_all_s:.3f} s "
                 f"(imbalance {t.imbalance:g}), {t.hidden_s:.3f} s of it hidden behind the experts")
    return line
