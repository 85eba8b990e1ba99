"""The bubble model of pipeline schedules: for a schedule, pp ranks and m micro-batches, how long a step takes and which
share of it the ranks sit idle, from each stage's per-micro-batch times.

Terms. A rank holds v stages ("chunks": 1 for 1f1b, 2 for the others as parallel/pp.py runs them) of the model's
blocks. Per micro-batch a stage
runs its forward F, its backward for the input B and its backward for the weights W (B + W is the whole backward; the
schedules without a split run them together as one op). Below F, B and W are a rank's totals per micro-batch (all its
chunks) with every stage equal and no time on the links; the bubble is a step's idle time on each rank, and its share
of the step is bubble / (m (F + B + W) + bubble).

  1f1b         (p - 1)(F + B + W). The first rank waits for one micro-batch to go down the pipeline and back before
               its backwards start, and the last rank idles as long at the ends (Narayanan et al., SC'21, arXiv
               2104.04473, section 2.2.1: PipeDream-Flush's bubble is (p - 1) / m of the ideal step), so the share is
               (p - 1) / (m + p - 1).
  interleaved  (p - 1)(F + B + W) / v: each rank's chunk is 1/v of its layers, so the fill and drain are v times
               shorter (the same paper, section 2.2.2); the share is (p - 1) / (v m + p - 1).
  zb1p         (p - 1) max(F, B, F + B - W) / v. The backward on a stage waits only for B on the next stage, not for
               its W, and the Ws are deferred into what 1f1b leaves idle (Qi et al., ICLR'24, arXiv 2401.10241,
               section 2.1: ZB-H1's bubble, one stage a rank, is (p - 1)(F + B - W), a third of 1f1b's when
               F = B = W). A W cannot fill more than the idle slot beside it, so where W > F or W > B the F or B chain
               sets it; torch's ScheduleInterleavedZeroBubble with v stages a rank (parallel/pp.py runs two) shortens
               it v-fold like interleaving. The simulator below gives exactly this for m a multiple of p.
  zbv          (p - 1) F / 2 when F = B = W and m >= 2p - 1: every rank holds chunks i and 2p - 1 - i (a "V"), so the
               last stage is on the first rank and only the forward's start-up skew of one chunk per hop is left
               (arXiv 2401.10241, section 6). The paper's "zero" bubble also removes that skew by not synchronizing
               the ranks before the optimizer step (its post-validation); torch steps them together, so a step keeps
               it. For unequal F, B, W there is no closed form: the simulator says.

The simulator. Each rank runs its ops in the order torch.distributed.pipelining's schedules issue them; an op starts
when the rank is free and its inputs are there: F of micro-batch i on stage s after F of i on stage s - 1, the
backward (B, or B + W) on stage s after that on stage s + 1 (on the last stage, after its own F), W after its B, each
dependency between two ranks delayed by the point-to-point send's time. It measures the step (the last op's end) and
each rank's busy time, so it also gives the bubble where stage times differ (the last stage carries the output head)
and where sends take time. The orders: Schedule1F1B runs its own loop (_step_microbatches: p - s warm-up forwards on
stage s, then one backward and one forward in turn), which this module follows; the others build their op lists per
rank in torch's _calculate_single_rank_operations, called here on an instance made without its process group. The
same orders give the activation memory in flight: a micro-batch's activations are held on a stage from its F until
its backward ends (its W, when split: between B and W a stage keeps its linear layers' inputs and output gradients,
about as many values as the activations)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from holotrain.parallel.pp import SCHEDULES, ZERO_BUBBLE, stages_per_rank

__all__ = ["SCHEDULES", "ZERO_BUBBLE", "Order", "Timeline", "bubble_formula", "bubble_share_formula",
           "memory_order", "peak_in_flight", "pipeline_step", "predicted_bubble_share", "schedule_order", "simulate",
           "virtual_stages"]

Op = tuple[int, str, int]  # (stage, "F" | "B" | "I" | "W", micro-batch); "B" a whole backward, "I" its input half


@dataclass(frozen=True)
class Order:
    """A schedule's ops per rank in the order each rank runs them."""

    schedule: str
    pp: int
    micro_batches: int
    virtual: int
    ops: tuple[tuple[Op, ...], ...]  # per rank
    rank_of: tuple[int, ...]  # stage -> rank

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def split(self) -> bool:
        """Whether the backward runs as B (here "I") and W apart."""
        return any(kind == "I" for rank in self.ops for _, kind, _ in rank)


