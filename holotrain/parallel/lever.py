"""The parallel lever as the trainer sees it: the job's device mesh, tensor and context parallelism applied to the
plain model, and FSDP2 over the data-parallel ranks. Built from the `parallel` section alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from holotrain.parallel.cp import apply_cp
from holotrain.parallel.dp import apply_fsdp
from holotrain.parallel.launch import DistEnv, device_mesh, fsdp_mesh
from holotrain.parallel.tp import apply_tp

if TYPE_CHECKING:
    from holotrain.config import ParallelConfig


class Parallel:
    def __init__(self, section: ParallelConfig, env: DistEnv):
        if section.pp > 1:
            from holotrain.errors import ConfigError

            raise ConfigError("parallel.pp > 1: `holotrain train` does not run pipeline stages yet; set parallel.pp = 1")
        self.section, self.env = section, env
        self.mesh = device_mesh(env, section.tp, section.cp, section.pp)  # (["pp",] "dp"[, "cp"][, "tp"]); None on one process
        self.cp_mode = None  # the context-parallel mode in use, once applied

    def apply_tp(self, model: nn.Module) -> None:
        """Splits each block over the tensor-parallel group: first, on the plain model."""
        if self.section.tp > 1:
            apply_tp(model, self.mesh["tp"], self.section)

    def apply_cp(self, model: nn.Module) -> None:
        """Splits each sequence over the context-parallel group: on the plain (or tensor-parallel) model."""
        if self.section.cp > 1:
            self.cp_mode = apply_cp(model, self.mesh["cp"], self.section.cp_mode, self.section.tp).mode

    def apply_fsdp(self, model: nn.Module, compute_dtype: torch.dtype) -> None:
        """Shards over the data-parallel ranks: last, after the compute levers (checkpointing, compilation)."""
        if self.env.world_size > 1:
            apply_fsdp(model, fsdp_mesh(self.mesh), compute_dtype, self.section.reshard_after_forward)

    def metrics(self, steps: int) -> dict:
        return {}

    def close(self) -> None:
        pass


def build(section: ParallelConfig, env: DistEnv) -> Parallel:
    return Parallel(section, env)
