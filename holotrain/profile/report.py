"""`holotrain report RUN_DIR` -> RUN_DIR/report.html: one self-contained page about a finished (or running) run.

Reads `metrics.jsonl` (required), and when present `config.toml`, `telemetry.jsonl` (NVML samples, analysed by
`holotrain.hw.dvfs`), `hw_probe.json` and `traces/`. Charts are inline SVG drawn here, in Python; the only
script is a few lines that record each chart's rendered size (a self-check for tests and curious readers).
Every field may be null, NaN or missing: a chart without data becomes a one-line note, never an error.
"""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path

from holotrain.errors import ConfigError
from holotrain.jsonl import read_jsonl

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
OTHER_COLOR = "#9a9a9a"
PHASE_COLORS = {
    "data_wait": "#ff7f0e",
    "forward": "#1f77b4",
    "backward": "#2ca02c",
    "optimizer": "#9467bd",
    "offload_transfer": "#8c564b",
    "exposed_comm": "#d62728",
}
KNOWN_PHASES = ["data_wait", "forward", "backward", "optimizer"]
MAX_POINTS = 2000  # per series; longer series are reduced to a min/max envelope of this many points
MAX_BARS = 300  # stacked bars; more logged steps are averaged in groups
MAX_STEP_MARKS = 60
W, H = 600, 300  # default chart size (px)

esc = html.escape


# --------------------------------------------------------------------------------------------
# Reading


def _num(v) -> float | None:
    """A finite number, or None (null, NaN, inf, bools, strings, dicts...)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl - not a holotrain run directory?")
    by_step: dict[float, dict] = {}
    for i, row in enumerate(read_jsonl(path)):
        step = _num(row.get("step"))
        step = float(i + 1) if step is None else step
        row["step"] = int(step) if step.is_integer() else step
        by_step[row["step"]] = row  # a resumed run may repeat steps: the last one wins
    return [by_step[s] for s in sorted(by_step)]


def _read_config(run_dir: Path) -> dict:
    path = run_dir / "config.toml"
    if not path.is_file():
        return {}
    try:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python < 3.11
            import tomli as tomllib
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
        return cfg if isinstance(cfg, dict) else {}
    except Exception:  # a damaged config must not cost the user the report
        return {}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------------------------
# Small helpers


def _fmt(v, digits: int = 3) -> str:
    """A number for people: 3 significant digits, thousands separators, '—' for nothing."""
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    v = _num(v)
    if v is None:
        return "—"
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e4:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:,.{max(0, digits - 1 - math.floor(math.log10(a)))}f}"
    return f"{v:.{digits}g}"


def _pct(v) -> str:
    v = _num(v)
    return "—" if v is None else f"{v * 100:.1f}%"


def _mean(values) -> float | None:
    vals = [x for x in (_num(v) for v in values) if x is not None]
    return sum(vals) / len(vals) if vals else None


def _weighted_mean(pairs) -> float | None:
    """Mean of values weighted by w over (value, w) pairs with both present."""
    num = den = 0.0
    for v, w in pairs:
        v, w = _num(v), _num(w)
        if v is None or w is None or w <= 0:
            continue
        num += v * w
        den += w
    return num / den if den > 0 else None


def _downsample(points: list[tuple[float, float]], limit: int = MAX_POINTS) -> list[tuple[float, float]]:
    """At most `limit` points: per bucket, its min and its max in time order, so dips and spikes survive."""
    if len(points) <= limit:
        return points
    points = [p for p in points if _num(p[1]) is not None]  # too dense for gaps to show anyway
    if len(points) <= limit:
        return points
    buckets = max(1, limit // 2)
    size = len(points) / buckets
    out = []
    for b in range(buckets):
        chunk = points[int(b * size): int((b + 1) * size)]
        if not chunk:
            continue
        lo = min(chunk, key=lambda p: p[1])
        hi = max(chunk, key=lambda p: p[1])
        out.extend(sorted({lo, hi}))
    return out


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = 0.0, 1.0
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        pad = abs(hi) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = mag * 10
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            step = m * mag
            break
    start = math.floor(lo / step + 1e-9) * step
    ticks = []
    v = start
    while v < hi + step * 0.999 and len(ticks) < 50:
        ticks.append(0.0 if abs(v) < step * 1e-9 else v)
        if v >= hi - step * 1e-9:
            break
        v = start + len(ticks) * step
    if len(ticks) < 2:
        ticks.append(start + step)
    return ticks


def _tick_labels(ticks: list[float]) -> list[str]:
    """Labels for evenly spaced ticks, one unit (k, M) and one number of decimals for the whole axis."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    top = max(abs(t) for t in ticks)
    unit, suffix = (1e6, "M") if top >= 1e6 and step >= 1e5 else (1e3, "k") if top >= 1e4 and step >= 1e3 else (1, "")
    step /= unit
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
    if round(step * 10 ** decimals, 6) % 1:  # e.g. a step of 2.5
        decimals += 1
    return [f"{t / unit:.{decimals}f}{suffix if t else ''}" for t in ticks]


