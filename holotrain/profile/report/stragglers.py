"""The report's straggler section (runs of several ranks): the stragglers the run named, each with the logged steps
it was named at, how much slower than the median rank it was and its GPU's clock where measured, and each rank's
step split into phases, averaged over the logged steps (the rows' `stragglers` and `rank.*` fields, written by
holotrain.profile.stragglers)."""

from __future__ import annotations

import math

from holotrain.profile.report.charts import OTHER_COLOR, PALETTE, PHASE_COLORS, _stacked_bars
from holotrain.profile.report.data import KNOWN_PHASES, _mean, _num
from holotrain.profile.report.markup import _figs, _fmt, _note, esc
from holotrain.profile.stragglers import CONFIRM, FLOOR_S, FLOOR_STEP_SHARE


def _step_ranges(steps: list[int], every: int) -> str:
    """[4, 6, 8, 14] logged every 2 steps -> "4-8, 14"."""
    out, start, prev = [], None, None
    for s in steps:
        if prev is not None and s - prev > every:
            out.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = None
        start = s if start is None else start
        prev = s
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ", ".join(out)


def _found(rows: list[dict]) -> dict[tuple[int, str], dict]:
    """(rank, phase) -> the logged steps it was named at, and its worst interval."""
    found: dict[tuple[int, str], dict] = {}
    for r in rows:
        for s in r.get("stragglers") or []:
            if not isinstance(s, dict):
                continue
            entry = found.setdefault((s.get("rank"), str(s.get("phase"))), {"steps": [], "worst": s})
            entry["steps"].append(r["step"])
            if _ratio(s) > _ratio(entry["worst"]):
                entry["worst"] = s
    return found


def _ratio(s: dict) -> float:
    """Times the median (infinite where the median rank spent no time in the phase)."""
    return _num(s.get("ratio")) or math.inf


def _per_rank_chart(rows: list[dict]) -> str:
    """A bar per rank: its mean seconds per step in each phase over the rows that carry per-rank lists."""
    listed = [r for r in rows if isinstance(r.get("rank.step_s"), list)]
    if not listed:
        return ""
    ranks = max(len(r["rank.step_s"]) for r in listed)
    keys = sorted({k for r in listed for k in r if k.startswith("rank.time.")},
                  key=lambda k: (KNOWN_PHASES.index(k[10:]) if k[10:] in KNOWN_PHASES else len(KNOWN_PHASES), k))

    def mean_of(key: str, rank: int) -> float | None:
        return _mean(r[key][rank] for r in listed if isinstance(r.get(key), list) and rank < len(r[key]))

    layers = []
    for i, key in enumerate(keys):
        phase = key[len("rank.time."):]
        layers.append((phase, [mean_of(key, q) for q in range(ranks)], PHASE_COLORS.get(phase, PALETTE[(i + 4) % 9])))
    other = []
    for q in range(ranks):
        step = mean_of("rank.step_s", q)
        other.append(None if step is None else max(0.0, step - sum(_num(v[q]) or 0.0 for _, v, _ in layers)))
    if any(other):
        layers.append(("other", other, OTHER_COLOR))
    return _stacked_bars(list(range(ranks)), layers, chart_id="chart-ranks", x_name="rank",
                         title="Each rank's step by phase (seconds per step, mean over the logged steps)",
                         x_label="rank", y_label="seconds per step")


def stragglers_section(rows: list[dict], cfg: dict) -> str | None:
    """The section's HTML, or None for a run of one rank (or one from before the check existed)."""
    several = any(isinstance(r.get("rank.step_s"), list) and len(r["rank.step_s"]) > 1 for r in rows)
    if not several and not any("stragglers" in r for r in rows):
        return None
    profile, training = cfg.get("profile") or {}, cfg.get("training") or {}
    margin = _num(profile.get("straggler_margin"))
    every = int(_num(training.get("log_every")) or 1)
    found = _found(rows)
    if found:
        head = ("<tr><th>rank</th><th>phase</th><th>logged steps named</th><th>worst: x the median</th>"
                "<th>its s / step vs the median's</th><th>SM clock vs median</th><th>power-capped</th></tr>")
        body = []
        for (rank, phase), entry in sorted(found.items(), key=lambda kv: -_ratio(kv[1]["worst"])):
            w = entry["worst"]
            clock = (f"{_fmt(w['sm_clock_mhz'])} vs {_fmt(w['median_sm_clock_mhz'])} MHz"
                     if _num(w.get("sm_clock_mhz")) is not None else "—")
            capped = f"{w['power_capped_frac'] * 100:.0f}%" if _num(w.get("power_capped_frac")) is not None else "—"
            body.append(f'<tr><td class="num">{esc(str(rank))}</td><td>{esc(phase)}</td>'
                        f"<td>{esc(_step_ranges(entry['steps'], every))}</td>"
                        f'<td class="num">{f"{_ratio(w):.2f}x" if math.isfinite(_ratio(w)) else "—"}</td>'
                        f'<td class="num">{esc(_fmt(w.get("seconds")))} vs {esc(_fmt(w.get("median_s")))}</td>'
                        f"<td>{esc(clock)}</td><td>{esc(capped)}</td></tr>")
        table = f'<table class="sinks">{head}{"".join(body)}</table>'
    else:
        table = _note("No rank was named: none was slower than the median rank in a phase by more than "
                      f"profile.straggler_margin ({_fmt(margin) if margin is not None else '?'}) at {CONFIRM} logged "
                      "steps in a row.")
    chart = _per_rank_chart(rows)
    return table + (_figs(chart) if chart else "") + _note(
        "A rank is named where its own time in a phase, after taking off what it may have waited there for a rank "
        f"that began the phase after it, is over the margin of the median rank's (and over {FLOOR_S * 1000:.0f} ms "
        f"and {FLOOR_STEP_SHARE:.0%} of the step). "
        "In a synchronous job the ranks' step times are equal: the others wait for a straggler in the next phase that "
        "holds a collective, so in the chart its slow phase and their waiting phase are both tall. Clocks and power "
        "appear where every rank samples its own GPU.")
