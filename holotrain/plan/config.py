"""The config's [plan] section: what `holotrain plan` optimizes and how long it may try, and the checks on its keys."""

from __future__ import annotations

from dataclasses import dataclass

from holotrain.section import Section, need


@dataclass
class PlanConfig(Section):
    """`holotrain plan` / `holotrain train --plan auto` (holotrain/plan/)."""

    objective: str = "tokens_per_s"  # tokens_per_s | j_per_token
    trials: int = 3  # the best predicted candidates run as short trials through `holotrain train`
    trial_steps: int = 8  # steps per trial; the first two (compilation, warm-up) are not timed
    seconds: float = 180.0  # planning budget: no trial starts that it would not finish (judged by the last one)

    def check(self) -> None:
        need(self.objective in ("tokens_per_s", "j_per_token"),
             f"plan.objective must be tokens_per_s or j_per_token, got {self.objective!r}")
        need(self.trials >= 0, f"plan.trials must be >= 0, got {self.trials}")
        need(self.trial_steps >= 3, f"plan.trial_steps must be >= 3 (two are not timed), got {self.trial_steps}")
        need(self.seconds > 0, f"plan.seconds must be positive, got {self.seconds}")