def _legend(names_colors, x0: float, y0: float, max_w: float) -> tuple[str, float]:
    """Legend entries laid out left to right, wrapping; returns (svg, height used)."""
    parts, x, y = [], x0, y0
    for name, color in names_colors:
        w = 22 + 6.6 * len(name) + 14
        if x > x0 and x + w > x0 + max_w:
            x, y = x0, y + 16
        parts.append(
            f'<rect class="legend" x="{x:.0f}" y="{y - 9:.0f}" width="14" height="10" fill="{color}"/>'
            f'<text x="{x + 18:.0f}" y="{y:.0f}">{esc(name)}</text>'
        )
        x += w
    return "".join(parts), (y - y0) + 16 if names_colors else 0.0


def _axes(left, top, pw, ph, xt, yt, x_of, y_of, x_label, y_label, x_labels=None) -> str:
    """Frame, grid, tick labels and axis titles."""
    s = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888" stroke-width="1"/>']
    for v, label in zip(yt, _tick_labels(yt)):
        y = y_of(v)
        s.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e6e6e6"/>')
        s.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{esc(label)}</text>')
    if x_labels is None:
        x_labels = [(x_of(v), label) for v, label in zip(xt, _tick_labels(xt))]
    for x, label in x_labels:
        s.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#888"/>')
        s.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{esc(label)}</text>')
    s.append(f'<text x="{left + pw / 2:.0f}" y="{top + ph + 34}" text-anchor="middle" class="axis">'
             f"{esc(x_label)}</text>")
    s.append(
        f'<text transform="translate(14,{top + ph / 2:.0f}) rotate(-90)" text-anchor="middle" class="axis">'
        f"{esc(y_label)}</text>"
    )
    return "".join(s)


def _svg(chart_id: str, title: str, width: int, height: int, body: str) -> str:
    return (
        f'<svg class="chart" id="{esc(chart_id)}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height:.0f}" viewBox="0 0 {width} {height:.0f}" role="img" aria-label="{esc(title)}">'
        f'<text x="{width / 2:.0f}" y="16" text-anchor="middle" class="title">{esc(title)}</text>{body}</svg>'
    )


# --------------------------------------------------------------------------------------------
# Charts


def _line_chart(series: list[dict], *, chart_id: str, title: str, x_label: str, y_label: str,
                width: int = W, height: int = H, y_zero: bool = False, refs=(), vmarks=()) -> str:
    """Lines over x. series: [{"name", "color", "points": [(x, y|None), ...]}]; a None y breaks the line.

    refs: horizontal dashed reference lines [(y, label)]; vmarks: vertical marks [(x, label|None)].
    """
    series = [dict(s, points=[(x, y) for x, y in s["points"] if _num(x) is not None]) for s in series]
    xs = [x for s in series for x, _ in s["points"]]
    ys = [y for s in series for _, y in s["points"] if _num(y) is not None]
    if not xs or not ys:
        return ""
    ys += [y for y, _ in refs if _num(y) is not None]
    if y_zero:
        ys.append(0.0)
    legend, leg_h = _legend([(s["name"], s["color"]) for s in series], 64, 34, width - 80)
    left, top, right, bottom = 64, 28 + leg_h + 4, 16, 44
    pw, ph = width - left - right, height - top - bottom
    xt, yt = _nice_ticks(min(xs), max(xs), 6), _nice_ticks(min(ys), max(ys), 5)
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]

    def x_of(x):
        return left + (x - x0) / (x1 - x0) * pw

    def y_of(y):
        return top + ph - (y - y0) / (y1 - y0) * ph

    out = [legend, _axes(left, top, pw, ph, xt, yt, x_of, y_of, x_label, y_label)]
    # vertical marks (thinned), labels on a few of them
    vm = [(x, lbl) for x, lbl in vmarks if _num(x) is not None and x0 <= x <= x1]
    if len(vm) > MAX_STEP_MARKS:
        stride = math.ceil(len(vm) / MAX_STEP_MARKS)
        vm = vm[::stride]
    label_every = max(1, math.ceil(len(vm) / 8))
    for i, (x, lbl) in enumerate(vm):
        out.append(f'<line class="vmark" x1="{x_of(x):.1f}" x2="{x_of(x):.1f}" y1="{top}" y2="{top + ph}" '
                   f'stroke="#bbb" stroke-dasharray="2,3"/>')
        if lbl and i % label_every == 0:
            out.append(f'<text x="{x_of(x) + 2:.1f}" y="{top + 10}" class="small">{esc(lbl)}</text>')
    for y, lbl in refs:
        if _num(y) is None:
            continue
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y_of(y):.1f}" y2="{y_of(y):.1f}" stroke="#555" '
                   f'stroke-dasharray="6,4"/>'
                   f'<text x="{left + pw - 4}" y="{y_of(y) - 4:.1f}" text-anchor="end" class="small">{esc(lbl)}</text>')
    for s in series:
        pts = _downsample(s["points"])
        d, pen_down, n_drawn = [], False, 0
        for x, y in pts:
            if _num(y) is None:
                pen_down = False
                continue
            d.append(f'{"L" if pen_down else "M"}{x_of(x):.1f},{y_of(y):.1f}')
            pen_down = True
            n_drawn += 1
        if not d:
            continue
        out.append(f'<path class="mark" d="{"".join(d)}" fill="none" stroke="{s["color"]}" stroke-width="2" '
                   f'stroke-linejoin="round"/>')
        if n_drawn <= 40:  # few points: show them
            out.extend(
                f'<circle class="mark" cx="{x_of(x):.1f}" cy="{y_of(y):.1f}" r="2.5" fill="{s["color"]}"/>'
                for x, y in pts if _num(y) is not None
            )
    return _svg(chart_id, title, width, height, "".join(out))


