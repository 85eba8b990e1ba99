"""`holotrain report RUN_DIR` -> RUN_DIR/report.html: one self-contained page about a finished (or running) run.

Reads `metrics.jsonl` (required), and when present `config.toml`, `telemetry.jsonl` (NVML samples, analysed by
`holotrain.hw.dvfs`), `hw_probe.json`, `plan.json`, `pipeline_timeline.json` (a pipeline step's schedule and bubble)
and `traces/`. Charts are inline SVG drawn here, in Python; the only script is a few lines that record each chart's
rendered size (a self-check for tests and curious readers).
Every field may be null, NaN or missing: a chart without data becomes a one-line note, never an error.

Layout: `data` reads the run directory and derives per-step figures, `charts` draws the SVG charts, `markup`
holds the HTML pieces (formatting, tables, style sheet), `hardware` and `sinks` build the clock/power/energy and
"where the time goes" sections, `moe` the mixture-of-experts routing one; `write_report` here puts the page together.
"""

from __future__ import annotations

import os
from pathlib import Path

from holotrain.jsonl import read_jsonl
from holotrain.profile.report.charts import OTHER_COLOR, PALETTE, PHASE_COLORS, _hbars, _line_chart, _stacked_bars
from holotrain.profile.report.data import (
    _dev_key,
    _has,
    _interval_steps,
    _mean,
    _model_params,
    _num,
    _phase_keys,
    _read_config,
    _read_json,
    _read_metrics,
    _series,
    _steady,
    _top_level,
    _trace_files,
    _weighted_mean,
)
from holotrain.profile.report.hardware import _hw_section, _probe_table
from holotrain.profile.report.moe import moe_section
from holotrain.profile.report.pipeline import pipeline_section
from holotrain.profile.report.plan import plan_section
from holotrain.profile.report.markup import CSS, SCRIPT, _figs, _fmt, _note, _pct, _section, _table, esc
from holotrain.profile.report.sinks import _sinks
from holotrain.profile.report.stragglers import stragglers_section

__all__ = ["write_report"]


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
    # The run's own figure (counter totals over the timed steps) where the last row has it.
    j_per_token = next((_num(r.get("energy.run_j_per_token")) for r in reversed(rows)
                        if _num(r.get("energy.run_j_per_token")) is not None), None)
    if j_per_token is None:
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
    # Training's loss and, at the evaluated steps, the held-out (or eval.sources') loss beside it.
    series = [{"name": "loss", "color": PALETTE[1], "points": _series(rows, "loss")}]
    evaluated = [(x, y) for x, y in _series(rows, "eval.loss") if y is not None]  # a line through the eval steps
    if evaluated:
        series.append({"name": "eval loss", "color": PALETTE[2], "points": evaluated})
    loss = _line_chart(series, chart_id="chart-loss", title="Loss", x_label="step", y_label="loss")
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
    sampled = _samples_section(rows)
    if sampled:
        parts.append(_section("What the model says at each eval", sampled, "samples"))
    parts.append(_section("Goodput", _goodput_section(run_dir, rows), "goodput"))
    planned = plan_section(run_dir, rows)
    if planned is not None:
        parts.append(_section("Plan: predicted and measured", planned, "plan"))
    pipeline = pipeline_section(run_dir)
    if pipeline is not None:
        parts.append(_section("Pipeline schedule and bubble", pipeline, "pipeline"))
    routing = moe_section(rows)  # a mixture-of-experts model's moe.* fields
    if routing is not None:
        parts.append(_section("Mixture of experts: routing", routing, "moe"))

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
                              x_label="step", y_label="seconds per step", clip_outliers=True)
        body = _figs(chart) + _note("\"other\" = step_s minus the recorded phases (host and launch overhead, "
                                    "synchronization), clamped at 0. A bar over 3x the median (the first logged "
                                    "interval, which compiles) is cut at twice the median, its value written above "
                                    "it.") if chart else _note("Phase times are all zero.")
    else:
        body = _note("No time.* phase times in metrics.jsonl (profile.phases off?).")
    parts.append(_section("Where each step goes", body, "phases"))
    stragglers = stragglers_section(rows, cfg)
    if stragglers is not None:
        parts.append(_section("Stragglers: each rank's step", stragglers, "stragglers"))

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


GOODPUT_PARTS = (("startup", "start-up: process, data plane, model build, compilation"),
                 ("recovery", "recovery: loading the checkpoint resumed from"),
                 ("train", "training steps"), ("checkpoint", "checkpoint saves (blocking part)"),
                 ("data_wait", "waiting for data"), ("other", "the rest: teardown, last write, logging"))


def _samples_section(rows: list[dict], last: int = 6) -> str:
    """The eval.samples of the last `last` evals: per prompt, its greedy continuation at each of those steps."""
    evals = [r for r in rows if isinstance(r.get("eval.samples"), list) and r["eval.samples"]][-last:]
    if not evals:
        return ""
    prompts = list(dict.fromkeys(s.get("prompt", "") for r in evals for s in r["eval.samples"]))
    body = []
    for prompt in prompts:
        lines = [(f"step {r['step']}", next((s.get("text", "") for s in r["eval.samples"]
                                             if s.get("prompt") == prompt), "")) for r in evals]
        body.append(f"<h3>{esc(repr(prompt))}</h3>" + _table(lines, "samples"))
    return "".join(body) + _note("Greedy continuations of eval.prompts (or each source's first held-out document) "
                                 "at each eval; the newest last.")


def _goodput_section(run_dir: Path, rows: list[dict]) -> str:
    """Useful tokens per second of wall clock over the whole process, and where the wall time went: goodput.json
    (written after teardown), else the last metrics row (up to the last step)."""
    g = _read_json(run_dir / "goodput.json")
    source = "goodput.json"
    if not isinstance(g, dict):
        g = next((r for r in reversed(rows) if "goodput" in r), None)
        source = "the last metrics row"
    if not isinstance(g, dict) or not _num(g.get("goodput.wall_s")):
        return _note("No goodput figures (a run that has not finished, or one from an earlier version).")
    wall = _num(g["goodput.wall_s"])
    items = [(label, (_num(g.get(f"goodput.{key}_s")) or 0.0) / wall) for key, label in GOODPUT_PARTS]
    chart = _hbars(items, chart_id="chart-goodput", title="Wall time of the process, by what it was spent on",
                   x_label="share of wall time")
    rate = _num(g.get("goodput"))
    table = _table([("goodput (useful tokens / wall second)", f"{rate:,.0f}" if rate is not None else "-"),
                    ("wall time", f"{wall:.1f} s"),
                    *((label, f"{(_num(g.get(f'goodput.{key}_s')) or 0.0):.1f} s") for key, label in GOODPUT_PARTS)])
    return _figs(chart) + table + _note(f"From {source}. Steps skipped as non-finite are not useful tokens.")
