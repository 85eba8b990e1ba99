"""The hardware sections of the report: clocks, power, energy and the DVFS analysis (from telemetry.jsonl, else the
per-step hw.* means), and the hw_probe.json table."""

from __future__ import annotations

import json

from holotrain.profile.report.charts import MAX_POINTS, PALETTE, _hbars, _line_chart
from holotrain.profile.report.data import _dev_key, _has, _num, _series
from holotrain.profile.report.markup import _figs, _fmt, _note, _pct, _table


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
