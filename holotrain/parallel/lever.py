"""The parallel lever as the trainer sees it: the job's device mesh, tensor, context and expert parallelism applied
to the plain model, pipeline stages cut from it, and FSDP2 over the data-parallel ranks. Built from the `parallel`
section alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from holotrain.parallel.cp import apply_cp
from holotrain.parallel.dp import apply_fsdp
from holotrain.parallel.dims import ParallelDims
from holotrain.parallel.ep import apply_ep
from holotrain.parallel.launch import DistEnv, fsdp_mesh
from holotrain.parallel.pp_timeline import StageTimeline
from holotrain.parallel.pp import PipelineModel, rank_stages, stage_bounds, stages_per_rank, unit_costs
from holotrain.parallel.tp import apply_tp

if TYPE_CHECKING:
    from holotrain.parallel.config import ParallelConfig
    from holotrain.model import ModelArgs


class Parallel:
    def __init__(self, section: ParallelConfig, env: DistEnv):
        self.section, self.env = section, env
        self.dims = ParallelDims.of(section, env.world_size)  # every size of the layout
        self.mesh = self.dims.build_mesh(env.device.type)  # (["pp",] "dp"[, "cp"][, "tp"]); None on one process
        self.cp_mode = None  # the context-parallel mode in use, once applied

    def apply_tp(self, model: nn.Module) -> None:
        """Splits each block over the tensor-parallel group: first, on the plain model."""
        if self.dims.tp > 1:
            apply_tp(model, self.mesh["tp"], self.section)

    def apply_cp(self, model: nn.Module) -> None:
        """Splits each sequence over the context-parallel group: on the plain (or tensor-parallel) model."""
        if self.dims.cp > 1:
            self.cp_mode = apply_cp(model, self.mesh["cp"], self.section.cp_mode, self.dims.tp).mode

    def apply_ep(self, model: nn.Module) -> None:
        """Splits each mixture-of-experts layer's experts over the expert-parallel group: on the plain model."""
        if self.dims.ep > 1:
            apply_ep(model, self.mesh["ep"])

    def apply_fsdp(self, model: nn.Module, compute_dtype: torch.dtype) -> None:
        """Shards over the data-parallel ranks: last, after the compute levers (checkpointing, compilation)."""
        if self.env.world_size > 1:
            apply_fsdp(model, fsdp_mesh(self.mesh), compute_dtype, self.section.reshard_after_forward,
                       expert_mesh=self.mesh["edp"] if self.dims.ep > 1 else None)

    def stage_units(self, args: ModelArgs, seq_len: int) -> tuple[list[int], list[tuple[int, int]], int]:
        """With parallel.pp > 1 (its schedule resolved): the stages this rank holds, each one's units (first, last)
        of [embedding, blocks, head] in the cost-balanced cut, and the pipeline's number of stages."""
        schedule, pp = self.section.pp_schedule, self.section.pp
        n_stages = pp * stages_per_rank(schedule)
        bounds = stage_bounds(unit_costs(args, seq_len), n_stages)
        ids = rank_stages(self.mesh["pp"].get_local_rank(), pp, schedule)
        return ids, [bounds[i] for i in ids], n_stages

    def pipeline(self, stage_models: list[nn.Module], stage_ids: list[int], n_stages: int,
                 n_microbatches: int) -> PipelineModel:
        """This rank's stages, every other lever applied to each, as one model driven by the pipeline schedule."""
        return PipelineModel(stage_models, stage_ids, n_stages, self.mesh["pp"], self.section.pp_schedule,
                             n_microbatches, self.env.device,
                             # Each step's stage actions timed (a clock read around each), the latest kept for the
                             # logged bubble.
                             timeline=lambda pipeline: StageTimeline(pipeline, keep=1).on())

    def metrics(self, steps: int) -> dict:
        return {}

    def close(self) -> None:
        pass


def build(section: ParallelConfig, env: DistEnv) -> Parallel:
    return Parallel(section, env)
