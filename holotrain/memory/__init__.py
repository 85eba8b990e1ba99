"""The memory lever: activation checkpointing and offload, the chunked loss, the memory plan, and where the
optimizer runs.

The trainer enters it through `build(section, env)`; the returned `Memory` applies its compute-side choices to the
plain model and builds the optimizer (on the device, or the offload engine with `memory.offload`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from holotrain.memory import fit, plan
from holotrain.memory.activation_checkpointing import Segments, apply_activation_checkpointing
from holotrain.memory.activation_offload import ActivationOffload
from holotrain.optim import AdamWHyper, DeviceAdamW, StepOptimizer

if TYPE_CHECKING:
    from holotrain.memory.config import MemoryConfig
    from holotrain.parallel import DistEnv

__all__ = ["Memory", "apply_activation_checkpointing", "build", "build_optimizer"]


def build_optimizer(model: nn.Module, section: MemoryConfig, hyper: AdamWHyper, lr: float, env: DistEnv,
                    compute_dtype: torch.dtype, clock=None) -> StepOptimizer:
    """AdamW on the device, or with memory.offload the offload engine, which needs the run's compute dtype (the
    dtype of the working weights it keeps on the GPU)."""
    if section.offload:
        from holotrain.memory.offload import OffloadEngine

        return OffloadEngine(model, section, hyper, lr, env, compute_dtype, clock=clock)
    return DeviceAdamW(model, hyper, lr, sharded=env.world_size > 1, clock=clock, moments=section.adamw_moments)


class Memory:
    """memory.* applied to one job: built once from its section, entered once by the trainer."""

    def __init__(self, section: MemoryConfig, env: DistEnv):
        if section.offload_ratio == "auto":
            raise ValueError('memory.offload_ratio is "auto": resolve the config first (holotrain.train.resolve)')
        self.section, self.env = section, env
        self.activation_offload: ActivationOffload | None = None

    def check_fit(self, model: nn.Module, cfg: Any, micro: int, accum: int) -> None:  # cfg: the resolved job config
        """memory.check_fit: refuses, with the numbers and what would fit, a plan that cannot fit GPU or host memory.
        The plan is the job's cost model, so it reads the whole resolved config (model shape, batch, dtype)."""
        if self.section.check_fit:
            fit.check_fit(model, cfg, self.env.world_size, self.env.device, micro, accum,
                           local_ranks=self.env.local_world_size)

    def apply(self, model: nn.Module, vocab_parallel_loss: bool = False) -> None:
        """Activation checkpointing (with its segments) and offload, feed-forwards tiled over the sequence, and the loss in pieces, on the
        plain (or tensor-parallel) model. A vocabulary-parallel loss (tensor parallelism) holds 1/tp of the logits and
        is never chunked."""
        if self.section.activation_checkpointing != "none":
            apply_activation_checkpointing(model, self.section.activation_checkpointing,
                                           self.section.activation_checkpointing_blocks)
        if self.section.activation_offload_blocks:
            self.activation_offload = ActivationOffload(self.section.activation_offload_blocks, len(model.layers),
                                                        self.env.device, announce=self.env.is_main)
            model.hooks.install("run_blocks", self.activation_offload, "memory")
        if self.section.activation_checkpointing_segment > 1:
            model.hooks.install("run_blocks", Segments(self.section.activation_checkpointing_segment), "memory")
        if self.section.ffn_tiles > 1:
            model.tile_feed_forward(self.section.ffn_tiles)
        model.hooks.install("loss_chunk_tokens", 0 if vocab_parallel_loss else plan.chunk_tokens(self.section),
                            "memory")

    @property
    def host_built(self) -> bool:
        """Whether the model is materialized in host memory first: with offload on one device, the engine takes the
        fp32 values as its master weights and puts working copies on the device, so the GPU never holds fp32 copies
        of the offloaded weights. (FSDP2 shards are 1/N: they go to the device.)"""
        return self.section.offload and self.env.world_size == 1

    def optimizer(self, model: nn.Module, hyper: AdamWHyper, lr: float, compute_dtype: torch.dtype,
                  clock=None) -> StepOptimizer:
        return build_optimizer(model, self.section, hyper, lr, self.env, compute_dtype, clock)


def build(section: MemoryConfig, env: DistEnv) -> Memory:
    return Memory(section, env)
