"""The config's [profile] section: metrics, phase timings, traces and the report, and the checks on its own keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from holotrain.section import Section, need


@dataclass
class ProfileConfig(Section):
    tensorboard: bool = True
    progress: bool = True  # rich progress bar when the terminal is interactive
    phases: bool = True  # time.forward/backward/optimizer per logged step (CUDA events, read at log time)
    trace_steps: list = field(default_factory=list)  # steps (1-based) captured by torch.profiler, e.g. [10, 11]
    trace_max_mb: float = 64.0  # a trace file larger than this keeps only its longest events
    report: bool = True  # write RUN_DIR/report.html when training ends
    straggler_margin: float = 0.2  # a rank this share over the median in a phase is named (stragglers.py); 0 = off

    def check(self) -> None:
        need(all(s > 0 for s in self.trace_steps),
             f"profile.trace_steps are 1-based step numbers, got {self.trace_steps}")
        need(len(self.trace_steps) <= 16,
             f"profile.trace_steps: at most 16 steps are traced, got {len(self.trace_steps)}")
        need(self.trace_max_mb > 0, f"profile.trace_max_mb must be positive, got {self.trace_max_mb}")
        need(self.straggler_margin >= 0,
             f"profile.straggler_margin must be >= 0 (0 = off), got {self.straggler_margin}")
