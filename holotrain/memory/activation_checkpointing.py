"""Activation checkpointing: recompute transformer blocks in backward instead of storing their activations.

Policies (`memory.activation_checkpointing`):
  "none"       every activation is kept for backward.
  "full"       every block is recomputed: a block keeps only its input (one [B, T, dim] tensor), at the cost
               of a second forward pass of every block (about +33% FLOPs).
  "selective"  every other block (0, 2, 4, ...) is recomputed: half the block activations of "none" for half
               the recompute of "full". Activation memory falls linearly with the share of recomputed blocks
               and so does the extra time, so this is the midpoint of that trade; at the memory peak (end of
               forward) all blocks' activations coexist, so which half is recomputed does not matter.
  "pointwise"  every block keeps its matmuls' and its attention's outputs and recomputes the rest in backward:
               the norms, the rotary embedding, the SwiGLU product and the residual sums, about 30% of what a
               Llama block keeps. No matmul runs twice; the recomputation is memory traffic, cheap but not free
               (POINTWISE_SHARE).
  "all-but-attention"
               every block is recomputed but its attention kernel, whose output (and softmax statistics) it keeps:
               a block holds its input and the attention's output, dim + q_dim values a token. At long sequences,
               where attention is most of a block's work, this recomputes the cheap part only (the projections, the
               feed-forward and the norms) at a little over "full"'s memory.
The booleans true / false are accepted as "full" / "none".

`memory.activation_checkpointing_segment` = k > 1 (with "full" on every block) keeps only every k-th block's input
through the step: backward re-runs each segment of k blocks from its input, keeping their inputs only, then
recomputes each block as "full" does. For one long sequence, where n_layers inputs no longer fit the GPU (nor the
rest in host memory), it holds n_layers / k of them plus k - 1 in flight, for one more forward of every block.

`memory.activation_checkpointing_blocks` = N > 0 applies "full", "pointwise" or "all-but-attention" to N blocks
spread evenly over the depth instead of every block: the memory saved falls in proportion, the time spent less so
(the planner's "how many blocks").
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

POLICIES = ("none", "full", "selective", "pointwise", "all-but-attention")
# The policies that take memory.activation_checkpointing_blocks (on N blocks spread over the depth).
SPREAD_POLICIES = ("full", "pointwise", "all-but-attention")
# "pointwise"'s recomputation (norms, rotary, SwiGLU: memory-bound) as a share of its blocks' time: the 1.4b at
# micro-batch 16 on an H200, compiled, ran 2.8% slower than with nothing recomputed (its loss in pieces aside).
POINTWISE_SHARE = 0.03
# Half of that cost stays when fewer blocks are "pointwise": on 7 and 8 of the 1.4b's 24 blocks (micro-batch 16,
# H200) the step ran 1.6% and 2.5% slower, not the 0.9-1.0% a proportional rule gives.
POINTWISE_FIXED = 0.5


def policy_blocks(policy: str, n_layers: int, blocks: int = 0) -> list[int]:
    """Indices of the blocks the policy applies to: `blocks` of them spread evenly over the depth, or with 0 the
    policy's own (every block for "full" and "pointwise", every other one for "selective", none for "none")."""
    if policy not in POLICIES:
        raise ValueError(f"unknown activation checkpointing policy {policy!r} (known: {', '.join(POLICIES)})")
    if policy == "none":
        return []
    if blocks and policy in SPREAD_POLICIES:
        return [i * n_layers // blocks for i in range(min(blocks, n_layers))]
    return list(range(0, n_layers, 2 if policy == "selective" else 1))


def checkpointed_blocks(policy: str, n_layers: int, blocks: int = 0) -> list[int]:
    """Indices of the blocks recomputed whole in backward (keeping only their input)."""
    return policy_blocks(policy, n_layers, blocks) if policy in ("full", "selective") else []


def pointwise_blocks(policy: str, n_layers: int, blocks: int = 0) -> list[int]:
    """Indices of the blocks that keep only their matmuls' and attention's outputs ("pointwise")."""
    return policy_blocks(policy, n_layers, blocks) if policy == "pointwise" else []


def attention_kept_blocks(policy: str, n_layers: int, blocks: int = 0) -> list[int]:
    """Indices of the blocks recomputed in backward but for their attention kernel ("all-but-attention")."""
    return policy_blocks(policy, n_layers, blocks) if policy == "all-but-attention" else []


def recomputed_blocks(policy: str, n_layers: int, blocks: int = 0) -> list[int]:
    """Indices of the blocks whose matmuls run again in backward: those recomputed whole and "all-but-attention"'s."""
    return sorted(checkpointed_blocks(policy, n_layers, blocks) + attention_kept_blocks(policy, n_layers, blocks))


def checkpointing_choices(n_layers: int, every_count: bool = False) -> list[tuple[str, int]]:
    """(policy, blocks): every policy on its own blocks, and "pointwise" and "all-but-attention" on a quarter, half
    and three quarters of the blocks, "full" on a quarter and three quarters (on half it is "selective").
    `every_count`: the spread policies on any number of blocks, for a choice by the memory plan alone (a plan costs
    milliseconds; the planner's trials of each would cost minutes)."""
    some = (range(1, n_layers) if every_count
            else sorted({n_layers // 4, n_layers // 2, 3 * n_layers // 4} - {0, n_layers}))
    return ([(policy, 0) for policy in POLICIES] + [(p, b) for p in ("pointwise", "all-but-attention") for b in some]
            + [("full", b) for b in some if b != n_layers // 2])


# A tiled feed-forward's tile (memory.ffn_tiles): the 1.4b's gate, up and product of 16384 tokens are 0.55 GB, and
# its GEMMs are still thousands of rows tall.
TILE_TOKENS = 16384


def long_sequence_choices(n_layers: int, seq_len: int) -> list[dict]:
    """Past what recomputation alone fits, the memory section's settings to try in turn: every block recomputed, its
    feed-forward tiled over the sequence (memory.ffn_tiles) where the sequence is longer than TILE_TOKENS, then the
    inputs of the first 1, 2, ... n_layers blocks on the host (memory.activation_offload_blocks): the GPU keeps as
    many as it holds. Then, where the host cannot take them either, recompute segments of segment_size() blocks
    (memory.activation_checkpointing_segment): one more forward of every block."""
    tiles = max(1, math.ceil(seq_len / TILE_TOKENS))
    full = {"activation_checkpointing": "full", "activation_checkpointing_blocks": 0, "ffn_tiles": tiles}
    return ([{**full, "activation_offload_blocks": k, "activation_checkpointing_segment": 1}
             for k in range(n_layers + 1)]
            + [{**full, "activation_offload_blocks": 0, "activation_checkpointing_segment": segment_size(n_layers)}])


def segment_size(n_layers: int) -> int:
    """The segment length that holds the fewest block inputs at once (kept plus in flight; about sqrt(n_layers),
    the shortest of equals). Every length re-runs every block once, so the fewest inputs cost no more time."""
    return min(range(2, max(2, n_layers) + 1), key=lambda k: (sum(segment_inputs(n_layers, k)), k))


def recompute_share(policy: str, n_layers: int, blocks_share: float = 1.0, blocks: int = 0) -> float:
    """The policy's cost in time: extra matmul work as a share of a step's, each recomputed block running its
    forward's matmuls (a third of their training FLOPs) again; its attention's forward again is the caller's to add
    (for checkpointed_blocks: "all-but-attention" keeps it). `blocks_share`: the blocks' share of the step's FLOPs
    (the output head is never recomputed: a quarter of a small model's FLOPs, 5% of a 1.4b's). A "pointwise" block
    runs no matmul again; its memory-bound recomputation is counted as POINTWISE_SHARE of the blocks' time when every
    block is "pointwise", with POINTWISE_FIXED of it whatever their number."""
    lean = len(pointwise_blocks(policy, n_layers, blocks)) / n_layers
    whole = len(recomputed_blocks(policy, n_layers, blocks)) / n_layers
    pointwise = POINTWISE_SHARE * (POINTWISE_FIXED + (1 - POINTWISE_FIXED) * lean) if lean else 0.0
    return (pointwise + whole / 3) * blocks_share


def pointwise_kept_share(dim: int, q_dim: int, kv_dim: int, ffn_dim: int) -> float:
    """The share of a block's activations that a "pointwise" block keeps. Per token a block keeps its input, two
    norms' outputs, q/k/v, the attention's output, the residual sum, gate, up and their product; "pointwise" keeps
    its input, q/k/v, the attention's and the output projection's outputs, gate and up."""
    return (2 * dim + 2 * q_dim + 2 * kv_dim + 2 * ffn_dim) / (4 * dim + 2 * q_dim + 2 * kv_dim + 3 * ffn_dim)


@functools.cache
def _attention_ops() -> frozenset:
    """Every attention kernel: SDPA's (flash, memory-efficient, cuDNN, the CPU's) and flex_attention."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return frozenset(ops | ({flex} if flex is not None else set()))


@functools.cache
def _kept_ops() -> frozenset:
    """The ops whose outputs "pointwise" keeps: the matmuls (FP8's scaled ones and the experts' grouped ones too) and
    every attention kernel."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm")
    return frozenset({getattr(aten, n).default for n in names if hasattr(aten, n)} | _attention_ops())


def grouped_gemms_kept(cuda: bool) -> bool:
    """Whether "pointwise" keeps the experts' GEMM outputs: the CPU's reference loop runs plain matmuls (kept); a GPU's
    torch._grouped_mm is kept where activation_checkpointing.py lists it, else the experts run again in backward."""
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    return not cuda or (op is not None and op.default in _kept_ops())


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


_KEEP = {"pointwise": _keep_matmuls, "all-but-attention": _keep_attention}  # the selective policies' per-op choice


def apply_activation_checkpointing(model: nn.Module, policy: str = "full", blocks: int = 0) -> None:
    """Wraps the policy's blocks of `model.layers` in place (non-reentrant checkpointing; a "pointwise" or
    "all-but-attention" block with a selective policy: torch.utils.checkpoint's per-op choice, which torch.compile
    honours)."""
    names = list(model.layers.keys())
    keep = _KEEP.get(policy)
    extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, keep)} if keep else {}
    for i in policy_blocks(policy, len(names), blocks):
        model.layers.register_module(names[i], checkpoint_wrapper(model.layers[names[i]], preserve_rng_state=False,
                                                                  **extra))


class Segments:
    """The model's run_blocks hook for memory.activation_checkpointing_segment = k: each run of k blocks under one
    more (non-reentrant) checkpoint around the blocks' own. Forward keeps the segment's input only; backward's first
    unpack re-runs the segment's blocks, each keeping its input. The re-run includes the segment's last block: torch's
    early stop ends a recomputation at its last saved tensor, and a block saves its input only when its forward (a
    compiled region, or its own checkpoint) has run."""

    saves_to_host = False

    def __init__(self, k: int):
        self.k = k

    def __call__(self, blocks: list[tuple[int, nn.Module]], h: torch.Tensor, *args) -> torch.Tensor:
        for start in range(0, len(blocks), self.k):
            group = [block for _, block in blocks[start:start + self.k]]
            if len(group) == 1 or not torch.is_grad_enabled():
                h = _run(group, h, *args)
            else:
                h = checkpoint(_run, group, h, *args, use_reentrant=False, preserve_rng_state=False)
        return h


def _run(group: list[nn.Module], h: torch.Tensor, *args) -> torch.Tensor:
    for block in group:
        h = block(h, *args)
    return h


def segment_recompute_share(n_layers: int, k: int) -> float:
    """The share of the blocks whose forward a segment's re-run adds (a third forward of a "full" block): every block
    of a segment of two or more."""
    if k <= 1:
        return 0.0
    rest = n_layers % k
    return (n_layers - (rest if rest == 1 else 0)) / n_layers


def segment_inputs(n_layers: int, k: int) -> tuple[int, int]:
    """(kept, in flight): the block inputs held through the step, and those a segment's re-run adds in backward."""
    if k <= 1:
        return n_layers, 0
    return math.ceil(n_layers / k), min(k, n_layers) - 1