def virtual_stages(schedule: str, virtual: int | None = None) -> int:
    """Stages per rank: `virtual`, or as parallel/pp.py runs the schedule (one for 1f1b, else two)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
    v = stages_per_rank(schedule) if virtual is None else virtual
    if schedule == "1f1b" and v != 1:
        raise ValueError("1f1b holds one stage per rank")
    if schedule == "zbv" and v != 2:
        raise ValueError("zbv holds exactly two stages per rank")
    if v < 1:
        raise ValueError(f"stages per rank must be at least 1, got {v}")
    return v


def _1f1b(pp: int, m: int) -> tuple[tuple[Op, ...], ...]:
    out = []
    for s in range(pp):
        warmup = min(m, pp - s)
        ops: list[Op] = [(s, "F", i) for i in range(warmup)]
        forward = warmup
        for i in range(m):
            ops.append((s, "B", i))
            if forward < m:
                ops.append((s, "F", forward))
                forward += 1
        out.append(tuple(ops))
    return tuple(out)


def _bare(cls, **attributes):
    """A torch schedule object with only the attributes its ordering reads (its __init__ needs stages on a process
    group)."""
    obj = object.__new__(cls)
    for name, value in attributes.items():
        setattr(obj, name, value)
    return obj


def _torch_ops(schedule: str, pp: int, m: int, v: int) -> tuple[tuple[tuple[Op, ...], ...], tuple[int, ...]]:
    from torch.distributed.pipelining import schedules as S

    if schedule == "zbv":
        obj = _bare(S.ScheduleZBVZeroBubble, pp_group_size=pp, num_stages=2 * pp, _n_microbatches=m)
        mapping = S.generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        rank_of = tuple(mapping[s] for s in range(2 * pp))
    else:
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(f"{schedule} needs the micro-batches ({m}) to be a multiple of its rounds ({rounds})")
        cls = S.ScheduleInterleaved1F1B if schedule == "interleaved" else S.ScheduleInterleavedZeroBubble
        obj = _bare(cls, pp_group_size=pp, n_local_stages=v, _n_microbatches=m, number_of_rounds=rounds,
                    microbatches_per_round=m // rounds)
        rank_of = tuple(s % pp for s in range(pp * v))
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}
    ops = []
    for rank in range(pp):
        actions = obj._calculate_single_rank_operations(rank)
        ops.append(tuple((a.stage_index, kinds[a.computation_type.value], a.microbatch_index) for a in actions
                         if a is not None and a.computation_type.value in kinds))
    return tuple(ops), rank_of


@functools.lru_cache(maxsize=256)
def schedule_order(schedule: str, pp: int, micro_batches: int, virtual: int | None = None) -> Order:
    """The ops each rank runs for one step of `schedule` over pp ranks and `micro_batches` micro-batches."""
    v = virtual_stages(schedule, virtual)
    if pp < 1 or micro_batches < 1:
        raise ValueError(f"pp and the micro-batches must be positive, got {pp} and {micro_batches}")
    if schedule == "1f1b":
        return Order(schedule, pp, micro_batches, 1, _1f1b(pp, micro_batches), tuple(range(pp)))
    ops, rank_of = _torch_ops(schedule, pp, micro_batches, v)
    order = Order(schedule, pp, micro_batches, v, ops, rank_of)
    want = pp * v * micro_batches * (3 if order.split else 2)
    if sum(len(r) for r in ops) != want:
        raise RuntimeError(f"torch's {schedule} order has {sum(len(r) for r in ops)} ops, not {want}")
    return order


@dataclass
class Timeline:
    step_s: float  # the last op's end
    busy_s: list[float]  # per rank
    end: dict  # (stage, kind, micro-batch) -> end time

    @property
    def bubble_share(self) -> float:
        """The share of the ranks' time in the step that they sit idle."""
        return 1 - sum(self.busy_s) / (len(self.busy_s) * self.step_s) if self.step_s else 0.0

    def bubble_s(self, rank: int) -> float:
        return self.step_s - self.busy_s[rank]


