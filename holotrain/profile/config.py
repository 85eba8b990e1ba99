"""The config's [profile] section: metrics, phase timings, traces and the report, and the checks on its own keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from holotrain.section import Section, need

WANDB_MODES = ("online", "offline", "disabled")
_WANDB_BAD_CHARS = set("/\\#?%:")  # not allowed in a W&B project or entity name


@dataclass
class ProfileConfig(Section):
    tensorboard: bool = True
    progress: bool = True  # rich progress bar when the terminal is interactive
    phases: bool = True  # time.forward/backward/optimizer per logged step (CUDA events, read at log time)
    trace_steps: list = field(default_factory=list)  # steps (1-based) captured by torch.profiler, e.g. [10, 11]
    trace_max_mb: float = 64.0  # a trace file larger than this keeps only its longest events
    report: bool = True  # write RUN_DIR/report.html when training ends
    straggler_margin: float = 0.2  # a rank this share over the median in a phase is named (stragglers.py); 0 = off
    # Weights & Biases (wandb_sink.py; pip install "holotrain[wandb]"): the main rank's metrics rows as a W&B run
    # named job.name, whose id is the run directory's run_id (a resumed run continues it); files in RUN_DIR/wandb/.
    wandb: bool = False
    wandb_project: str = "holotrain"  # the W&B project the run is logged to
    wandb_entity: str = ""  # the team or user; empty: the logged-in account's default
    wandb_mode: str = "online"  # online | offline (written to RUN_DIR/wandb/, `wandb sync` uploads it) | disabled

    def check(self) -> None:
        need(all(s > 0 for s in self.trace_steps),
             f"profile.trace_steps are 1-based step numbers, got {self.trace_steps}")
        need(len(self.trace_steps) <= 16,
             f"profile.trace_steps: at most 16 steps are traced, got {len(self.trace_steps)}")
        need(self.trace_max_mb > 0, f"profile.trace_max_mb must be positive, got {self.trace_max_mb}")
        need(self.straggler_margin >= 0,
             f"profile.straggler_margin must be >= 0 (0 = off), got {self.straggler_margin}")
        need(self.wandb_mode in WANDB_MODES,
             f"profile.wandb_mode must be one of {', '.join(WANDB_MODES)}, got {self.wandb_mode!r}")
        need(isinstance(self.wandb_project, str) and self.wandb_project.strip() != ""
             and len(self.wandb_project) <= 128 and not _WANDB_BAD_CHARS & set(self.wandb_project),
             f"profile.wandb_project must be a W&B project name (1-128 characters, none of / \\ # ? % :), "
             f"got {self.wandb_project!r}")
        need(isinstance(self.wandb_entity, str) and not _WANDB_BAD_CHARS & set(self.wandb_entity),
             f"profile.wandb_entity must be a W&B team or user name (none of / \\ # ? % :; empty: the account's "
             f"default), got {self.wandb_entity!r}")
