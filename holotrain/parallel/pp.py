"""Pipeline parallelism: the model cut into stages along its depth, one or two stages per rank of the "pp" mesh
dimension, micro-batches streamed through them by one of torch.distributed.pipelining's schedules.

The model is cut into units, [embedding, block 0 .. block n-1, head (final norm, output, loss)], and each stage
holds a contiguous run of them, chosen so that the costliest stage is as cheap as it can be (`stage_bounds`, over
`unit_costs`): a head over a large vocabulary weighs as much as several blocks, and a split by block count would
leave the last stage the bottleneck.

A stage is the plain model with the other units' modules removed (`stage_model`); the ones it keeps keep their
names, so its state_dict is the plain model's restricted to the stage, and a checkpoint written at one pipeline
degree loads at any other. The levers of the other dimensions (tensor and context parallelism, FSDP2 over "dp" and
"cp", compile, activation checkpointing) are applied to each stage model as to a whole one. Between stages each rank
passes its own share of the hidden state (its sequence-parallel block, its context-parallel chunks) to the rank of
the same tp and cp index on the next stage.

Schedules (`SCHEDULES`):
- "1f1b": one stage per rank, one forward then one backward in the steady state.
- "interleaved": interleaved 1F1B, two stages per rank in loop order (rank r holds r and r + pp): a smaller bubble
  for twice the point-to-point traffic.
- "zb1p": interleaved zero bubble, the same stages, backward split into its input and weight halves, the weight
  halves filling the bubble.
- "zbv": zero bubble in a V: rank r holds stages r and 2pp-1-r, so the first and the last stage share rank 0 and
  the turn at the bottom of the V needs no transfer (torch's schedule places stages that way; torchtitan #774).

What torch provides: the stages' transfers, the schedules and their split of the batch into micro-batches (keyword
arguments, here doc_ids, are split too and handed to every stage), FSDP2's deferred gradient reduction. What it
lacks and is here: the cost-balanced cut, the pruned stage models, the loss made to match holotrain's gradient
accumulation, the step's loss on every rank, and the gradient norm over all stages.
"""

from __future__ import annotations

import contextlib

import math
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor

from holotrain.errors import ConfigError
from holotrain.model import Decoder, Hooks, ModelArgs
from holotrain.model.costs import attention_flops_per_token, flops_per_token

SCHEDULES = ("1f1b", "interleaved", "zb1p", "zbv")
ZERO_BUBBLE = ("zb1p", "zbv")  # backward split into its input and weight halves

_SCHEDULE_CLASSES = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                     "zb1p": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}

# The embedding's lookup multiplies nothing; its cost is the bytes it moves per token: a row read and written
# forward (bf16), its gradient row read and added into the fp32 weight gradient backward, about 16 bytes per
# dimension, counted at the FLOPs a GPU does while it moves a byte (an H100's bf16 peak over its bandwidth, ~300).
_EMBEDDING_BYTES_PER_DIM = 16
_FLOPS_PER_BYTE = 300


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def stages_per_rank(schedule: str) -> int:
    _check_schedule(schedule)
    return 1 if schedule == "1f1b" else 2


