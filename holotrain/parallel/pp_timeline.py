"""Bubble accounting of pipeline steps: when each of this rank's stage actions ran, and which share of the step the
rank sat idle, beside the share the bubble model predicts from the same actions' times.

`StageTimeline(pipeline)` wraps, as attributes of the instances (the classes are untouched), the methods through
which torch.distributed.pipelining's schedules run a stage's work:

  PipelineStage.forward_one_chunk(mb)                            F  the stage's forward of micro-batch mb
  PipelineStage.backward_one_chunk(mb, full_backward=True)       B  its whole backward
  PipelineStage.backward_one_chunk(mb, full_backward=False)      I  the input half (zero-bubble schedules)
  PipelineStage.backward_weight_one_chunk(mb)                    W  the weight half

and, on the schedule, `step` (the step's start and end) and `_compute_loss`, which the schedule calls right after
the last stage's forward: the loss (final norm, output head, cross-entropy) is counted in that forward, as the bubble
model counts a stage's forward. The 1f1b schedule holds its one stage as `schedule._stage`, the multi-stage ones as
`schedule._stages`. The wrappers only read the clock around the original call, so results are unchanged; `off()`
removes them, and a pipeline that was never switched on carries none.

Times are seconds from the step's start on this rank: time.perf_counter on CPU; on a GPU, CUDA events on the
current stream (what the device ran, not when the host launched it), read when a figure is asked for, at log time.
Waiting for a peer's activations or gradients falls between actions, so it is idle; so is the time after this
rank's last action until its schedule.step returns.

A rank's step is from the schedule's step call to its return. A rank that finishes its part early then waits for the
others in the loss's all-reduce that follows, so the pipeline's step is its longest rank's: the pipeline's bubble
share is 1 - (sum of busy) / (pp x longest wall), the same definition as the simulator's (plan/pipeline.py).
Comparing ranks' times needs them to start together: `barrier=True` puts a barrier of the pipeline group before each
step's clock starts (for measurement; the trainer's steps already leave the ranks close, after the gradient norm's
all-reduce).

`gather()` collects every pipeline rank's last step on the group's rank 0, and `write(path, gathered)` stores it as
RUN_DIR/pipeline_timeline.json, the report's input:

  {"version": 1, "schedule", "pp", "micro_batches", "stages_per_rank", "step" (the training step or null),
   "clock": "host" | "cuda",
   "ranks": [{"rank", "stages": [stage ids], "wall_s", "busy_s"}],
   "events": [{"rank", "stage", "kind": "F" | "B" | "I" | "W", "micro", "start", "end"}],   seconds from the step's
                                                                                            start on that rank
   "stage_times_s": {"F" | "B" | "I" | "W": [mean seconds per micro-batch of each stage, or null]},  in that
                                                                                            step
   "step_s": longest wall, "measured_bubble_share", "predicted_bubble_share" (the simulator fed with
   stage_times_s), "textbook_bubble_share" (the closed form with equal stages and F = B = W; (p-1)/(m+p-1) for
   1f1b)}
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from holotrain.parallel.pp import _SCHEDULE_CLASSES, stages_per_rank
from holotrain.plan.pipeline import bubble_share_formula, predicted_bubble_share

__all__ = ["KINDS", "StageTimeline", "bubble_figures", "write"]

KINDS = ("F", "B", "I", "W")
FORMAT_VERSION = 1

_STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
_SCHEDULE_METHODS = ("step", "_compute_loss")


class _HostClock:
    name = "host"

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        return end - start


class _CudaClock:
    name = "cuda"

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


class _Step:
    """One step as recorded: clock marks, turned into seconds from the start when first read."""

    def __init__(self, start):
        self.start, self.end = start, None
        self.actions: list[list] = []  # [stage, kind, micro, start mark, end mark]
        self._resolved: tuple[float, list[tuple[int, str, int, float, float]]] | None = None

    def resolve(self, clock) -> tuple[float, list[tuple[int, str, int, float, float]]]:
        if self._resolved is None:
            actions = [(s, k, i, clock.seconds(self.start, a), clock.seconds(self.start, b))
                       for s, k, i, a, b in self.actions]
            self._resolved = (clock.seconds(self.start, self.end), actions)
            self.actions = []  # the marks (CUDA events) are no longer needed
        return self._resolved


def _schedule_name(schedule) -> str:
    for name, cls in _SCHEDULE_CLASSES.items():
        if type(schedule) is cls:
            return name
    raise ValueError(f"no holotrain schedule name for {type(schedule).__name__}")


class StageTimeline:
    """Records this rank's stage actions of each step of `pipeline` (a parallel.pp.Pipeline) while switched on.

    keep: how many of the latest steps are held (older ones are dropped). The figures' `step` argument indexes
    them, -1 the latest."""

    def __init__(self, pipeline, keep: int = 20, barrier: bool = False):
        self.pipeline = pipeline
        self.schedule = pipeline.schedule
        self.schedule_name = _schedule_name(self.schedule)
        self.stages = list(getattr(self.schedule, "_stages", None) or [self.schedule._stage])
        self.barrier = barrier
        self.clock = _CudaClock() if pipeline.device.type == "cuda" else _HostClock()
        self.steps: deque[_Step] = deque(maxlen=keep)
        self._current: _Step | None = None
        self._wrapped: list[tuple[object, str]] = []

    # -- switching

    @property
    def enabled(self) -> bool:
        return bool(self._wrapped)

    def on(self) -> StageTimeline:
        if self.enabled:
            return self
        for obj, name in [(s, m) for s in self.stages for m in _STAGE_METHODS] + \
                         [(self.schedule, m) for m in _SCHEDULE_METHODS]:
            if name in vars(obj):
                self.off()
                raise RuntimeError(f"{type(obj).__name__}.{name} is already wrapped on this instance")
            setattr(obj, name, self._wrapper(obj, name, getattr(obj, name)))
            self._wrapped.append((obj, name))
        return self

    def off(self) -> StageTimeline:
        for obj, name in self._wrapped:
            delattr(obj, name)  # the instance attribute: the class's method shows through again
        self._wrapped.clear()
        self._current = None
        return self

    def clear(self) -> None:
        """Drops the recorded steps (e.g. the warm-up's)."""
        self.steps.clear()

    def _wrapper(self, obj, name: str, original):
        clock = self.clock
        if name == "step":
            def step(*args, **kwargs):
                if self.barrier:
                    dist.barrier(group=self.pipeline.group)
                record = self._current = _Step(clock.mark())
                try:
                    return original(*args, **kwargs)
                finally:
                    record.end = clock.mark()
                    self._current = None
                    self.steps.append(record)
            return step

        if name == "_compute_loss":
            def compute_loss(*args, **kwargs):
                loss = original(*args, **kwargs)
                record = self._current
                if record is not None and record.actions and record.actions[-1][1] == "F":
                    record.actions[-1][4] = clock.mark()  # the loss belongs to the forward just run
                return loss
            return compute_loss

        stage_index = obj.stage_index

        def action(chunk_id, *args, **kwargs):
            record = self._current
            if record is None:  # outside a recorded step (an eval, say)
                return original(chunk_id, *args, **kwargs)
            if name == "forward_one_chunk":
                kind = "F"
            elif name == "backward_weight_one_chunk":
                kind = "W"
            else:  # backward_one_chunk(chunk, loss=None, full_backward=True, last_backward=False)
                full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                kind = "B" if full else "I"
            start = clock.mark()
            out = original(chunk_id, *args, **kwargs)
            record.actions.append([stage_index, kind, chunk_id, start, clock.mark()])
            return out
        return action

    # -- this rank's figures

    def __len__(self) -> int:
        return len(self.steps)

    def _step(self, step: int):
        if not self.steps:
            raise IndexError("no step recorded (is the timeline on?)")
        return self.steps[step].resolve(self.clock)

    def wall_s(self, step: int = -1) -> float:
        """Seconds from the step's start on this rank to the end of its schedule.step."""
        return self._step(step)[0]

    def busy_s(self, step: int = -1) -> float:
        """Seconds this rank spent in stage actions during the step."""
        return sum(end - start for _, _, _, start, end in self._step(step)[1])

    def bubble_share(self, step: int = -1) -> float:
        """This rank's idle share of its own step: 1 - busy / wall."""
        wall = self.wall_s(step)
        return 1.0 - self.busy_s(step) / wall if wall > 0 else 0.0

    def events(self, step: int = -1) -> list[dict]:
        """The step's actions on this rank, in the order run, as JSON-able dicts."""
        rank = self.pipeline.group.rank()
        return [{"rank": rank, "stage": s, "kind": k, "micro": i, "start": a, "end": b}
                for s, k, i, a, b in self._step(step)[1]]

    def action_means(self, step: int | None = None) -> dict[str, dict[int, float]]:
        """Mean seconds of one action, per kind and stage, in `step` (None: over the held steps):
        {"F": {stage: seconds}, ...}."""
        sums: dict[tuple[str, int], list[float]] = {}
        for i in range(len(self.steps)) if step is None else [step]:
            for s, k, _, a, b in self._step(i)[1]:
                acc = sums.setdefault((k, s), [0.0, 0])
                acc[0] += b - a
                acc[1] += 1
        out: dict[str, dict[int, float]] = {}
        for (k, s), (total, n) in sorted(sums.items()):
            out.setdefault(k, {})[s] = total / n
        return out

    # -- the whole pipeline

    def gather(self, group: dist.ProcessGroup | None = None, step: int = -1) -> dict | None:
        """Every pipeline rank's `step` on rank 0 of `group` (default the pipeline's group; any backend, a gloo
        group keeps the objects off the GPU). A collective: every rank of the group calls it. Returns the gathered
        dict (write()'s input) on that rank, None on the others.

        Its stage times are that step's own means: the ranks' speeds drift from step to step (on CPUs by a fifth),
        and the slowest stage of the step sets its pace, so the model is fed the times of the step it is compared
        with."""
        group = group if group is not None else self.pipeline.group
        mine = {"rank": self.pipeline.group.rank(), "stages": [s.stage_index for s in self.stages],
                "wall_s": self.wall_s(step), "busy_s": self.busy_s(step), "events": self.events(step),
                "means": self.action_means(step)}
        first = dist.get_rank(group) == 0
        out = [None] * dist.get_world_size(group) if first else None
        dist.gather_object(mine, out, group=group, group_dst=0)
        if not first:
            return None
        out.sort(key=lambda r: r["rank"])
        pp = len(out)
        n_stages = pp * stages_per_rank(self.schedule_name)
        times: dict[str, list[float | None]] = {k: [None] * n_stages for k in KINDS}
        for r in out:
            for kind, per_stage in r["means"].items():
                for s, seconds in per_stage.items():
                    times[kind][int(s)] = seconds
        return {"schedule": self.schedule_name, "pp": pp, "micro_batches": self.pipeline.n_microbatches,
                "stages_per_rank": stages_per_rank(self.schedule_name), "clock": self.clock.name,
                "ranks": [{k: r[k] for k in ("rank", "stages", "wall_s", "busy_s")} for r in out],
                "events": [e for r in out for e in r["events"]],
                "stage_times_s": {k: v for k, v in times.items() if any(t is not None for t in v)}}


def bubble_figures(gathered: dict, p2p_s: float = 0.0) -> dict:
    """From gather()'s dict: the step (longest rank's wall), the measured bubble share, the simulator's for the
    measured stage times (None where a stage's time is missing; each transfer between ranks taking p2p_s) and the
    closed form's for equal stages."""
    ranks, pp, m = gathered["ranks"], gathered["pp"], gathered["micro_batches"]
    schedule = gathered["schedule"]
    step_s = max(r["wall_s"] for r in ranks)
    measured = 1.0 - sum(r["busy_s"] for r in ranks) / (pp * step_s) if step_s > 0 else 0.0
    times = gathered.get("stage_times_s") or {}
    forward = times.get("F")
    split = "I" in times or "W" in times
    backward, weight = (times.get("I"), times.get("W")) if split else (times.get("B"), 0.0)
    predicted = None
    if forward and backward and weight is not None and \
            all(t is not None for t in [*forward, *backward, *(weight if split else [])]):
        predicted = predicted_bubble_share(schedule, pp, m, forward, backward, weight, p2p_s)
    return {"step_s": step_s, "measured_bubble_share": measured, "predicted_bubble_share": predicted,
            "textbook_bubble_share": bubble_share_formula(schedule, pp, m)}


def write(path, gathered: dict, step: int | None = None) -> dict:
    """Writes gather()'s dict, with bubble_figures() and the training `step`, as JSON to `path` (atomically: a
    report reading it meanwhile sees the previous file whole). Returns what it wrote."""
    doc = {"version": FORMAT_VERSION, "step": step, **gathered, **bubble_figures(gathered)}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return doc


TIMELINE_FILE = "pipeline_timeline.json"


def log_step(model, run_dir, step: int) -> dict:
    """At a logged training step, under pipeline stages (`model` a PipelineModel whose timeline is on): the last
    step gathered over each pipeline group, written to RUN_DIR/pipeline_timeline.json by rank 0, and its bubble
    figures for the metrics row (rank 0; {} elsewhere and without stages). Collective over the pipeline groups."""
    timeline = getattr(model, "timeline", None)
    if timeline is None or not len(timeline):
        return {}
    gathered = timeline.gather()
    if gathered is None or dist.get_rank() != 0:
        return {}
    doc = write(Path(run_dir) / TIMELINE_FILE, gathered, step)
    return {"pp.bubble_share": doc["measured_bubble_share"], "pp.bubble_share_model": doc["predicted_bubble_share"],
            "pp.bubble_share_textbook": doc["textbook_bubble_share"]}
