"""What a model of given arguments costs per token: training FLOPs (MFU's count), attention's T x T work as the kernels
do it (the time model's), and parameters and saved values per block (the memory plan's units). The levers and the
planner read these, never a family's modules."""

from __future__ import annotations

import math

import torch

from holotrain.model.args import ModelArgs
from holotrain.model.parts import doc_positions


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training (forward + backward) FLOPs per token.

    Matrix multiplies only, counted exactly from the shapes: 6 FLOPs per weight of every linear layer a token goes
    through (the output head included, the embedding lookup not; of a mixture of experts the router, the token's
    n_active_experts experts and the shared experts: its active weights), plus attention's two T x T products,
    12 * n_layers * q_dim * seq_len (q_dim = n_heads * head_dim, the model's width in most families), counted over
    the full square as PaLM and torchtitan do (the causal kernels skip about half of it, so MFU by this convention
    matches theirs). A sliding window is not counted off: MFU stays comparable across families.
    """
    linear = sum(_linear_params(args, i, active=True) for i in range(args.n_layers)) + args.dim * args.vocab_size
    return 6 * linear + 12 * args.n_layers * args.q_dim * seq_len


def _attention_linear_params(args: ModelArgs) -> int:
    return args.dim * (2 * args.q_dim + 2 * args.kv_dim)


def _ffn_linear_params(args: ModelArgs, layer: int, active: bool) -> int:
    """Weights of block `layer`'s feed-forward: the SwiGLU's three, or a mixture of experts' router, experts (all, or
    the n_active_experts a token goes through) and shared experts."""
    if not args.moe_layer(layer):
        return 3 * args.dim * args.ffn_dim
    experts = args.n_active_experts if active else args.n_experts
    return args.dim * args.n_experts + 3 * args.dim * (experts * args.moe_ffn_dim + args.shared_ffn_dim)


def _linear_params(args: ModelArgs, layer: int, active: bool) -> int:
    return _attention_linear_params(args) + _ffn_linear_params(args, layer, active)


def _mean_over_blocks(args: ModelArgs, per_block) -> int:
    """A per-block figure: the blocks' own when all are alike, else their mean (rounded up), so that n_layers times
    it counts them all (a mixture of experts with dense blocks between)."""
    values = [per_block(i) for i in range(args.n_layers)] or [per_block(0)]
    return -(-sum(values) // len(values))


def block_linear_params(args: ModelArgs) -> int:
    """Weights of one block's linear layers (biases and norms aside): q, k, v, o and the SwiGLU's three; of a
    mixture of experts every expert's (block_active_params: those a token uses)."""
    return _mean_over_blocks(args, lambda i: _linear_params(args, i, active=False))


def _block_params(args: ModelArgs, layer: int, active: bool) -> int:
    bias = (args.q_dim + 2 * args.kv_dim) * args.qkv_bias + args.dim * args.out_bias
    if not args.moe_layer(layer):
        bias += (2 * args.ffn_dim + args.dim) * args.mlp_bias
    norms = 2 * args.dim + 2 * args.head_dim * args.qk_norm
    return _linear_params(args, layer, active) + bias + norms


def block_params(args: ModelArgs) -> int:
    """Every parameter of one block: its linears (a mixture of experts: all its experts), their biases, its norms
    (the blocks' mean where dense and mixture-of-experts blocks alternate)."""
    return _mean_over_blocks(args, lambda i: _block_params(args, i, active=False))


def block_active_params(args: ModelArgs) -> int:
    """The parameters of one block a token goes through (block_params less the experts it is not routed to): a
    mixture of experts' compute per token, as a dense block's is all of its parameters."""
    return _mean_over_blocks(args, lambda i: _block_params(args, i, active=True))


def model_params(args: ModelArgs, active: bool = False) -> int:
    """The model's parameters (active: those one token goes through, the embedding row aside as a lookup counted
    whole, as model cards count "activated parameters")."""
    blocks = sum(_block_params(args, i, active) for i in range(args.n_layers))
    head = 0 if args.tie_embeddings else args.dim * args.vocab_size
    return blocks + args.dim * args.vocab_size + head + args.dim


