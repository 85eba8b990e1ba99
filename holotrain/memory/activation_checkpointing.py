"""Activation checkpointing: recompute transformer blocks in backward instead of storing their activations.

Policies (`memory.activation_checkpointing`):
  "none"       every activation is kept for backward.
  "full"       every block is recomputed: a block keeps only its input (one [B, T, dim] tensor), at the cost
               of a second forward pass of every block (about +33% FLOPs).
  "selective"  every other block (0, 2, 4, ...) is recomputed: half the block activations of "none" for half
               the recompute of "full". Activation memory falls linearly with the share of recomputed blocks
               and so does the extra time, so this is the midpoint of that trade; at the memory peak (end of
               forward) all blocks' activations coexist, so which half is recomputed does not matter.
The booleans true / false are accepted as "full" / "none".
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)

POLICIES = ("none", "full", "selective")


def checkpointed_blocks(policy: str, n_layers: int) -> list[int]:
    """Indices of the blocks a policy recomputes."""
    if policy == "full":
        return list(range(n_layers))
    if policy == "selective":
        return list(range(0, n_layers, 2))
    if policy == "none":
        return []
    raise ValueError(f"unknown activation checkpointing policy {policy!r} (known: {', '.join(POLICIES)})")


def recompute_share(policy: str, n_layers: int, blocks_share: float = 1.0) -> float:
    """The policy's cost in time: extra matmul work as a share of a step's, each recomputed block running its
    forward (a third of its training FLOPs) again. `blocks_share`: the blocks' share of the step's FLOPs (the output
    head is never recomputed: a quarter of a small model's FLOPs, 5% of a 1.4b's)."""
    return len(checkpointed_blocks(policy, n_layers)) / n_layers / 3 * blocks_share


def apply_activation_checkpointing(model: nn.Module, policy: str = "full") -> None:
    """Wraps the policy's blocks of `model.layers` in place (non-reentrant checkpointing)."""
    names = list(model.layers.keys())
    for i in checkpointed_blocks(policy, len(names)):
        block = model.layers[names[i]]
        model.layers.register_module(names[i], checkpoint_wrapper(block, preserve_rng_state=False))