def _per_stage(x, n: int) -> list[float]:
    if isinstance(x, (int, float)):
        return [float(x)] * n
    if len(x) != n:
        raise ValueError(f"{len(x)} stage times for {n} stages")
    return [float(t) for t in x]


def simulate(order: Order, forward, backward_input, backward_weight, p2p_s: float = 0.0) -> Timeline:
    """Runs `order` with each stage's per-micro-batch forward, backward-input and backward-weight seconds (scalars, or
    one per stage, stage 0 first); a dependency between two ranks waits p2p_s more (the send)."""
    n = order.n_stages
    f, b, w = (_per_stage(x, n) for x in (forward, backward_input, backward_weight))
    split, last, rank_of = order.split, n - 1, order.rank_of
    grad = "I" if split else "B"
    end: dict[Op, float] = {}
    free = [0.0] * order.pp
    busy = [0.0] * order.pp
    at = [0] * order.pp
    left = sum(len(r) for r in order.ops)
    while left:
        moved = False
        for rank, ops in enumerate(order.ops):
            while at[rank] < len(ops):
                s, kind, i = ops[at[rank]]
                if kind == "F":
                    dep = (s - 1, "F", i) if s else None
                elif kind == "W":
                    dep = (s, "I", i)
                else:
                    dep = (s + 1, grad, i) if s < last else (s, "F", i)
                start = free[rank]
                if dep is not None:
                    done = end.get(dep)
                    if done is None:
                        break
                    start = max(start, done + (p2p_s if rank_of[dep[0]] != rank else 0.0))
                took = f[s] if kind == "F" else w[s] if kind == "W" else b[s] if split else b[s] + w[s]
                end[(s, kind, i)] = free[rank] = start + took
                busy[rank] += took
                at[rank] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"the {order.schedule} order deadlocks (pp {order.pp}, {order.micro_batches} "
                               "micro-batches)")
    return Timeline(max(free), busy, end)


def peak_in_flight(order: Order, per_stage: Sequence[float] | float = 1.0) -> list[float]:
    """Per rank, the most activation memory held at once: `per_stage` (one micro-batch's on each stage, or 1 to count
    micro-batches of a chunk) taken at a forward and given back when that micro-batch's backward on the stage ends
    (its W, when split). Each rank runs its ops in order, so the order alone decides it."""
    sizes = _per_stage(per_stage, order.n_stages)
    return [max(sum(n * sizes[s] for s, n in zip(stages, counts)) for counts in peaks)
            for stages, peaks in _held_counts(order)]


@functools.lru_cache(maxsize=512)
def _held_counts(order: Order) -> tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], ...]:
    """Per rank: its stages, and each distinct count of micro-batches held per stage at a moment the memory can peak
    (the last forward before a release)."""
    release = "W" if order.split else "B"
    out = []
    for ops in order.ops:
        stages = tuple(sorted({s for s, _, _ in ops}))
        slot = {s: k for k, s in enumerate(stages)}
        held = [0] * len(stages)
        peaks, rising = set(), False
        for s, kind, _ in ops:
            if kind == "F":
                held[slot[s]] += 1
                rising = True
            elif kind == release:
                if rising:
                    peaks.add(tuple(held))
                rising = False
                held[slot[s]] -= 1
        if rising:
            peaks.add(tuple(held))
        out.append((stages, tuple(peaks) or ((0,) * len(stages),)))
    return tuple(out)