def _stacked_bars(xs: list[float], layers: list[tuple[str, list, str]], *, chart_id: str, title: str,
                  x_label: str, y_label: str, width: int = 2 * W + 16, height: int = H + 20) -> str:
    """One stacked bar per x (bars averaged in groups above MAX_BARS). layers: [(name, values, color)]."""
    n = len(xs)
    if not n or not layers:
        return ""
    if n > MAX_BARS:  # average consecutive groups
        g = math.ceil(n / MAX_BARS)
        groups = [range(i, min(n, i + g)) for i in range(0, n, g)]
        xs = [xs[grp[-1]] for grp in groups]
        layers = [(name, [_mean(vals[i] for i in grp) for grp in groups], c) for name, vals, c in layers]
        n = len(xs)
    totals = [sum(max(0.0, _num(vals[i]) or 0.0) for _, vals, _ in layers) for i in range(n)]
    if max(totals) <= 0:
        return ""
    legend, leg_h = _legend([(name, c) for name, _, c in layers], 64, 34, width - 80)
    left, top, right, bottom = 64, 28 + leg_h + 4, 16, 44
    pw, ph = width - left - right, height - top - bottom
    yt = _nice_ticks(0.0, max(totals), 5)
    y1 = yt[-1]
    band = pw / n

    def y_of(y):
        return top + ph - y / y1 * ph

    every = max(1, math.ceil(n / 10))
    x_labels = [(left + (i + 0.5) * band, _fmt(xs[i])) for i in range(0, n, every)]
    out = [legend, _axes(left, top, pw, ph, [0, 1], yt, None, y_of, x_label, y_label, x_labels)]
    bw = max(1.0, band * 0.8)
    for i in range(n):
        acc = 0.0
        x = left + i * band + (band - bw) / 2
        for name, vals, color in layers:
            v = max(0.0, _num(vals[i]) or 0.0)
            if v <= 0:
                continue
            y_top, y_bot = y_of(acc + v), y_of(acc)
            out.append(f'<rect class="mark" x="{x:.1f}" y="{y_top:.1f}" width="{bw:.1f}" '
                       f'height="{max(0.5, y_bot - y_top):.1f}" fill="{color}"><title>step {esc(_fmt(xs[i]))} '
                       f'{esc(name)}: {esc(_fmt(v))} s</title></rect>')
            acc += v
    return _svg(chart_id, title, width, height, "".join(out))