def block_saved_values(args: ModelArgs) -> int:
    """Values per token one block keeps for backward (no recomputation), the memory plan's unit: the two norms'
    inputs and the residual (3 x dim), q, k, v and the attention's output (2 q_dim + 2 kv_dim, plus q and k once more
    when they are normalized per head), the gate and up projections (2 x ffn_dim). A Llama of equal kv and query
    heads keeps 7 dim + 2 ffn_dim. A mixture-of-experts block counts its attention part here and its feed-forward,
    whose tensors are of several dtypes, in bytes (moe_saved_bytes). The blocks' mean."""
    attention = 2 * args.q_dim + 2 * args.kv_dim + (args.q_dim + args.kv_dim) * args.qk_norm
    return _mean_over_blocks(args, lambda i: 3 * args.dim + attention + (0 if args.moe_layer(i) else 2 * args.ffn_dim))


def _moe_mean(args: ModelArgs, per_moe_block: float) -> float:
    """A mixture-of-experts block's figure as the mean over all blocks (dense ones count 0)."""
    return per_moe_block * args.moe_layers / max(1, args.n_layers)


def moe_saved_bytes(args: ModelArgs, elem_bytes: int, compiled: bool = False, imbalance: float = 1.0) -> float:
    """Bytes per token a mixture-of-experts feed-forward keeps for backward (model/moe.py's forward; the mean over the
    blocks, dense ones 0; block_saved_values counts the rest of the block). With k = n_active_experts, E = n_experts,
    e = elem_bytes, as tests/test_plan_moe.py measures them with saved_tensors_hooks, eager and compiled (inductor):
      the router's input (dim x e), its fp32 scores (4 E: the softmax's or sigmoid's output) and the top-k's expert
      indices (8 k); with norm_topk_prob the fp32 weights before the division (4 k), eager also their sum (4);
      permute's row index (8 k) and the sorted copies the experts' GEMMs read (k x dim x e);
      per copy the experts' gate, silu(gate), up and product (4 x moe_ffn_dim x e; compiled 3: silu recomputed);
      unpermute's index (8 k), the experts' outputs (k x dim x e, index_copy's source) and, eager, the copies in token
      order and the k weights in e (k x dim x e + k x e) for the weighted sum (compiled recomputes them);
      the shared experts' SwiGLU (4, compiled 3, x shared_ffn_dim x e);
      with the auxiliary losses in the gradient (either coefficient > 0) the z-loss's fp32 copy of the logits and
      their logsumexp (4 E + 4), and a sigmoid router's per-token score sums (4).
    `imbalance` (expert parallelism): the busiest rank's token copies over the mean; its experts' rows scale by it."""
    if not args.moe_layers:
        return 0.0
    k, E, D, e, n_f = args.n_active_experts, args.n_experts, args.dim, elem_bytes, 3 if compiled else 4
    router = D * e + 4 * E + 16 * k + (4 * k + 4 * (not compiled)) * args.norm_topk_prob
    experts = k * imbalance * (D + n_f * args.moe_ffn_dim) * e
    unpermute = 8 * k + k * D * e + (0 if compiled else k * D * e + k * e)
    weighted = args.moe_aux_loss_coef > 0 or args.router_z_loss_coef > 0  # both losses' graphs kept (MoE.record)
    extra = n_f * args.shared_ffn_dim * e + (4 * E + 4 + 4 * (args.router == "sigmoid")) * weighted
    return _moe_mean(args, router + experts + unpermute + extra)


def moe_pointwise_bytes(args: ModelArgs, elem_bytes: int, grouped_kept: bool = True) -> float:
    """Bytes per token a mixture-of-experts feed-forward keeps where only the matmuls' outputs are kept (memory's
    "pointwise" checkpointing; the blocks' mean): the router's logits (E), the experts' gate, up and down outputs
    (k x (2 moe_ffn_dim + dim)) when the grouped GEMMs are among the kept ops, the shared experts' (2 x shared_ffn_dim
    + dim)."""
    if not args.moe_layers:
        return 0.0
    k, S = args.n_active_experts, args.shared_ffn_dim
    experts = k * (2 * args.moe_ffn_dim + args.dim) if grouped_kept else 0
    return _moe_mean(args, (args.n_experts + experts + (2 * S + args.dim if S else 0)) * elem_bytes)


RESIDUAL_GRADS = 3  # [T, dim] gradients alive together in a block's backward: its output's, the residual's, its input's


