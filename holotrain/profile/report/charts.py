"""The report's charts as inline SVG, drawn in Python: line charts, stacked bars and horizontal bars.

A chart without data is the empty string (the caller writes a note instead). Long series are reduced to a
min/max envelope, many bars are averaged in groups, so a long run's page stays small.
"""

from __future__ import annotations

import math

from holotrain.profile.report.data import _mean, _num
from holotrain.profile.report.markup import _fmt, esc

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
MAX_POINTS = 2000  # per series; longer series are reduced to a min/max envelope of this many points
MAX_BARS = 300  # stacked bars; more logged steps are averaged in groups
MAX_STEP_MARKS = 60
W, H = 600, 300  # default chart size (px)


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
                  x_label: str, y_label: str, width: int = 2 * W + 16, height: int = H + 20,
                  clip_outliers: bool = False, x_name: str = "step") -> str:
    """One stacked bar per x (bars averaged in groups above MAX_BARS). layers: [(name, values, color)]; x_name
    names an x in the bars' tooltips.
    clip_outliers: a bar more than 3x the median (the first, compiling step) is cut at twice the median and
    labelled with its value, so that it does not flatten every other bar."""
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
    positive = sorted(t for t in totals if t > 0)
    median = positive[len(positive) // 2]
    cap = 2 * median if clip_outliers and max(totals) > 3 * median else max(totals)
    yt = _nice_ticks(0.0, cap, 5)
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
            if v <= 0 or acc >= y1:
                continue
            y_top, y_bot = y_of(min(y1, acc + v)), y_of(acc)
            out.append(f'<rect class="mark" x="{x:.1f}" y="{y_top:.1f}" width="{bw:.1f}" '
                       f'height="{max(0.5, y_bot - y_top):.1f}" fill="{color}"><title>{esc(x_name)} {esc(_fmt(xs[i]))} '
                       f'{esc(name)}: {esc(_fmt(v))} s</title></rect>')
            acc += v
        if totals[i] > y1:
            out.append(f'<text x="{x + bw / 2:.1f}" y="{top - 2:.1f}" text-anchor="middle" font-size="10">'
                       f'{esc(_fmt(totals[i]))} s</text>')
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


def _shade(value: float, high: float) -> str:
    """A diverging colour around 1 (white): toward blue down to 0, toward red up to `high`."""
    if value >= 1:
        t, (r, g, b) = min(1.0, (value - 1) / max(high - 1, 1e-9)), (214, 39, 40)
    else:
        t, (r, g, b) = min(1.0, 1 - max(value, 0.0)), (31, 119, 180)
    return "#%02x%02x%02x" % tuple(round(255 + (c - 255) * t) for c in (r, g, b))


def _heatmap(values: list[list[float | None]], row_labels: list[str], col_labels: list[str], *, chart_id: str,
             title: str, x_label: str, y_label: str, unit: str = "", width: int = 2 * W + 16) -> str:
    """A grid of cells, rows x columns of `values` (ratios to a reference: 1 is white, below it blue down to 0, above
    it red up to the largest value, at least 2), with a colour bar; each cell's value in its tooltip."""
    cells = [[_num(v) for v in row] for row in values]
    finite = [v for row in cells for v in row if v is not None]
    if not finite or not col_labels:
        return ""
    high = max(2.0, max(finite))
    n_rows, n_cols = len(cells), len(col_labels)
    left, top, right, bottom = 64, 34, 90, 44
    pw = width - left - right
    cell_w, cell_h = pw / n_cols, max(6.0, min(36.0, 360 / n_rows))
    ph = cell_h * n_rows
    bar_h = min(160.0, max(ph, 72.0))  # the colour bar, beside the grid
    height = top + max(ph, bar_h) + bottom
    out = []
    for i, row in enumerate(cells):
        for j, v in enumerate(row):
            if v is None:
                continue
            out.append(f'<rect class="mark" x="{left + j * cell_w:.1f}" y="{top + i * cell_h:.1f}" '
                       f'width="{cell_w:.1f}" height="{cell_h:.1f}" fill="{_shade(v, high)}">'
                       f'<title>{esc(row_labels[i])}, {esc(x_label)} {esc(col_labels[j])}: {esc(_fmt(v))}{esc(unit)}</title></rect>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw:.1f}" height="{ph:.1f}" fill="none" stroke="#888"/>')
    every_row, every_col = max(1, math.ceil(n_rows * 12 / ph)), max(1, math.ceil(n_cols / 32))
    for i in range(0, n_rows, every_row):
        out.append(f'<text x="{left - 6}" y="{top + (i + 0.5) * cell_h + 4:.1f}" text-anchor="end">'
                   f'{esc(row_labels[i])}</text>')
    for j in range(0, n_cols, every_col):
        out.append(f'<text x="{left + (j + 0.5) * cell_w:.1f}" y="{top + ph + 16:.1f}" text-anchor="middle">'
                   f'{esc(col_labels[j])}</text>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{top + ph + 34:.1f}" text-anchor="middle" class="axis">'
               f"{esc(x_label)}</text>"
               f'<text transform="translate(14,{top + ph / 2:.0f}) rotate(-90)" text-anchor="middle" class="axis">'
               f"{esc(y_label)}</text>")
    # The colour bar: 0 at the bottom, 1 (white) at its middle mark, `high` at the top.
    bar_x, steps = left + pw + 16, 20
    for k in range(steps):
        v = (k + 0.5) / steps * high
        out.append(f'<rect x="{bar_x}" y="{top + bar_h - (k + 1) * bar_h / steps:.1f}" width="14" '
                   f'height="{bar_h / steps + 0.5:.1f}" fill="{_shade(v, high)}"/>')
    for v in (0.0, 1.0, high):
        out.append(f'<text x="{bar_x + 18}" y="{top + bar_h - v / high * bar_h + 4:.1f}" class="small">'
                   f'{esc(_fmt(v))}{esc(unit)}</text>')
    return _svg(chart_id, title, width, height, "".join(out))
