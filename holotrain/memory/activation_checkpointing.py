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
The booleans true / false are accepted as "full" / "none".
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

POLICIES = ("none", "full", "selective", "pointwise")
# "pointwise"'s recomputation (norms, rotary, SwiGLU: memory-bound) as a share of its blocks' time: the 1.4b at
# micro-batch 16 on an H200, compiled, ran 2.8% slower than with nothing recomputed (its loss in pieces aside).
POINTWISE_SHARE = 0.03


def checkpointed_blocks(policy: str, n_layers: int) -> list[int]:
    """Indices of the blocks a policy recomputes."""
    if policy == "full":
        return list(range(n_layers))
    if policy == "selective":
        return list(range(0, n_layers, 2))
    if policy in ("none", "pointwise"):
        return []
    raise ValueError(f"unknown activation checkpointing policy {policy!r} (known: {', '.join(POLICIES)})")


def recompute_share(policy: str, n_layers: int, blocks_share: float = 1.0) -> float:
    """The policy's cost in time: extra matmul work as a share of a step's, each recomputed block running its
    forward (a third of its training FLOPs) again. `blocks_share`: the blocks' share of the step's FLOPs (the output
    head is never recomputed: a quarter of a small model's FLOPs, 5% of a 1.4b's). "pointwise" runs no matmul
    again; its memory-bound recomputation is counted as POINTWISE_SHARE of the blocks' time."""
    if policy == "pointwise":
        return POINTWISE_SHARE * blocks_share
    return len(checkpointed_blocks(policy, n_layers)) / n_layers / 3 * blocks_share


def kept_share(policy: str, dim: int, kv_dim: int, ffn_dim: int) -> float:
    """The share of a block's activations that a block the policy does not recompute keeps. Per token a block
    keeps its input, two norms' outputs, q/k/v, the attention's output, the residual sum, gate, up and their
    product; "pointwise" keeps its input, q/k/v, the attention's and the output projection's outputs, gate and up."""
    if policy != "pointwise":
        return 1.0
    return (4 * dim + 2 * kv_dim + 2 * ffn_dim) / (6 * dim + 2 * kv_dim + 3 * ffn_dim)


@functools.cache
def _kept_ops() -> frozenset:
    """The ops whose outputs "pointwise" keeps: the matmuls (FP8's scaled ones too) and every attention kernel."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return frozenset(ops | ({flex} if flex is not None else set()))


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _kept_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, policy: str = "full") -> None:
    """Wraps the policy's blocks of `model.layers` in place (non-reentrant checkpointing; "pointwise" wraps every
    block with a selective policy: torch.utils.checkpoint's per-op choice, which torch.compile honours)."""
    names = list(model.layers.keys())
    if policy == "pointwise":
        context = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
        for name in names:
            model.layers.register_module(name, checkpoint_wrapper(model.layers[name], preserve_rng_state=False,
                                                                  context_fn=context))
        return
    for i in checkpointed_blocks(policy, len(names)):
        block = model.layers[names[i]]
        model.layers.register_module(names[i], checkpoint_wrapper(block, preserve_rng_state=False))
