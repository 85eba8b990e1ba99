"""The report's pipeline section: one recorded step of a pipeline-parallel run drawn as its schedule, a lane per
pipeline rank with each stage action as a box coloured by kind and the idle time (the bubble) left bare, and the
bubble share measured beside the bubble model's (RUN_DIR/pipeline_timeline.json, written by
holotrain.parallel.pp_timeline.write; its format is described there)."""

from __future__ import annotations

from pathlib import Path

from holotrain.profile.report.charts import W, _legend, _nice_ticks, _svg, _tick_labels
from holotrain.profile.report.data import _num, _read_json
from holotrain.profile.report.markup import _figs, _note, _pct, _table, esc

KIND_COLORS = {"F": "#1f77b4", "B": "#2ca02c", "I": "#17becf", "W": "#9467bd"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward: input half", "W": "backward: weight half"}
IDLE_COLOR = "#f4e1e1"  # a lane's background: what no box covers is the rank's idle time
ROW, GAP = 26, 8  # lane height and the space between lanes (px)
LABEL_MIN_PX = 13  # a box narrower than this carries no micro-batch number


def _share(label: str, value) -> str:
    return f"{label} {_pct(value)}" if _num(value) is not None else ""


def timeline_chart(events: list[dict], *, step_s: float | None = None, measured=None, predicted=None,
                   textbook=None, chart_id: str = "chart-pipeline",
                   title: str = "Pipeline schedule: one step, a lane per pipeline rank",
                   width: int = 2 * W + 16) -> str:
    """SVG of one step's stage actions, events as pipeline_timeline.json holds them: [{rank, stage, kind, micro,
    start, end}] (seconds from the step's start on that rank). A lane per rank, as long as the step (`step_s`, else
    the last event's end); a box per action, its colour its kind, a lighter shade for a rank's later stages (the
    interleaved and zero-bubble schedules hold two), the micro-batch's number inside when it fits. The bubble
    shares given (measured, the model's, the textbook's) are the caption. Empty string without events."""
    good = []
    for e in events if isinstance(events, list) else []:
        if not isinstance(e, dict):
            continue
        start, end, rank = _num(e.get("start")), _num(e.get("end")), _num(e.get("rank"))
        if start is None or end is None or rank is None or end < start:
            continue
        good.append((int(rank), _num(e.get("stage")), str(e.get("kind")), e.get("micro"), start, end))
    if not good:
        return ""
    ranks = sorted({r for r, *_ in good})
    lane = {r: i for i, r in enumerate(ranks)}
    stages_of = {r: sorted({s for rr, s, *_ in good if rr == r and s is not None}) for r in ranks}
    span = max(_num(step_s) or 0.0, max(end for *_, end in good))

    kinds = [k for k in KIND_COLORS if any(kind == k for _, _, kind, *_ in good)]
    legend_items = [(KIND_NAMES[k], KIND_COLORS[k]) for k in kinds] + [("idle", IDLE_COLOR)]
    legend, leg_h = _legend(legend_items, 64, 34, width - 80)
    left, right = 64, 16
    top = 28 + leg_h + 4
    pw = width - left - right
    ph = len(ranks) * (ROW + GAP) - GAP
    caption = " · ".join(s for s in (_share("measured", measured), _share("model", predicted),
                                     _share("textbook", textbook)) if s)
    height = top + ph + 44 + (18 if caption else 0)
    # The axis ends with the step (the ticks' round end could leave a wide empty strip); ticks past it are dropped.
    x1 = span if span > 0 else 1.0
    xt = [v for v in _nice_ticks(0.0, x1 * 1e3, 8) if v <= x1 * 1e3 * (1 + 1e-9)]

    def x_of(t: float) -> float:
        return left + t / x1 * pw

    out = [legend]
    for v, label in zip(xt, _tick_labels(xt)):
        x = x_of(v / 1e3)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" stroke="#e6e6e6"/>'
                   f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{esc(label)}</text>')
    for r in ranks:
        y = top + lane[r] * (ROW + GAP)
        out.append(f'<text x="{left - 6}" y="{y + ROW / 2 + 4:.1f}" text-anchor="end">rank {r}</text>'
                   f'<rect class="lane" x="{left}" y="{y}" width="{x_of(span) - left:.1f}" height="{ROW}" '
                   f'fill="{IDLE_COLOR}"/>')
    for r, stage, kind, micro, start, end in good:
        y = top + lane[r] * (ROW + GAP)
        x0, xe = x_of(start), x_of(end)
        later = stage is not None and stages_of[r] and stage != stages_of[r][0]
        shade = ' fill-opacity="0.55"' if later else ""
        fill = KIND_COLORS.get(kind, "#9a9a9a")
        tip = f"rank {r} stage {_label(stage)} {KIND_NAMES.get(kind, kind)} micro-batch {_label(micro)}: " \
              f"{start * 1e3:.2f}-{end * 1e3:.2f} ms"
        out.append(f'<rect class="mark" x="{x0:.2f}" y="{y + 1}" width="{max(0.5, xe - x0):.2f}" height="{ROW - 2}" '
                   f'fill="{fill}"{shade} stroke="#fff" stroke-width="0.5">'
                   f"<title>{esc(tip)}</title></rect>")
        if xe - x0 >= LABEL_MIN_PX and micro is not None:
            out.append(f'<text x="{(x0 + xe) / 2:.1f}" y="{y + ROW / 2 + 4:.1f}" text-anchor="middle" '
                       f'class="small" style="fill:#fff">{esc(_label(micro))}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>'
               f'<text x="{left + pw / 2:.0f}" y="{top + ph + 34}" text-anchor="middle" class="axis">'
               f"ms from the step's start</text>")
    if caption:
        out.append(f'<text x="{left + pw / 2:.0f}" y="{top + ph + 54}" text-anchor="middle">'
                   f"bubble share: {esc(caption)}</text>")
    return _svg(chart_id, title, width, height, "".join(out))


def _label(v) -> str:
    return str(int(v)) if _num(v) is not None and float(v).is_integer() else str(v)


def pipeline_section(run_dir: Path) -> str | None:
    """The section's HTML, or None where the run wrote no pipeline_timeline.json."""
    path = Path(run_dir) / "pipeline_timeline.json"
    if not path.is_file():
        return None
    doc = _read_json(path)
    if not isinstance(doc, dict):
        return _note("pipeline_timeline.json does not read as a JSON object.")
    measured, predicted = _num(doc.get("measured_bubble_share")), _num(doc.get("predicted_bubble_share"))
    textbook = _num(doc.get("textbook_bubble_share"))
    chart = timeline_chart(doc.get("events"), step_s=doc.get("step_s"), measured=measured, predicted=predicted,
                           textbook=textbook)
    if not chart:
        return _note("pipeline_timeline.json holds no stage actions.")
    ratio = f" (measured {measured / predicted:.2f}x the model)" if measured is not None and predicted else ""
    step_s = _num(doc.get("step_s"))
    rows = [("schedule", str(doc.get("schedule", "?"))),
            ("pipeline ranks × stages per rank", f"{doc.get('pp', '?')} × {doc.get('stages_per_rank', '?')}"),
            ("micro-batches", str(doc.get("micro_batches", "?"))),
            ("step drawn", str(doc.get("step")) if doc.get("step") is not None else "—"),
            ("pipeline step time", f"{step_s * 1e3:.1f} ms" if step_s is not None else "—"),
            ("bubble share, measured", _pct(measured)),
            ("bubble share, model", _pct(predicted) + ratio),
            ("bubble share, textbook", _pct(textbook))]
    times = doc.get("stage_times_s")
    if isinstance(times, dict):
        for kind in KIND_COLORS:
            per_stage = times.get(kind)
            if isinstance(per_stage, list) and per_stage:
                rows.append((f"mean {KIND_NAMES[kind]} per stage",
                             ", ".join(f"{t * 1e3:.1f}" if _num(t) is not None else "—" for t in per_stage) + " ms"))
    clock = "CUDA events on each rank's stream" if doc.get("clock") == "cuda" else "the host clock"
    return _figs(chart) + _table(rows) + _note(
        "Measured: 1 - (the ranks' busy time) / (ranks × the step), the step being the longest rank's (a rank "
        "that finishes early waits for the others in the loss's all-reduce). Model: the simulator of torch's order "
        "of this schedule (plan/pipeline.py) fed with the drawn step's mean time of each stage's actions, sends free. "
        "Textbook: the closed form with equal stages and forward = backward-input = backward-weight, "
        f"(p-1)/(m+p-1) for 1f1b. Times by {clock}, from each rank's own step start; the last stage's forward "
        "includes its loss.")
