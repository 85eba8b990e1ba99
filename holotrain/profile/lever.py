"""The profiling lever as the trainer sees it: the step phase clock, torch.profiler traces of chosen steps, the
garbage collector's time (and the freezes that keep it off the hot path), the straggler check at logged steps, and the
report at the end of the run. Built from the `profile` section alone."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING

from holotrain.profile.compile_clock import CompileClock
from holotrain.profile.gc_clock import FULL_EVERY_STEPS, GcClock, freeze_long_lived, stop_full_collections, thaw
from holotrain.profile.goodput import Goodput
from holotrain.profile.metrics import MetricsLogger
from holotrain.profile.phases import PhaseClock
from holotrain.profile.stragglers import StragglerCheck
from holotrain.profile.trace import StepTracer
from holotrain.profile.wandb_sink import check_installed as check_wandb_installed
from holotrain.profile.wandb_sink import open_sink as open_wandb

if TYPE_CHECKING:
    from holotrain.profile.config import ProfileConfig
    from holotrain.parallel import DistEnv


class Profiler:
    def __init__(self, section: ProfileConfig, env: DistEnv, run_dir: Path):
        self.section, self.env, self.run_dir = section, env, Path(run_dir)
        # None without profile.phases: nothing is timed per phase
        self.clock = PhaseClock(env.device) if section.phases else None
        self.tracer = StepTracer(section.trace_steps, run_dir, env.rank, section.trace_max_mb, env.device.type == "cuda")
        self.goodput = Goodput()  # the whole process's wall time, accounted
        self.gc = GcClock()  # host.gc_s: the interpreter's collections, which stall the launch of GPU work
        self.compiling = CompileClock()  # host.compile_s: torch.compile's time, mostly the first step's
        self._gc_thresholds: tuple[int, ...] | None = None  # the interpreter's, while the trainer collects itself
        self._straggler_check = StragglerCheck(section.straggler_margin, env)
        self._refreeze = False
        if section.wandb:
            check_wandb_installed()  # every rank, at startup: one line now rather than after the model is built

    def logger(self, total_steps: int, start_step: int) -> MetricsLogger | None:
        """The metrics sinks (metrics.jsonl, TensorBoard, Weights & Biases, the terminal): the main rank's only."""
        if not self.env.is_main:
            return None
        sinks = (open_wandb(self.section, self.run_dir),) if self.section.wandb else ()
        return MetricsLogger(self.run_dir, total_steps, start_step, self.section.tensorboard, self.section.progress,
                             sinks)

    def before(self, step: int) -> None:
        self.tracer.before(step)

    def after(self, step: int) -> None:
        self.tracer.after(step)
        if self._gc_thresholds is not None and step % FULL_EVERY_STEPS == 0:
            gc.collect()

    def first_step_done(self) -> None:
        """Model, compiled graphs and optimizer state exist now and live for the run: out of the collector's walks."""
        freeze_long_lived()
        self._gc_thresholds = stop_full_collections()
        self._refreeze = True  # at the first logged step: what later steps compiled (gc_clock's note)

    def add(self, phase: str, seconds: float) -> None:
        """A duration measured elsewhere (waiting for data)."""
        if self.clock is not None:
            self.clock.add(phase, seconds)

    def metrics(self, steps: int) -> dict:
        """time.* per step since the last call (after the device is synchronized), host.gc_s and host.compile_s."""
        if self._refreeze:
            freeze_long_lived()
            self._refreeze = False
        return {**(self.clock.collect(steps) if self.clock is not None else {}), **self.gc.collect(steps),
                **self.compiling.collect(steps)}

    def stragglers(self, row: dict, stages: int = 1) -> dict:
        """Collective, at every logged step after metrics(): the ranks' phase times gathered in one all-gather; a rank
        slower than the median by profile.straggler_margin is named (console and straggler.* fields, rank 0's row),
        with the per-rank lists rank.step_s and rank.time.*. `stages`: pipeline stages (ranks compared within one)."""
        return self._straggler_check(row, self.clock.began if self.clock is not None else {}, stages)

    def close(self) -> None:
        self.tracer.close()
        self.gc.close()
        self.compiling.close()
        thaw(self._gc_thresholds)
        self._gc_thresholds = None

    def write_goodput(self, checkpoint_s: float) -> dict | None:
        """RUN_DIR/goodput.json with the whole process's breakdown (main rank), printed as one line."""
        if not self.env.is_main:
            return None
        g = self.goodput.write(self.run_dir, checkpoint_s)
        parts = ", ".join(f"{k[len('goodput.'):-2]} {v:.1f}" for k, v in g.items() if k.endswith("_s") and k != "goodput.wall_s")
        rate = f"{g['goodput']:,.0f}" if g["goodput"] is not None else "-"
        print(f"holotrain: goodput {rate} tokens/s over {g['goodput.wall_s']:.1f} s of wall time ({parts} s)", flush=True)
        return g

    def write_report(self) -> Path | None:
        """RUN_DIR/report.html (main rank, profile.report)."""
        if not (self.env.is_main and self.section.report):
            return None
        from holotrain.profile.report import write_report

        return write_report(self.run_dir)


def build(section: ProfileConfig, env: DistEnv, run_dir: Path) -> Profiler:
    return Profiler(section, env, run_dir)