def block_backward_bytes(args: ModelArgs, elem_bytes: int, imbalance: float = 1.0) -> float:
    """Bytes per token a block's backward makes beside what it keeps, for the largest block: the gradients of its
    output, of the residual stream between its halves and of its input, alive together in its norms' backward
    (3 dim), and of the FFN's gate and up (2 ffn_dim); a mixture of experts: the same 3 dim, of the copies in token
    order and their outputs (2 k dim), of the copies' rows, gate and up (k (dim + 2 moe_ffn_dim), x `imbalance`
    under expert parallelism), of the shared experts' gate and up and the fp32 scores' and logits' (8 E)."""
    dense = (RESIDUAL_GRADS * args.dim + 2 * args.ffn_dim) * elem_bytes if args.moe_layers < args.n_layers else 0
    if not args.moe_layers:
        return dense
    k, D = args.n_active_experts, args.dim
    moe = (RESIDUAL_GRADS * D + 2 * k * D + k * imbalance * (D + 2 * args.moe_ffn_dim)
           + 2 * args.shared_ffn_dim) * elem_bytes
    return max(dense, moe + 8 * args.n_experts)


def expert_params(args: ModelArgs, layer: int | None = None) -> int:
    """The routed experts' weights (w1, w3, w2 of every expert: 3 x n_experts x dim x moe_ffn_dim a MoE block) of
    block `layer`, or of the whole model: what expert parallelism splits over its ranks."""
    one = 3 * args.n_experts * args.dim * args.moe_ffn_dim
    return (one if args.moe_layer(layer) else 0) if layer is not None else one * args.moe_layers


def expert_flops_per_token(args: ModelArgs) -> int:
    """The part of flops_per_token that runs as the routed experts' grouped GEMMs: 6 FLOPs per weight of the k experts
    a token goes through, in every MoE block (the router and shared experts are plain GEMMs)."""
    return 6 * 3 * args.dim * args.moe_ffn_dim * args.n_active_experts * args.moe_layers


def attention_pairs(doc_ids: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | int:
    """Sum over the rows of a micro-batch [B, T] of the squared lengths of their documents (B * T^2 for rows of one
    document each, doc_ids None): the T x T work by the convention of flops_per_token, each document counted as its
    own sequence. A document of n tokens holds positions 0 .. n-1, and the sum of 2 i + 1 over them is n^2."""
    if doc_ids is None:
        return shape[0] * shape[1] ** 2
    return (2 * doc_positions(doc_ids) + 1).sum()


def block_density(doc_ids: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The share of the causal triangle's `block` x `block` blocks (flex_attention's) that the document mask of a
    micro-batch of document ids [B, T] (non-decreasing along T) visits, averaged over its rows (plan/attention.py:
    doc_density's block share), as a tensor on their device: no host synchronization (the trainer reads it at log
    time)."""
    B, T = doc_ids.shape
    n = math.ceil(T / block)
    if T % block:  # padding of the last block: ids above every document's
        pad = doc_ids[:, -1:] + 1 + torch.arange(n * block - T, device=doc_ids.device)
        doc_ids = torch.cat([doc_ids, pad], dim=1)
    blocks = doc_ids.view(B, n, block)
    first, last = blocks[:, :, 0].contiguous(), blocks[:, :, -1].contiguous()
    # Key blocks up to the query block's own that hold its first document (ids never decrease: the key block's last
    # id reaches it).
    reach = torch.searchsorted(last, first)  # per query block, the first key block whose last id >= its first id
    visited = (torch.arange(n, device=doc_ids.device) - reach + 1).sum(dim=1).float()
    return (visited / (n * (n + 1) / 2)).mean()


ATTENTION_FORWARD_SHARE = 2 / 7  # of attention_flops_per_token: forward's 2 of the 7 T x T products


def attention_flops_per_token(args: ModelArgs, seq_len: int, density: float = 1.0) -> float:
    """Training FLOPs per token of attention's T x T products as the kernels do them (the time model's, not MFU's):
    over the causal triangle only (a token meets seq_len / 2 keys on average), times `density`, the share of that
    triangle the kernel visits (1 for a row of one document; with packed documents about the sum of their squared
    lengths over seq_len squared, counted in the kernel's blocks). Forward runs 2 products (scores, then values),
    backward 5 (flash-style kernels recompute the scores): 7 of 2 * n_heads * head_dim FLOPs per (query, key) pair
    and layer. A sliding window caps the keys a token meets at the window."""
    if args.sliding_window and args.sliding_window < seq_len:
        w = args.sliding_window  # keys per token: i + 1 up to w, then w
        keys = (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
        return 7 * 2 * args.n_layers * args.n_heads * args.head_dim * keys * density
    return 7 * 2 * args.n_layers * args.n_heads * args.head_dim * (seq_len / 2) * density
