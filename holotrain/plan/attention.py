"""Attention's time for the cost model (plan/cost.py), apart from the GEMMs': it grows with the sequence length, runs
at its own kernels' rate, and with packed documents does only the work their mask leaves. And what context
parallelism (parallel/cp.py) adds to it: the ring's hops, or the all-to-alls.

  work       model/llama.py: attention_flops_per_token: the causal triangle, times the density the kernel visits
  density    the share of the causal triangle a micro-batch's kernel visits: 1 without a document boundary (the
             dense causal kernel, SDPA); with packed documents, flex_attention's visited 128 x 128 blocks of the
             triangle's (doc_density from document lengths, block_density from document ids)
  rate       the machine's measured attention rate (plan/machine.py: a causal SDPA forward and backward, FLOPs
             counted as above); flex_attention's document-masked kernel at FLEX_BLOCK_COST of the dense kernel's
             time per visited block, plus FLEX_ROW_COST blocks' time per row of query blocks; RING_SPEED for the
             ring's per-block kernels; the trials calibrate it (Calibration.attention_scale)
  cp         ring: per layer, cp - 1 hops of a K/V block forward (and again where the block is recomputed), and in
             backward K/V with its fp32 dK/dV, each hidden behind the attention on the block at hand where that
             takes longer, plus the last dK/dV back to its owner; alltoall: 4 all-to-alls a layer forward and 4
             backward (q, k, v and the output), exposed
"""

from __future__ import annotations

import math

import torch

from holotrain.model.costs import ATTENTION_FORWARD_SHARE, attention_flops_per_token, block_density  # noqa: F401

# flex_attention with a document BlockMask against the dense causal kernel (flash) at T = 32768 and 131072 with
# documents of 512, 2048 and 8192 tokens and of log-normal lengths, forward and backward, on an H200 (16 heads of 128;
# bench/flex_rate.py, bench/RESULTS.md "The time model on packed long rows"): each visited 128 x 128 block took 1.31
# times a dense block's time, and each row of query blocks 4.3 blocks' time more, within 6% of the eight
# measurements. The row term is what makes short documents slow: at 512 tokens a row visits 2.5 blocks.
FLEX_BLOCK_COST = 1.31
FLEX_ROW_COST = 4.3
# parallel/cp.py's ring runs each block pair through the memory-efficient SDPA kernel and merges the outputs in fp32:
# not measured; a prior the trials calibrate.
RING_SPEED = 0.5
# The attention rate's prior, as a share of the GEMM rate, where the machine did not measure it: that cuDNN causal
# kernel did a layer's 0.48 TFLOP (as attention_flops_per_token counts them) in 1.185 ms, 406 TFLOP/s, against the
# H200's 653 TFLOP/s of sustained GEMMs (bench/data/plan-h200/machine.json).
# On a CPU the model's masked SDPA computes the whole T x T square and keeps its probabilities (6 products of the
# square, not 7 of its causal half): 0.5 of the GEMM rate for that work, as the cost model had it before.
ATTENTION_SHARE = {"cuda": 0.62, "cpu": 0.5 * 7 / 12}
MASK_BLOCK = 128  # flex_attention's block (model/llama.py: doc_block_mask builds the BlockMask at its default)
LINK_LATENCY_S = 20e-6  # per collective or ring hop between the GPUs of a node


def doc_density(lengths, seq_len: int, block: int = MASK_BLOCK) -> float:
    """The share of a row's causal attention a document-masked kernel does, from the lengths of the row's documents
    in order (their sum is seq_len, or less with padding at the end). block > 0: flex_attention's, which visits every
    block of `block` x `block` (query, key) pairs that holds one pair of the same document, of the causal
    triangle's blocks; block 0: the exact share, the sum of the squared lengths over seq_len squared."""
    lengths = [int(n) for n in lengths if n > 0]
    if not block:
        return sum(n * n for n in lengths) / seq_len ** 2
    n_blocks = math.ceil(seq_len / block)
    starts = []  # the first token of the document that each token is in
    pos = 0
    for n in lengths:
        starts.extend([pos] * n)
        pos += n
    starts.extend(range(pos, n_blocks * block))  # padding: each token its own (it attends to itself)
    visited = sum(q - starts[q * block] // block + 1 for q in range(n_blocks))
    return visited / (n_blocks * (n_blocks + 1) / 2)


def flex_cost(density: float, seq_len: int, block: int = MASK_BLOCK) -> float:
    """flex_attention's time on a document-masked row of seq_len over the dense causal kernel's on a row of one
    document: its visited blocks (`density` of the causal triangle's) and its rows of query blocks, each at its
    cost in dense blocks."""
    n = math.ceil(seq_len / block)
    return FLEX_BLOCK_COST * density + FLEX_ROW_COST * 2 / (n + 1)


def attention_seconds(args, seq_len: int, tokens: float, rate: float, density: float, masked_share: float,
                      ring: bool = False) -> float:
    """Seconds of attention forward and backward for `tokens` tokens of sequences of seq_len at `rate` (the dense
    causal kernel's FLOP/s): micro-batches without a document boundary (1 - masked_share of them) on the dense
    kernel, the others on flex_attention over `density` of the triangle (flex_cost). The ring's blocks compute each
    pair they need whole, with a dense mask where documents meet, so it is counted at RING_SPEED over the whole
    triangle."""
    dense = attention_flops_per_token(args, seq_len) * tokens / rate
    if ring:
        return dense / RING_SPEED
    return dense * ((1 - masked_share) + masked_share * flex_cost(density, seq_len))


def cp_exposed_seconds(args, mode: str, cp: int, tp: int, micro: int, seq_len: int, accum: int, elem_bytes: int,
                       attention_s: float, recomputed_share: float, link_bytes_s: float) -> float:
    """Context parallelism's communication left exposed per step on one rank. `attention_s`: the rank's attention
    seconds a step, forward and backward, without recomputation; `recomputed_share`: the blocks recomputed whole
    (their forward's hops run again)."""
    if cp == 1:
        return 0.0
    layers = args.n_layers
    local = micro * seq_len / cp  # tokens of a micro-batch on this rank
    head_bytes = local * args.head_dim * elem_bytes  # one head's values of them
    per_layer = attention_s / accum / layers  # one micro-batch's attention a layer
    forward, backward = per_layer * ATTENTION_FORWARD_SHARE, per_layer * (1 - ATTENTION_FORWARD_SHARE)
    if mode == "ring":
        kv = 2 * head_bytes * args.n_kv_heads / tp  # the K and V block a hop carries
        dkv = kv / elem_bytes * 4  # its gradients travel in fp32
        hop_f = LINK_LATENCY_S + kv / link_bytes_s
        hop_b = LINK_LATENCY_S + (kv + dkv) / link_bytes_s
        fwd = (cp - 1) * max(0.0, hop_f - forward / cp)
        bwd = (cp - 1) * max(0.0, hop_b - backward / cp) + LINK_LATENCY_S + dkv / link_bytes_s
    else:
        moved = (cp - 1) / cp * head_bytes * (2 * args.n_heads + 2 * args.n_kv_heads) / tp  # q, k, v, output
        fwd = bwd = 4 * LINK_LATENCY_S + moved / link_bytes_s
    return accum * layers * (fwd * (1 + recomputed_share) + bwd)