def rank_stages(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages rank `pp_rank` of the pipeline group holds, in the order torch's schedule expects them: (r) for
    1f1b, loop order (r, r + pp) for interleaved and zb1p, a V (r, 2pp-1-r) for zbv."""
    n = stages_per_rank(schedule)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pipeline rank {pp_rank} out of range for pp = {pp}")
    if n == 1:
        return [pp_rank]
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank, pp_rank + pp]


def unit_costs(args: ModelArgs, seq_len: int, attention_density: float = 1.0,
               measured: list[float] | None = None) -> list[float]:
    """Training cost per token of each unit [embedding, block 0 .. n-1, head], in FLOPs: the blocks' linears and
    their attention (over the causal triangle, times `attention_density` for packed documents: see
    attention_flops_per_token), the head's projection onto the vocabulary, the embedding's memory traffic as FLOPs.

    `measured`: the units' costs as timed on the device (any unit, one value per unit), used as they are."""
    n_units = args.n_layers + 2
    if measured is not None:
        if len(measured) != n_units or any(not c > 0 for c in measured):
            raise ValueError(f"measured unit costs must be {n_units} positive values "
                             f"(embedding, {args.n_layers} blocks, head), got {measured}")
        return [float(c) for c in measured]
    head = 6 * args.dim * args.vocab_size
    block_linear = (flops_per_token(args, 0) - head) / args.n_layers  # seq_len 0: the linears alone
    block_attention = attention_flops_per_token(args, seq_len, attention_density) / args.n_layers
    embedding = _EMBEDDING_BYTES_PER_DIM * args.dim * _FLOPS_PER_BYTE
    return [float(embedding)] + [block_linear + block_attention] * args.n_layers + [float(head)]


def stage_bounds(costs: list[float], n_stages: int) -> list[tuple[int, int]]:
    """The cut of units 0 .. len(costs)-1 into `n_stages` contiguous, non-empty stages whose costliest stage costs
    least, as (first unit, last unit) pairs, both inclusive. Of the cuts that achieve it, the one with the smallest
    sum of squared stage costs (the other stages as even as they can be), by exact dynamic programming."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ConfigError(f"{n_stages} pipeline stages need at least as many units (embedding, blocks, head), "
                          f"the model has {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> float:  # units i .. j-1
        return prefix[j] - prefix[i]

    # best[k][j]: the least largest-stage cost of units 0 .. j-1 in k stages.
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):
            best[k][j] = min(max(best[k - 1][i], cost(i, j)) for i in range(k - 1, j))
    limit = best[n_stages][n] * (1 + 1e-9)

    # Among cuts with every stage within the limit, the least sum of squares; cut[k][j] the start of stage k.
    square = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    square[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):
            for i in range(k - 1, j):
                c = cost(i, j)
                if c <= limit and square[k - 1][i] + c * c < square[k][j]:
                    square[k][j], cut[k][j] = square[k - 1][i] + c * c, i
    bounds, j = [], n
    for k in range(n_stages, 0, -1):
        i = cut[k][j]
        bounds.append((i, j - 1))
        j = i
    return bounds[::-1]


def stage_model(model: Decoder, first_unit: int, last_unit: int) -> Decoder:
    """Prunes the plain `model` in place to the units first_unit .. last_unit (inclusive) of [embedding, blocks,
    head] and returns it: the embedding kept only on the first stage, the final norm and output only on the last,
    blocks outside removed from `layers` while the kept ones keep their keys (the plain model's parameter names).
    Its forward then takes the previous stage's hidden state (where it has no embedding) and returns its blocks'
    output. Build one plain model per stage (on "meta" it costs nothing) and prune it before any other lever."""
    n_layers = model.args.n_layers
    if not 0 <= first_unit <= last_unit <= n_layers + 1:
        raise ValueError(f"stage units {first_unit}..{last_unit} out of range for {n_layers + 2} units")
    whole = first_unit == 0 and last_unit == n_layers + 1
    if model.args.tie_embeddings and not whole:
        raise ConfigError("model.tie_embeddings shares the embedding's weight with the head, which pipeline "
                          "parallelism puts on different ranks: untie it or set parallel.pp = 1")
    return model.keep_units(first_unit, last_unit)


class Pipeline:
    """This rank's stages of the pipeline and the schedule that drives them.

    stage_models: this rank's pruned models (`stage_model`), in the order of `stage_ids` (`rank_stages`), other
    levers already applied. pp_mesh: the "pp" dimension of the job's mesh.

    Under FSDP2 the schedule defers every stage's gradient reduction to after its last micro-batch (the caller does
    not call set_requires_gradient_sync). Weights resharded after each forward are gathered again for every
    micro-batch's backward; reshard_after_forward=False keeps a stage's weights gathered through the step instead,
    and the zero-bubble schedules need it (set here).
    """

    def __init__(self, stage_models: list[Decoder], stage_ids: list[int], n_stages: int, pp_mesh: DeviceMesh,
                 schedule: str, n_microbatches: int, device: torch.device | str):
        pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        if n_stages != pp * stages_per_rank(schedule):
            raise ValueError(f"schedule {schedule!r} over pp = {pp} runs {pp * stages_per_rank(schedule)} stages, "
                             f"got n_stages = {n_stages}")
        if list(stage_ids) != rank_stages(pp_rank, pp, schedule) or len(stage_models) != len(stage_ids):
            raise ValueError(f"pipeline rank {pp_rank} of {schedule!r} holds stages "
                             f"{rank_stages(pp_rank, pp, schedule)}, got {list(stage_ids)} "
                             f"({len(stage_models)} models)")
        if not all(getattr(m, "pipeline_stage", False) for m in stage_models):
            raise ValueError("stage models must come from stage_model()")
        self.models, self.stage_ids, self.n_microbatches = list(stage_models), list(stage_ids), n_microbatches
        self.group = pp_mesh.get_group()
        self.device = torch.device(device)
        self.holds_first = 0 in stage_ids
        self.holds_last = n_stages - 1 in stage_ids
        last = stage_models[stage_ids.index(n_stages - 1)] if self.holds_last else None
        if isinstance(last, FSDPModule):
            # The schedule's loss_fn uses the head after the stage's forward has returned: its weights (the root's
            # FSDP group) must stay gathered until backward.
            last.set_reshard_after_forward(False, recurse=False)
        if schedule in ZERO_BUBBLE:
            for m in stage_models:
                if isinstance(m, FSDPModule):
                    # The split backward finds the weights to differentiate through the module's parameters when
                    # its input half starts; resharded after forward, those are FSDP2's shards, not the gathered
                    # weights the forward used, and the weight gradients would come out wrong.
                    m.set_reshard_after_forward(False)

        def micro_batch_loss(h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # As holotrain's gradient accumulation does: each micro-batch's mean loss over the count, summed by
            # backward; hence scale_grads=False below (torch would otherwise divide the gradients by the count).
            if last.hooks.sequence is None:
                return last.loss(h, targets) / n_microbatches
            # Context parallelism: this rank's share of the targets, its mean weighted as the decoder's forward does.
            targets, weight = last.hooks.sequence.split_targets(targets)
            return last.loss(h, targets) * weight / n_microbatches

        # A stage of the head alone returns its input as it came from the previous stage, a view of the transfer
        # buffer, which FSDP2 warns of at every step; only the loss function reads it, out of place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        stages = [PipelineStage(m, i, n_stages, self.device, group=self.group) for m, i in zip(stage_models, stage_ids)]
        cls = _SCHEDULE_CLASSES[schedule]
        self.schedule = cls(stages[0] if schedule == "1f1b" else stages, n_microbatches=n_microbatches,
                            loss_fn=micro_batch_loss, scale_grads=False)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of the step's batch [n_microbatches x micro, T] (every pipeline rank passes the same
        batch; tokens are read on the first stage, targets on the last, doc_ids on every stage). Leaves the
        gradients on the stage models (reduced over "dp" by FSDP2) and returns the mean over micro-batches of each
        one's mean loss, on every rank of the pipeline."""
        if tokens.shape[0] % self.n_microbatches:
            raise ValueError(f"a batch of {tokens.shape[0]} rows does not split into {self.n_microbatches} "
                             f"equal micro-batches")
        args = (tokens,) if self.holds_first else ()
        kwargs = {} if doc_ids is None else {"doc_ids": doc_ids}
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=targets if self.holds_last else None, losses=losses, return_outputs=False,
                           **kwargs)
        if self.holds_last:
            loss = torch.stack([t.detach().float() for t in losses]).sum()
        else:
            loss = torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.group)  # only the last stage's rank adds anything
        cp = self.models[0].hooks.sequence
        if cp is not None:  # each rank's loss is its weighted share of the sequence's: their mean is the sequence's
            dist.all_reduce(loss, group=cp.group)
            loss /= cp.size
        return loss


    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """The batch's micro-batches through the schedule forward only (validation); returns each micro-batch's mean
        loss over its targets [n_microbatches], on every rank of the pipeline."""
        args = (tokens,) if self.holds_first else ()
        kwargs = {} if doc_ids is None else {"doc_ids": doc_ids}
        losses: list[torch.Tensor] = []
        with _forward_only(self.schedule):
            self.schedule.eval(*args, target=targets if self.holds_last else None, losses=losses,
                               return_outputs=False, **kwargs)
        if self.holds_last:  # the loss function divided each by the count (training's accumulation)
            per = torch.stack([t.detach().float() for t in losses]) * self.n_microbatches
        else:
            per = torch.zeros(self.n_microbatches, device=self.device)
        dist.all_reduce(per, group=self.group)
        cp = self.models[0].hooks.sequence
        if cp is not None:
            dist.all_reduce(per, group=cp.group)
            per /= cp.size
        return per