def memory_order(schedule: str, pp: int, micro_batches: int, virtual: int | None = None) -> Order:
    """An order whose in-flight peaks are those of `micro_batches`: beyond 4 x pp micro-batches (a multiple of pp) the
    schedules' warm-up no longer grows, so the shorter order of 4 x pp gives the same peaks."""
    m = micro_batches
    if m > 4 * pp and m % pp == 0:
        m = 4 * pp
    return schedule_order(schedule, pp, m, virtual)


def bubble_formula(schedule: str, pp: int, micro_batches: int, forward: float, backward_input: float,
                   backward_weight: float, virtual: int | None = None) -> float | None:
    """The bubble's seconds per step in closed form (see the module's docstring; F, B, W a rank's totals per
    micro-batch, stages equal, sends free), or None for zbv with unequal F, B, W (simulate it)."""
    v = virtual_stages(schedule, virtual)
    p, F, B, W = pp, forward, backward_input, backward_weight
    if p == 1:
        return 0.0
    if schedule == "1f1b":
        return (p - 1) * (F + B + W)
    if schedule == "interleaved":
        return (p - 1) * (F + B + W) / v
    if schedule == "zb1p":
        return (p - 1) * max(F, B, F + B - W) / v
    if abs(F - B) <= 1e-12 * F and abs(F - W) <= 1e-12 * F and micro_batches >= 2 * p - 1:
        return (p - 1) * F / 2
    return None


def bubble_share_formula(schedule: str, pp: int, micro_batches: int, forward: float = 1.0,
                         backward_input: float = 1.0, backward_weight: float = 1.0,
                         virtual: int | None = None) -> float | None:
    """bubble_formula as a share of the step."""
    bubble = bubble_formula(schedule, pp, micro_batches, forward, backward_input, backward_weight, virtual)
    if bubble is None:
        return None
    return bubble / (micro_batches * (forward + backward_input + backward_weight) + bubble)


@dataclass
class PipelineStep:
    step_s: float
    bubble_share: float
    peak_micro_batches: list[float]  # per rank, in micro-batches of the rank's whole share of the layers


def pipeline_step(schedule: str, pp: int, micro_batches: int, forward: float, backward_input: float,
                  backward_weight: float, virtual: int | None = None, p2p_s: float = 0.0) -> PipelineStep:
    """A step of equal stages by the simulator: F, B, W a rank's totals per micro-batch, split over its chunks."""
    order = schedule_order(schedule, pp, micro_batches, virtual)
    v = order.virtual
    t = simulate(order, forward / v, backward_input / v, backward_weight / v, p2p_s)
    return PipelineStep(t.step_s, t.bubble_share, [x / v for x in peak_in_flight(order)])


def predicted_bubble_share(schedule: str, pp: int, micro_batches: int, forward: Sequence[float],
                          backward: Sequence[float], weight: Sequence[float] | float = 0.0,
                          p2p_s: float = 0.0) -> float:
    """The model's bubble share for a run's measured stage times, to set beside the bubble the run measured.

    Per stage, stage 0 first (pp x stages per rank of them, as parallel/pp.py runs `schedule`): the mean seconds of
    one micro-batch's forward (the last stage's with its loss), its backward (the whole backward where the schedule
    runs it as one op, the input half where it splits it) and its weight half (0 where the backward is not split).
    The simulator runs torch's order of the schedule with those times, so unequal stages and the costlier head are
    in the prediction, which the closed forms leave out."""
    order = schedule_order(schedule, pp, micro_batches)
    if not order.split and any(_per_stage(weight, order.n_stages)):
        raise ValueError(f"{schedule} runs each backward whole: give its time as `backward`, no weight half")
    return simulate(order, forward, backward, weight, p2p_s).bubble_share