def _hbars(items: list[tuple[str, float]], *, chart_id: str, title: str, x_label: str, width: int = W,
           color: str = "#d62728") -> str:
    """Horizontal bars of fractions (0..1), shown as percent; largest first."""
    items = [(k, v) for k, v in ((k, _num(v)) for k, v in items) if v is not None]
    if not items:
        return ""
    items.sort(key=lambda kv: -kv[1])
    left = min(260, 20 + 7 * max(len(k) for k, _ in items))
    top, right, bottom = 28, 60, 44
    row = max(22, 80 // len(items))
    height = top + bottom + row * len(items)
    pw, ph = width - left - right, row * len(items)
    xt = _nice_ticks(0.0, max(100.0 * max(v for _, v in items), 1.0), 5)
    x1 = xt[-1]

    def x_of(v):
        return left + v / x1 * pw

    out = [f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    for v, label in zip(xt, _tick_labels(xt)):
        out.append(f'<line x1="{x_of(v):.1f}" x2="{x_of(v):.1f}" y1="{top}" y2="{top + ph}" stroke="#e6e6e6"/>'
                   f'<text x="{x_of(v):.1f}" y="{top + ph + 16}" text-anchor="middle">{esc(label)}</text>')
    for i, (k, v) in enumerate(items):
        bh = min(row - 8, 24)
        y = top + i * row + (row - bh) / 2
        out.append(f'<text x="{left - 6}" y="{y + bh / 2 + 4:.1f}" text-anchor="end">{esc(k)}</text>'
                   f'<rect class="mark" x="{left}" y="{y:.1f}" width="{max(1.0, x_of(100 * v) - left):.1f}" '
                   f'height="{bh}" fill="{color}"/>'
                   f'<text x="{x_of(100 * v) + 4:.1f}" y="{y + bh / 2 + 4:.1f}" class="small">{v * 100:.1f}%</text>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{top + ph + 34}" text-anchor="middle" class="axis">'
               f"{esc(x_label)}</text>")
    return _svg(chart_id, title, width, height, "".join(out))


# --------------------------------------------------------------------------------------------
# Sections


def _note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def _table(rows: list[tuple[str, str]], cls: str = "kv") -> str:
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="{cls}">{body}</table>'


def _series(rows: list[dict], key: str, scale: float = 1.0) -> list[tuple[float, float | None]]:
    pts = []
    for r in rows:
        v = _num(r.get(key))
        pts.append((r["step"], None if v is None else v * scale))
    return pts


def _has(rows: list[dict], key: str) -> bool:
    return any(_num(r.get(key)) is not None for r in rows)


def _phase_keys(rows: list[dict]) -> list[str]:
    """time.* keys with numbers: the four standard phases first, then the others in order of appearance."""
    seen = []
    for r in rows:
        for k, v in r.items():
            if k.startswith("time.") and k not in seen and _num(v) is not None:
                seen.append(k)
    known = [f"time.{p}" for p in KNOWN_PHASES if f"time.{p}" in seen]
    return known + [k for k in seen if k not in known]


def _top_level(phase_keys: list[str]) -> list[str]:
    """Phases that add up to the step; `time.forward.offload_wait` is part of `time.forward`, not beside it."""
    return [k for k in phase_keys if "." not in k[len("time."):]]


def _steady(rows: list[dict]) -> list[dict]:
    """Logged steps after the first (which carries start-up: compilation, tokenizer, data plane warm-up)."""
    return rows[1:] if len(rows) >= 3 else rows


def _interval_steps(rows: list[dict]) -> dict[int, float]:
    """Steps each logged row averages over (log_every, or fewer for the last one)."""
    out, prev = {}, 0.0
    for r in rows:
        out[id(r)] = max(1.0, r["step"] - prev)
        prev = r["step"]
    return out


def _model_params(model: dict, data: dict) -> int | None:
    try:
        d, L, h = int(model["dim"]), int(model["n_layers"]), int(model["n_heads"])
        kv, ff = int(model.get("n_kv_heads") or h), int(model["ffn_dim"])
        v = int(model.get("vocab_size") or data.get("vocab_size"))
    except (KeyError, TypeError, ValueError):
        return None
    if min(d, L, h, kv, ff, v) <= 0:
        return None
    hd = d // h
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * ff + 2 * d
    return 2 * v * d + L * per_layer + d


def _section(title: str, body: str, sid: str) -> str:
    return f'<section id="{sid}"><h2>{esc(title)}</h2>{body}</section>'


def _figs(*svgs: str) -> str:
    return '<div class="charts">' + "".join(f"<figure>{s}</figure>" for s in svgs if s) + "</div>"


def _lever_for(phase: str, mfu: float | None) -> str:
    if phase == "data_wait":
        return "data plane: more loader processes (`data.workers`), a deeper prefetch (`data.prefetch_steps`)"
    if phase in ("forward", "backward"):
        m = f"MFU {mfu * 100:.1f}% of peak" if mfu is not None else "MFU unknown on this device"
        return f"compute efficiency: `training.compile`, attention kernel (`training.attention`); {m}"
    if phase == "optimizer":
        return "optimizer: fused AdamW, or overlap the CPU step with `memory.offload`"
    if "offload" in phase:
        return "offload transfers: keep more on the GPU with `memory.offload_ratio`; pinned, overlapped copies"
    if "comm" in phase:
        return "exposed communication: `parallel.tp_overlap`, FSDP prefetch (`parallel.reshard_after_forward`)"
    return f"the lever that records `time.{phase}`"


# --------------------------------------------------------------------------------------------
# The report


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1240px;
 color:#222;padding:0 12px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
.sub{color:#666;margin:0 0 12px}
table{border-collapse:collapse;margin:6px 0}th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;
 vertical-align:top}th{font-weight:600;color:#444}
table.kv th{width:220px}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.charts{display:flex;flex-wrap:wrap;gap:16px}figure{margin:0}
svg.chart{background:#fff;max-width:100%;height:auto}svg text{font:11px sans-serif;fill:#333}
svg text.title{font:bold 13px sans-serif}svg text.axis{fill:#555}svg text.small{font-size:10px;fill:#666}
.note{color:#777;font-style:italic;margin:4px 0}
.bar{display:inline-block;height:10px;background:#1f77b4;vertical-align:middle;margin-right:6px}
.nowrap{white-space:nowrap}code{background:#f3f3f3;padding:0 3px;border-radius:3px}
#render-check{display:none}
"""

# Records, for each chart, its rendered box and how many data marks it draws with a non-empty box.
SCRIPT = """
(function(){var out=[];document.querySelectorAll('svg.chart').forEach(function(s){var r=s.getBoundingClientRect();
var n=0;s.querySelectorAll('.mark').forEach(function(m){var b=m.getBBox();if(b.width>0||b.height>0)n++;});
var rec={id:s.id,x:Math.round(r.left+window.scrollX),y:Math.round(r.top+window.scrollY),w:Math.round(r.width),
h:Math.round(r.height),marks:n};s.setAttribute('data-rendered',JSON.stringify(rec));out.push(rec);});
document.getElementById('render-check').textContent=JSON.stringify(out);})();
"""


def _code(text: str) -> str:
    """Escape text, then show `backticked` parts as <code>."""
    parts = esc(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def write_report(run_dir) -> Path:
    run_dir = Path(run_dir)
    rows = _read_metrics(run_dir)
    cfg = _read_config(run_dir)
    job, model, data, training = (cfg.get(k) if isinstance(cfg.get(k), dict) else {}
                                  for k in ("job", "model", "data", "training"))

    telemetry: list[dict] = []
    tel_path = run_dir / "telemetry.jsonl"
    if tel_path.is_file():
        telemetry = read_jsonl(tel_path)
    analysis, dvfs_note = None, None
    if telemetry:
        try:
            from holotrain.hw import dvfs
        except ImportError as e:
            dvfs_note = f"DVFS analysis unavailable (holotrain.hw.dvfs: {e})."
        else:
            try:
                analysis = dvfs.analyze(telemetry, rows)
            except Exception as e:  # malformed telemetry must not cost the user the rest of the report
                dvfs_note = f"DVFS analysis failed: {type(e).__name__}: {e}"
    analysis = analysis if isinstance(analysis, dict) else {}

    steady = _steady(rows)
    nsteps = _interval_steps(rows)
    weights = [(r, nsteps[id(r)]) for r in steady]
    step_s = _weighted_mean((r.get("step_s"), w) for r, w in weights)
    tokens_per_s = _weighted_mean((r.get("tokens_per_s"), (_num(r.get("step_s")) or 0) * w) for r, w in weights)
    if tokens_per_s is None:  # no step times to weight by
        tokens_per_s = _mean(r.get("tokens_per_s") for r in steady)
    mfu = _weighted_mean((r.get("mfu"), w) for r, w in weights)
    tflops = _weighted_mean((r.get("tflops"), w) for r, w in weights)
    j_per_token = _weighted_mean((r.get("energy.j_per_token"), w) for r, w in weights)
    final_loss = next((_num(r.get("loss")) for r in reversed(rows) if _num(r.get("loss")) is not None), None)

    # devices: telemetry headers, else the probe, else the config
    devices = [d for d in (analysis.get("devices") or []) if isinstance(d, dict)]
    if not devices:
        devices = [r for r in telemetry if r.get("kind") == "device"]
    probe = _read_json(run_dir / "hw_probe.json") if (run_dir / "hw_probe.json").is_file() else None
    dev_names = sorted({str(d.get("name")) for d in devices if d.get("name")})
    if dev_names:
        n_dev = len({_dev_key(d.get("device")) for d in devices})
        device = ", ".join(dev_names) + (f" ({n_dev} devices)" if n_dev > 1 else "")
    elif isinstance(probe, dict) and isinstance(probe.get("device"), (str, dict)):
        pd = probe["device"]
        device = str(pd.get("name", pd) if isinstance(pd, dict) else pd)
    elif not _has(rows, "mfu") and not _has(rows, "mem.peak_gb"):
        device = f"CPU (job.device = {job.get('device', '?')}; no GPU metrics)"
    else:
        device = f"GPU (job.device = {job.get('device', '?')}; no telemetry)"

    name = str(job.get("name") or run_dir.name)
    params = _model_params(model, data)
    model_desc = ", ".join(
        f"{k} {model[k]}" for k in ("preset", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
        if k in model
    )
    if params:
        size = f"{params / 1e6:,.1f}M parameters"
        model_desc = f"{size} ({model_desc})" if model_desc else size
    last_step = rows[-1]["step"] if rows else None
    planned = training.get("steps")
    wall = [_num(r.get("wall_time")) for r in rows if _num(r.get("wall_time")) is not None]
    peak_mem = max((_num(r.get("mem.peak_gb")) for r in rows if _num(r.get("mem.peak_gb")) is not None), default=None)

    header = [
        ("run", name),
        ("run directory", str(run_dir.resolve())),
        ("model", model_desc or "unknown (no config.toml)"),
        ("device", device),
        ("sequence length × batch", f"{data.get('seq_len', '?')} × {training.get('batch_size', '?')}"
         if data or training else "—"),
        ("steps", f"{_fmt(last_step)}" + (f" of {planned}" if planned else "") + f" ({len(rows)} logged)"),
        ("tokens", _fmt(rows[-1].get("tokens")) if rows else "—"),
        ("final loss", _fmt(final_loss, 4)),
        ("mean tokens/s", _fmt(tokens_per_s)),
        ("mean step time", f"{_fmt(step_s)} s" if step_s is not None else "—"),
        ("TFLOP/s per device", _fmt(tflops)),
        ("MFU", _pct(mfu) if mfu is not None else "— (peak unknown: CPU or unlisted GPU)"),
    ]
    if j_per_token is not None:
        header.append(("energy", f"{j_per_token:.4g} J/token ({j_per_token * 1000:.3g} J per 1k tokens)"))
    if peak_mem is not None:
        header.append(("peak GPU memory", f"{peak_mem:.2f} GB"))
    if len(wall) >= 2:
        header.append(("wall time (logged span)", f"{wall[-1] - wall[0]:,.1f} s"))

    parts: list[str] = []
    parts.append(_section("Summary", _table(header) + _note(
        "Means are over the logged steps after the first (start-up excluded), weighted by time."
        if len(rows) >= 3 else "Means are over all logged steps."), "summary"))

    # -- throughput and loss
    tps = _line_chart([{"name": "tokens/s", "color": PALETTE[0], "points": _series(rows, "tokens_per_s")}],
                      chart_id="chart-tokens", title="Throughput", x_label="step", y_label="tokens/s", y_zero=True)
    loss = _line_chart([{"name": "loss", "color": PALETTE[1], "points": _series(rows, "loss")}],
                       chart_id="chart-loss", title="Loss", x_label="step", y_label="loss")
    body = _figs(tps, loss)
    if not tps:
        body += _note("No tokens_per_s in metrics.jsonl.")
    if not loss:
        body += _note("No loss in metrics.jsonl.")
    traced = (cfg.get("profile") or {}).get("trace_steps") or []
    if traced:
        body += _note(f"Steps {', '.join(str(t) for t in sorted(traced))} ran under torch.profiler "
                      "(profile.trace_steps): their logged interval is slower by design.")
    parts.append(_section("Throughput and loss", body, "throughput"))

    # -- phases
    phase_keys = _phase_keys(rows)
    stacked = _top_level(phase_keys)
    if stacked:
        layers = []
        for i, k in enumerate(stacked):
            p = k[len("time."):]
            layers.append((p, [_num(r.get(k)) for r in rows], PHASE_COLORS.get(p, PALETTE[(i + 4) % len(PALETTE)])))
        other = []
        for r in rows:
            s = _num(r.get("step_s"))
            other.append(None if s is None else max(0.0, s - sum(_num(r.get(k)) or 0.0 for k in stacked)))
        if any(v for v in other):
            layers.append(("other", other, OTHER_COLOR))
        chart = _stacked_bars([r["step"] for r in rows], layers, chart_id="chart-phases",
                              title="Step time by phase (seconds per step, per logged step)",
                              x_label="step", y_label="seconds per step")
        body = _figs(chart) + _note("\"other\" = step_s minus the recorded phases (host and launch overhead, "
                                    "synchronization), clamped at 0.") if chart else _note("Phase times are all zero.")
    else:
        body = _note("No time.* phase times in metrics.jsonl (profile.phases off?).")
    parts.append(_section("Where each step goes", body, "phases"))

    # -- hardware: clocks, power, energy, throttling
    parts.append(_section("Clocks, power and energy", _hw_section(rows, telemetry, analysis, devices, dvfs_note),
                          "hardware"))

    # -- memory
    mem_series = [
        {"name": label, "color": color, "points": _series(rows, key)}
        for key, label, color in (("mem.peak_gb", "GPU peak allocated", PALETTE[0]),
                                  ("mem.reserved_gb", "GPU reserved", PALETTE[3]),
                                  ("mem.host_rss_gb", "host RSS", PALETTE[2]))
        if _has(rows, key)
    ]
    if mem_series:
        body = _figs(_line_chart(mem_series, chart_id="chart-memory", title="Memory", x_label="step", y_label="GB",
                                 y_zero=True))
    else:
        body = _note("No memory figures (mem.* are null on CPU runs).")
    parts.append(_section("Memory", body, "memory"))

    # -- where the time goes
    parts.append(_section("Where the time goes", _sinks(steady, nsteps, phase_keys, step_s, mfu, analysis),
                          "sinks"))

    # -- probe and traces
    if isinstance(probe, (dict, list)):
        parts.append(_section("Hardware probe (hw_probe.json)", _probe_table(probe), "probe"))
    traces = _trace_files(run_dir)
    if traces:
        items = "".join(f'<li><a href="{esc(rel, quote=True)}">{esc(rel)}</a> ({size / 1e6:.1f} MB)</li>'
                        for rel, size in traces)
        parts.append(_section("Traces", f"<ul>{items}</ul>" + _note(
            "Open them in Perfetto (ui.perfetto.dev: drag the file in), or chrome://tracing."), "traces"))

    page = (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>holotrain report: {esc(name)}</title><style>{CSS}</style></head><body>"
        f"<h1>holotrain report: {esc(name)}</h1><p class=\"sub\">{esc(str(run_dir))}</p>"
        + "".join(parts)
        + f'<pre id="render-check"></pre><script>{SCRIPT}</script></body></html>\n'
    )
    out = run_dir / "report.html"
    tmp = run_dir / f".report.html.tmp-{os.getpid()}"
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def _dev_key(d):
    return d if isinstance(d, (int, str)) and not isinstance(d, bool) else str(d)


def _hw_section(rows, telemetry, analysis, devices, dvfs_note) -> str:
    out: list[str] = []
    samples: dict = {}
    for r in telemetry:
        if r.get("kind") == "sample" and _num(r.get("t")) is not None:
            samples.setdefault(_dev_key(r.get("device")), []).append(r)
    marks = sorted(((_num(r.get("t")), r.get("step")) for r in telemetry
                    if r.get("kind") == "step" and _num(r.get("t")) is not None), key=lambda m: m[0])
    charts = []
    if samples:
        t0 = min(_num(s["t"]) for ss in samples.values() for s in ss)
        header = {_dev_key(d.get("device")): d for d in devices}
        dev_ids = sorted(samples, key=lambda d: (0, d, "") if isinstance(d, int) else (1, 0, str(d)))

        def dev_name(d):
            h = header.get(d, {})
            return f"GPU {d}" + (f" (rank {h['rank']})" if isinstance(h.get("rank"), int) else "")

        def per_device(key):
            return [{"name": dev_name(d), "color": PALETTE[i % len(PALETTE)],
                     "points": sorted(((_num(s["t"]) - t0, _num(s.get(key))) for s in samples[d]),
                                      key=lambda p: p[0])}
                    for i, d in enumerate(dev_ids)]

        vmarks = [(t - t0, f"step {step}") for t, step in marks]
        max_clocks = sorted({v for v in (_num(h.get("max_sm_clock_mhz")) for h in header.values()) if v})
        limits = sorted({v for v in (_num(h.get("power_limit_w")) for h in header.values()) if v})
        charts.append(_line_chart(per_device("sm_clock_mhz"), chart_id="chart-sm-clock", title="SM clock",
                                  x_label="seconds since start", y_label="MHz", vmarks=vmarks,
                                  refs=[(v, f"max {v:.0f} MHz") for v in max_clocks]))
        charts.append(_line_chart(per_device("power_w"), chart_id="chart-power", title="Power",
                                  x_label="seconds since start", y_label="W", y_zero=True, vmarks=vmarks,
                                  refs=[(v, f"limit {v:.0f} W") for v in limits]))
        n = sum(len(v) for v in samples.values())
        note = f"{n:,} NVML samples from telemetry.jsonl; dashed verticals mark logged steps"
        if any(len(v) > MAX_POINTS for v in samples.values()):
            note += f"; lines reduced to a min/max envelope of {MAX_POINTS} points per device"
        missing = [what for what, chart in zip(("SM clock", "power"), charts) if not chart]
        if missing:
            note += f"; no {' or '.join(missing)} readings"
        out.append(_figs(*charts) + _note(note + "."))
    elif _has(rows, "hw.sm_clock_mhz") or _has(rows, "hw.power_w"):
        out.append(_note("No telemetry.jsonl: clocks and power below are the per-step means from metrics.jsonl."))
        out.append(_figs(
            _line_chart([{"name": "SM clock", "color": PALETTE[0], "points": _series(rows, "hw.sm_clock_mhz")}],
                        chart_id="chart-sm-clock", title="SM clock (per logged step)", x_label="step", y_label="MHz"),
            _line_chart([{"name": "power", "color": PALETTE[1], "points": _series(rows, "hw.power_w")}],
                        chart_id="chart-power", title="Power (per logged step)", x_label="step", y_label="W",
                        y_zero=True),
        ))
    else:
        out.append(_note("No telemetry.jsonl and no hw.* metrics: clock and power timelines omitted "
                         "(CPU run, no NVML, or hw.telemetry off)."))

    if _has(rows, "energy.joules") or _has(rows, "energy.j_per_token"):
        out.append(_figs(
            _line_chart([{"name": "J per step", "color": PALETTE[3], "points": _series(rows, "energy.joules")}],
                        chart_id="chart-energy", title="Energy per step", x_label="step", y_label="J", y_zero=True),
            _line_chart([{"name": "J per 1k tokens", "color": PALETTE[4],
                          "points": _series(rows, "energy.j_per_token", 1000.0)}],
                        chart_id="chart-j-per-token", title="Energy per 1k tokens", x_label="step",
                        y_label="J / 1k tokens", y_zero=True),
        ))
    else:
        out.append(_note("No energy figures (energy.* are null without NVML)."))

    if dvfs_note:
        out.append(_note(dvfs_note))
    if analysis:
        ramp = analysis.get("ramp_after_idle_s") if isinstance(analysis.get("ramp_after_idle_s"), dict) else {}
        boost = analysis.get("boost_after_idle_s") if isinstance(analysis.get("boost_after_idle_s"), dict) else {}
        rows_ = [
            ("burst SM clock", f"{_fmt(analysis.get('burst_clock_mhz'))} MHz"),
            ("sustained SM clock", f"{_fmt(analysis.get('sustained_clock_mhz'))} MHz"),
            ("mean busy SM clock", f"{_fmt(analysis.get('mean_busy_clock_mhz'))} MHz"),
            ("max SM clock", f"{_fmt(analysis.get('max_clock_mhz'))} MHz"),
            ("sustained / burst", _pct(analysis.get("sustained_over_burst"))),
            ("clock loss (time lost to lower clocks)", _pct(analysis.get("clock_loss_frac"))),
            ("ramp-up after idle", f"{_fmt(ramp.get('count'))} ramps, median {_fmt(ramp.get('median'))} s, "
                                   f"max {_fmt(ramp.get('max'))} s" if ramp.get("count") else "—"),
            ("boost above sustained after idle", f"median {_fmt(boost.get('median'))} s over {boost['count']} gaps"
                                                 if boost.get("count") else "—"),
            ("busy share of samples", _pct(analysis.get("busy_frac"))),
            ("mean power", f"{_fmt(analysis.get('mean_power_w'))} W"),
            ("energy (telemetry)", f"{_fmt(analysis.get('energy_j'))} J"),
            ("clock-normalized MFU", _pct(analysis.get("clock_normalized_mfu"))),
        ]
        out.append("<h3>DVFS analysis</h3>" + _table(rows_))
        tb = analysis.get("throttle_breakdown")
        tb = tb if isinstance(tb, dict) else {}
        items = [(str(k), v) for k, v in tb.items() if (_num(v) or 0) > 0]
        never = sorted(str(k) for k, v in tb.items() if _num(v) == 0)
        if items:
            out.append(_figs(_hbars(items, chart_id="chart-throttle", title="Throttle reasons (share of busy time)",
                                    x_label="% of busy samples")))
            if never:
                out.append(_note(f"Never active while busy: {', '.join(never)}."))
        elif tb:
            out.append(_note("No throttle reason was active while the GPUs were busy."))
        else:
            out.append(_note("No throttle reasons recorded while busy (no busy samples with a reasons reading)."))
    elif telemetry and not dvfs_note:
        out.append(_note("DVFS analysis returned nothing."))
    return "".join(out)


def _sinks(steady, nsteps, phase_keys, step_s, mfu, analysis) -> str:
    if step_s is None and not phase_keys:
        return _note("No step_s or time.* figures: nothing to rank.")
    items = []  # (name, seconds per step, lever)
    for k in phase_keys:
        v = _weighted_mean((r.get(k), nsteps[id(r)]) for r in steady)
        if v is not None:
            *parent, p = k[len("time."):].split(".")
            label = p.replace("_", " ") + (f" (inside {parent[-1]})" if parent else "")
            items.append((label, v, _lever_for(p, mfu)))
    stacked = _top_level(phase_keys)
    if step_s is not None and stacked:
        other = _weighted_mean(
            (max(0.0, _num(r.get("step_s")) - sum(_num(r.get(k)) or 0.0 for k in stacked)), nsteps[id(r)])
            for r in steady if _num(r.get("step_s")) is not None
        )
        if other is not None:
            items.append(("other (CPU / launch overhead)", other,
                          "host overhead: `training.compile` (fewer, larger kernels), CUDA graphs"))
    loss_frac = _num(analysis.get("clock_loss_frac"))
    if loss_frac is not None and step_s is not None:
        items.append(("clock drop (DVFS; inside the compute phases)", loss_frac * step_s,
                      ("power/DVFS: `hw` section (`hw.power_limit_w`, `hw.lock_sm_clock_mhz`); "
                       "measure the card with `holotrain hw probe`")))
    if not items:
        return _note("No phase times to rank.")
    items.sort(key=lambda it: -it[1])
    top = max(it[1] for it in items) or 1.0
    body = []
    for i, (label, secs, lever) in enumerate(items, 1):
        share = secs / step_s if step_s else None
        bar = f'<span class="bar" style="width:{max(1, round(120 * secs / top))}px"></span>'
        body.append(f"<tr><td class=\"num\">{i}</td><td>{esc(label)}</td><td class=\"num\">{esc(_fmt(secs))}</td>"
                    f"<td class=\"nowrap\">{bar}{esc(_pct(share))}</td><td>{_code(lever)}</td></tr>")
    head = "<tr><th>#</th><th>time sink</th><th>s / step</th><th>% of step</th><th>lever</th></tr>"
    return (f'<table class="sinks">{head}{"".join(body)}</table>'
            + _note(f"Mean step: {_fmt(step_s)} s. Largest first; the lever column names the holotrain setting "
                    "that addresses each sink."))


def _flatten(obj, prefix: str = "", out=None, limit: int = 80) -> list[tuple[str, str]]:
    out = [] if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            if len(out) >= limit:
                break
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, limit)
    else:
        text = json.dumps(obj) if isinstance(obj, (list, tuple)) else ("—" if obj is None else str(obj))
        out.append((prefix or "value", text if len(text) <= 200 else text[:197] + "..."))
    return out


def _probe_table(probe) -> str:
    rows = _flatten(probe)
    return _table(rows) + (_note("Truncated to the first 80 fields.") if len(rows) >= 80 else "")


def _trace_files(run_dir: Path) -> list[tuple[str, int]]:
    traces = run_dir / "traces"
    if not traces.is_dir():
        return []
    out = []
    for p in sorted(traces.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            out.append((p.relative_to(run_dir).as_posix(), p.stat().st_size))
    return out[:200]
