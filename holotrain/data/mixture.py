"""Source mixture: weights (optionally scheduled over steps) and a deterministic deficit picker.

The next document comes from the source furthest behind its target share of tokens, so the realized
mixture tracks the weights to within one document at every step; its state is two counters per source.
"""

from __future__ import annotations

import bisect


def weight_at(weight: float, schedule: list, step: int) -> float:
    """Piecewise-linear in step through the schedule's [step, weight] points, constant beyond its ends."""
    if not schedule:
        return weight
    steps = [p[0] for p in schedule]
    i = bisect.bisect_right(steps, step)
    if i == 0:
        return float(schedule[0][1])
    if i == len(schedule):
        return float(schedule[-1][1])
    (s0, w0), (s1, w1) = schedule[i - 1], schedule[i]
    return float(w0 + (w1 - w0) * (step - s0) / (s1 - s0))


class Mixture:
    def __init__(self, weights: list[float], schedules: list[list]):
        self.weights, self.schedules = weights, schedules
        self.target = [0.0] * len(weights)  # tokens each source should have given so far
        self.actual = [0] * len(weights)  # tokens each source has given

    def shares(self, step: int) -> list[float]:
        w = [weight_at(wt, sch, step) for wt, sch in zip(self.weights, self.schedules)]
        total = sum(w)
        return [x / total for x in w]

    def pick(self) -> int:
        deficits = [t - a for t, a in zip(self.target, self.actual)]
        return max(range(len(deficits)), key=lambda i: (deficits[i], -i))

    def account(self, source: int, tokens: int, step: int) -> None:
        for i, share in enumerate(self.shares(step)):
            self.target[i] += share * tokens
        self.actual[source] += tokens

    def state_dict(self) -> dict:
        return {"target": list(self.target), "actual": list(self.actual)}

    def load_state_dict(self, state: dict) -> None:
        self.target = [float(x) for x in state["target"]]
        self.actual = [int(x) for x in state["actual"]]
