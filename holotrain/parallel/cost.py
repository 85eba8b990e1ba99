"""What parallelism costs, for the planner (holotrain/plan): the bytes each rank moves per step, and the share of a
micro-batch's activations a rank keeps under tensor parallelism.

Tensor parallelism (tp.py), per block and micro-batch: the attention and FFN inputs are all-gathered into their
column-parallel GEMMs and the two row-parallel outputs reduce-scattered, each a [tokens, dim] bf16 tensor of
which a rank sends and receives (tp - 1) / tp; backward mirrors forward. With `tp_overlap = "none"` these are
exposed. FSDP2 (dp.py) all-gathers the bf16 weights for forward and again for backward and reduce-scatters the
fp32 gradients: 8 bytes per parameter of the rank's TP share, (dp - 1) / dp of it over the links, overlapped with
compute by its prefetching except for the first block's gather."""

from __future__ import annotations


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
