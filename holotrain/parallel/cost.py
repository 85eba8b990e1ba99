"""What parallelism costs, for the planner (holotrain/plan): the bytes each rank moves per step, and the share of a
micro-batch's activations a rank keeps under tensor parallelism.

Tensor parallelism (tp.py), per block and micro-batch: the attention and FFN inputs are all-gathered into their
column-parallel GEMMs and the two row-parallel outputs reduce-scattered, each a [tokens, dim] bf16 tensor of
which a rank sends and receives (tp - 1) / tp; backward mirrors forward. With `tp_overlap = "none"` these are
exposed. FSDP2 (dp.py) all-gathers the bf16 weights for forward and again for backward and reduce-scatters the
fp32 gradients: 8 bytes per parameter of the rank's TP share, (dp - 1) / dp of it over the links, overlapped with
compute by its prefetching except for the first block's gather.

Expert parallelism (ep.py), per mixture-of-experts layer and micro-batch: the token copies (tokens x top_k rows of dim)
go to their experts' ranks and back (dispatch and combine), and their gradients the same way in backward: four
all-to-alls, of which a rank sends (ep - 1) / ep with balanced routing. Routing is not balanced: the busiest rank of
a group receives EP_IMBALANCE times the mean of the copies (its experts' compute and memory, and the exchange, wait
for it). The expert weights are FSDP-sharded over the ep groups' ranks alike (dims.expert_dp of them), so their
gathers move ep times fewer bytes over expert_dp ranks (fsdp_ep_bytes_per_step)."""

from __future__ import annotations

# The busiest rank's token copies over the mean (max / mean) under expert parallelism: a prior, not yet measured with
# holotrain's routers. Load-balanced training keeps it near 1 (the auxiliary loss, or DeepSeek-V3's bias); published
# per-expert loads of trained routers run 1.05-1.3 over the mean and a rank's ep-th of the experts averages part of it.
EP_IMBALANCE = 1.1


def tp_bytes_per_step(tokens: int, dim: int, n_layers: int, tp: int, micro_batches: int) -> float:
    """Bytes a rank sends per step in tensor parallelism's collectives (2 all-gathers and 2 reduce-scatters per block
    in forward, as many in backward)."""
    if tp == 1:
        return 0.0
    return 8 * n_layers * tokens * dim * 2 * (tp - 1) / tp * micro_batches


def fsdp_bytes_per_step(n_params: int, dp: int, tp: int) -> float:
    """Bytes a rank moves per step in FSDP2's all-gathers (forward and backward, bf16) and reduce-scatter (fp32)."""
    if dp == 1:
        return 0.0
    return 8 * n_params / tp * (dp - 1) / dp


def tp_activation_share(tp: int) -> float:
    """A rank's share of a micro-batch's activations: the sequence-parallel regions keep 1/tp of the tokens, the
    gathered GEMM inputs saved for backward all of them (about half and half)."""
    return (1 + 1 / tp) / 2


def ep_bytes_per_step(tokens: int, dim: int, top_k: int, moe_layers: int, ep: int, micro_batches: int,
                      elem_bytes: int = 2, recomputed: float = 0.0) -> float:
    """Bytes a rank sends per step in expert parallelism's all-to-alls (mean routing): per mixture-of-experts layer
    and micro-batch of `tokens` (this rank's), dispatch and combine in forward and again in backward, each
    tokens x top_k x dim x elem_bytes x (ep - 1) / ep; `recomputed`, the share of the layers activation checkpointing
    runs forward again, adds that share of the forward's two."""
    if ep == 1:
        return 0.0
    return (4 + 2 * recomputed) * moe_layers * tokens * top_k * dim * elem_bytes * (ep - 1) / ep * micro_batches


def fsdp_ep_bytes_per_step(n_params: int, n_expert: int, dp: int, ep: int, expert_dp: int, tp: int = 1) -> float:
    """fsdp_bytes_per_step with expert parallelism: the `n_expert` expert weights (of `n_params`) gathered and reduced
    as a rank's ep-th over the expert_dp ranks that share it, the rest over all dp."""
    return fsdp_bytes_per_step(n_params - n_expert, dp, tp) + fsdp_bytes_per_step(n_expert // ep, expert_dp, tp)
