"""Activation checkpointing: recompute each transformer block in backward instead of storing its activations."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Wraps every block of `model.layers` in place (non-reentrant checkpointing)."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