@contextlib.contextmanager
def _forward_only(schedule):
    """A multi-stage schedule's actions less those of backward, for its eval(): torch's runtime schedules run every
    action of their order in eval mode too (and a backward without autograd state fails). Every rank drops the same
    kinds, so the forward sends and receives still pair up in order. Single-stage schedules (1f1b) skip backward in
    eval themselves."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if order is None:
        yield
        return
    from torch.distributed.pipelining.schedules import _ComputationType as C

    kept = {C.FORWARD, C.SEND_F, C.RECV_F, C.UNSHARD, C.RESHARD}

    def forward_actions(actions):
        out = []
        for a in actions:
            if a.computation_type == C.OVERLAP_F_B:
                out += [s for s in a.sub_actions or () if s.computation_type in kept]
            elif a.computation_type in kept:
                out.append(a)
        return out

    schedule.pipeline_order_with_comms = {r: forward_actions(acts) for r, acts in order.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


def grad_norm(stage_models: list[nn.Module], pp_mesh: DeviceMesh, norm_type: float = 2.0) -> torch.Tensor:
    """The gradient norm of the whole model: this rank's stages' gradients (DTensors, under FSDP2 or tensor
    parallelism, reduced over their own mesh), combined over the pipeline group. The same value on every rank."""
    grads = [p.grad for m in stage_models for p in m.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm = norm.float()
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        return norm
    power = norm ** norm_type
    dist.all_reduce(power, group=pp_mesh.get_group())
    return power ** (1.0 / norm_type)


def clip_grad_norm(stage_models: list[nn.Module], pp_mesh: DeviceMesh, max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    """Scales this rank's gradients so that the whole model's norm is at most `max_norm`; returns that norm
    (before clipping)."""
    norm = grad_norm(stage_models, pp_mesh, norm_type)
    params = [p for m in stage_models for p in m.parameters() if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class PipelineModel(nn.Module):
    """This rank's stages as the trainer, the optimizer and the checkpointer see one model.

    The stages' modules are registered again at the plain model's paths (`tok_embeddings` from the first stage,
    the union of the stages' `layers`, `norm` and `output` from the last), so `parameters()` and `state_dict()`
    hold this rank's share of the whole model under the whole model's names: a checkpoint written at one
    pipeline degree loads at any other, or without stages. The stage models themselves are not submodules.
    `step` runs one optimizer step's micro-batches through the schedule; `grad_norm` is the whole model's
    gradient norm, which the optimizer clips with."""

    def __init__(self, stage_models: list[Decoder], stage_ids: list[int], n_stages: int, pp_mesh: DeviceMesh,
                 schedule: str, n_microbatches: int, device: torch.device | str, timeline=None):
        super().__init__()
        self.pipeline = Pipeline(stage_models, stage_ids, n_stages, pp_mesh, schedule, n_microbatches, device)
        self.stages, self.pp_mesh, self.args = list(stage_models), pp_mesh, stage_models[0].args
        for name in ("tok_embeddings", "norm", "output"):
            setattr(self, name, next((getattr(m, name) for m in stage_models if getattr(m, name) is not None), None))
        blocks = sorted(((k, b) for m in stage_models for k, b in m.layers.items()), key=lambda kb: int(kb[0]))
        self.layers = nn.ModuleDict(blocks)
        # What levers ask to run after each step's backward (precision/lever.py), from every stage.
        self.hooks = Hooks()
        self.hooks.install("after_backward", [hook for m in stage_models for hook in m.hooks.after_backward],
                           "pipeline")
        count = torch.tensor([sum(p.numel() for p in self.parameters())], dtype=torch.int64, device=device)
        dist.all_reduce(count, group=pp_mesh.get_group())
        self.whole_model_params = int(count.item())  # every stage's, for the console and the metrics
        # timeline(pipeline): a pp_timeline.StageTimeline timing each step's stage actions, or None.
        self.timeline = timeline(self.pipeline) if timeline is not None else None

    def forward(self, *args, **kwargs):
        raise TypeError("a pipeline stage runs its micro-batches through PipelineModel.step, not forward")

    def step(self, micro_batches: list[tuple]) -> torch.Tensor:
        """Forward and backward of the step's micro-batches ((tokens, targets[, doc_ids]) each, as the data plane
        gives them); returns the step's loss (the mean of the micro-batches' mean losses) on every stage."""
        return self.pipeline.step(*_joined(micro_batches))

    def evaluate(self, micro_batches: list[tuple]) -> torch.Tensor:
        """Forward only (validation): each micro-batch's mean loss [len(micro_batches)], on every stage. The
        timeline (the bubble of training steps) does not record it."""
        timed = self.timeline is not None and self.timeline.enabled
        if timed:
            self.timeline.off()
        try:
            return self.pipeline.evaluate(*_joined(micro_batches))
        finally:
            if timed:
                self.timeline.on()

    def grad_norm(self) -> torch.Tensor:
        return grad_norm(self.stages, self.pp_mesh)


def _joined(micro_batches: list[tuple]) -> tuple:
    """(tokens, targets, doc_ids or None) of micro-batches joined into one batch."""
    tokens = torch.cat([b[0] for b in micro_batches])
    targets = torch.cat([b[1] for b in micro_batches])
    docs = [b[2] if len(b) > 2 else None for b in micro_batches]
    doc_ids = None
    if any(d is not None for d in docs):
        # A row without documents is one document: zeros, so that every micro-batch has the same inputs.
        doc_ids = torch.cat([d if d is not None else torch.zeros_like(b[0]) for d, b in zip(docs, micro_batches)])
    return tokens, targets, doc_ids
