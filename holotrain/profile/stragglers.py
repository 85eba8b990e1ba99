"""Straggler detection: which rank is slowing the job down, and in which phase of the step.

At each logged step (never in between) every rank contributes a short vector: its step time over the interval, its
time per step in each phase (the phase clock's `time.*`), when it began each phase on average, and where this rank
samples its own GPU, the mean SM clock, power and power-capped share (`hw.*`). One all-gather of that vector is the
whole cost. Rank 0 then compares each rank's phase times with the median rank's.

Why not step times: in a synchronous job the others wait for a slow rank inside the collectives, so every rank's
step takes as long as the straggler's. What differs is where the time goes. The slow rank spends it in the phase it
is slow in; the others spend it waiting in the next phase that holds a collective, which they begin before the slow
rank does. So a rank's excess over the median in a phase counts only after taking off the time it may have waited
there for a rank that began the phase after it: what is left is its own. A rank is a straggler in a phase when its
own excess there is over `profile.straggler_margin` of the median and over a floor (a few milliseconds on small steps,
a share of the step on large ones), at two logged steps in a row: one stall (a page fault storm, a late packet) is
not a straggler.

The first logged interval (compilation, warm-up) is not compared. With pipeline stages, which differ in work, a rank is
compared only with the ranks of its own stage.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from holotrain.parallel import DistEnv

# Top-level phases compared (a fixed order, so that every rank's vector has the same layout).
PHASES = ("data_wait", "forward", "backward", "optimizer", "pipeline", "offload_wait")
HW_KEYS = ("hw.sm_clock_mhz", "hw.power_w", "hw.power_capped_frac")
FLOOR_S = 0.010  # an excess under 10 ms is scheduler noise on the small steps of a loaded CPU run
FLOOR_STEP_SHARE = 0.02  # ... and under 2% of the step on large ones
CONFIRM = 2  # logged steps in a row over the margin (same rank, same phase) before a rank is named
RANK_LISTS_MAX = 256  # per-rank lists in the metrics row (rank.step_s, rank.time.*) up to this many ranks


def _vector_keys() -> list[str]:
    return (["step_s"] + [f"time.{p}" for p in PHASES] + [f"began.{p}" for p in PHASES] + list(HW_KEYS))


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def find_stragglers(records: list[dict], margin: float, stages: int = 1) -> list[dict]:
    """The ranks slower than the median in a phase this interval, worst first; at most one phase per rank (its worst).

    records: one dict per rank (index = rank) with `step_s`, `time.<phase>` (seconds per step), `began.<phase>` (mean
    host time the phase began) and `hw.*`, any of them missing or NaN. `stages`: pipeline stages; ranks are compared
    within their stage (rank // (ranks / stages))."""
    if margin <= 0:
        return []
    per_stage = max(1, len(records) // max(1, stages))
    found = []
    for first in range(0, len(records), per_stage):
        group = list(range(first, min(len(records), first + per_stage)))
        if len(group) >= 2:
            found.extend(_in_group(records, group, margin))
    return sorted(found, key=lambda s: -(s["ratio"] if s["ratio"] is not None else math.inf))


def _in_group(records: list[dict], group: list[int], margin: float) -> list[dict]:
    steps = [records[r].get("step_s") for r in group if _finite(records[r].get("step_s"))]
    floor = max(FLOOR_S, FLOOR_STEP_SHARE * _median(steps)) if steps else FLOOR_S
    worst: dict[int, dict] = {}
    for phase in PHASES:
        key, began_key = f"time.{phase}", f"began.{phase}"
        timed = [r for r in group if _finite(records[r].get(key))]
        if len(timed) < 2:
            continue
        median = _median([records[r][key] for r in timed])
        for r in timed:
            seconds = records[r][key]
            # The longest it may have waited here: until the last of the other ranks began this phase.
            mine = records[r].get(began_key)
            others = [records[q].get(began_key) for q in timed if q != r and _finite(records[q].get(began_key))]
            waited = max(0.0, max(others) - mine) if _finite(mine) and others else 0.0
            own = seconds - median - waited
            if own > max(margin * median, floor) and (r not in worst or own > worst[r]["own_s"]):
                worst[r] = {"rank": r, "phase": key, "ratio": seconds / median if median > 0 else None,
                            "seconds": seconds, "median_s": median, "own_s": own, **_hardware(records, group, r)}
    return list(worst.values())


def _hardware(records: list[dict], group: list[int], rank: int) -> dict:
    """The rank's clock, power and capped share beside the median's: only where every rank of the group measured its
    own (with one sampler for a node's cards, the figures are the node's, not a rank's)."""
    out = {}
    for key in HW_KEYS:
        values = [records[r].get(key) for r in group]
        if all(_finite(v) for v in values):
            name = key[len("hw."):]
            out[name], out[f"median_{name}"] = records[rank][key], _median(values)
    return out


def describe(s: dict) -> str:
    """One console line: "rank 3 is 1.8x the median in time.forward (412 ms vs 229 ms), SM clock ..."."""
    times = f"{s['seconds'] * 1000:.0f} ms vs {s['median_s'] * 1000:.0f} ms a step"
    ratio = f"{s['ratio']:.2f}x the median" if s["ratio"] is not None else "over the median"
    parts = [f"rank {s['rank']} is {ratio} in {s['phase']} ({times})"]
    if "sm_clock_mhz" in s:
        parts.append(f"SM clock {s['sm_clock_mhz']:.0f} MHz vs {s['median_sm_clock_mhz']:.0f} median")
    if "power_w" in s:
        parts.append(f"power {s['power_w']:.0f} W vs {s['median_power_w']:.0f} median")
    if "power_capped_frac" in s:
        parts.append(f"power-capped {s['power_capped_frac'] * 100:.0f}% of the time")
    return ", ".join(parts)


class StragglerCheck:
    """Gathers the ranks' vectors at each logged step and names stragglers on rank 0's console and in its row."""

    def __init__(self, margin: float, env: DistEnv):
        self.margin, self.env = margin, env
        self.on = margin > 0 and env.world_size > 1
        self._intervals = 0
        self._streak: dict[tuple[int, str], int] = {}  # (rank, phase) -> logged steps in a row over the margin
        self._named: set[tuple[int, str]] = set()  # named at the last logged step

    def __call__(self, row: dict, began: dict[str, float], stages: int = 1) -> dict:
        """Collective: every rank calls it at the same logged step. Returns rank 0's row fields (other ranks: {})."""
        self._intervals += 1
        if not self.on or self._intervals == 1:  # the first interval compiles and warms up
            return {}
        mine = {**row, **{f"began.{p}": t for p, t in began.items()}}
        keys = _vector_keys()
        vector = torch.tensor([_float(mine.get(k)) for k in keys], dtype=torch.float64, device=self.env.device)
        gathered = torch.empty(self.env.world_size * len(keys), dtype=torch.float64, device=self.env.device)
        dist.all_gather_into_tensor(gathered, vector)
        if not self.env.is_main:
            return {}
        table = gathered.view(self.env.world_size, len(keys)).tolist()
        records = [dict(zip(keys, values)) for values in table]
        found = find_stragglers(records, self.margin, stages)
        named = self._confirm(found)
        out = {"straggler.rank": named[0]["rank"] if named else None,
               "straggler.phase": named[0]["phase"] if named else None,
               "straggler.ratio": named[0]["ratio"] if named else None,
               "stragglers": [{k: v for k, v in s.items() if k != "own_s"} for s in named]}
        if len(records) <= RANK_LISTS_MAX:
            out["rank.step_s"] = [_or_none(r["step_s"]) for r in records]
            for p in PHASES:
                if any(_finite(r[f"time.{p}"]) for r in records):
                    out[f"rank.time.{p}"] = [_or_none(r[f"time.{p}"]) for r in records]
        return out

    def _confirm(self, found: list[dict]) -> list[dict]:
        """The stragglers over the margin CONFIRM logged steps in a row; a line on the console when one is named,
        and when it is back within the margin."""
        now = {(s["rank"], s["phase"]): s for s in found}
        self._streak = {k: self._streak.get(k, 0) + 1 for k in now}
        named = [s for k, s in now.items() if self._streak[k] >= CONFIRM]
        for s in named:
            if (s["rank"], s["phase"]) not in self._named:
                print(f"holotrain: straggler: {describe(s)}", flush=True)
        for rank, phase in sorted(self._named - set(now)):
            print(f"holotrain: straggler: rank {rank} is back within the margin in {phase}", flush=True)
        self._named = {(s["rank"], s["phase"]) for s in named}
        return named


def _float(v) -> float:
    return float(v) if _finite(v) else math.nan


def _or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None
