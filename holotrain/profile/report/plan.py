"""The report's plan section: for a run trained with `--plan`, the plan's predictions beside what the run measured,
per phase and for memory (RUN_DIR/plan.json, written by holotrain plan)."""

from __future__ import annotations

from pathlib import Path

from holotrain.profile.report.data import _num, _read_json, _steady
from holotrain.profile.report.markup import _note, _table


def _median(values) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def _pair(predicted, measured, fmt: str) -> str:
    p = fmt.format(predicted) if predicted is not None else "-"
    m = fmt.format(measured) if measured is not None else "-"
    ratio = f" ({measured / predicted:.2f}x)" if predicted and measured else ""
    return f"{p} predicted, {m} measured{ratio}"


def plan_section(run_dir: Path, rows: list[dict]) -> str | None:
    plan = _read_json(run_dir / "plan.json")
    if not isinstance(plan, dict):
        return None
    chosen = next((c for c in plan.get("candidates", []) if c.get("chosen")), None)
    if chosen is None:
        return _note("plan.json names no chosen setting.")
    p, steady = chosen["predicted"], _steady(rows)
    step_s = _median(_num(r.get("step_s")) for r in steady)
    tokens_s = _median(_num(r.get("tokens_per_s")) for r in steady)
    peak = max((_num(r.get("mem.peak_gb")) or 0.0 for r in rows), default=0.0) or None
    compute = _median((_num(r.get("time.forward")) or 0) + (_num(r.get("time.backward")) or 0) for r in steady
                      if r.get("time.forward") is not None)
    phases = p.get("phases_s", {})
    items = [("setting", chosen["label"]), ("planned on", plan.get("planned", {}).get("machine", "-")),
             ("step time", _pair(p.get("step_s"), step_s, "{:.3f} s")),
             ("tokens/s", _pair(p.get("tokens_per_s"), tokens_s, "{:,.0f}")),
             ("forward + backward", _pair(phases.get("compute"), compute, "{:.3f} s"))]
    if "offload" in phases:
        items.append(("offload wait", _pair(phases["offload"], _median(_num(r.get("time.offload_wait"))
                                                                           for r in steady), "{:.3f} s")))
    if "checkpoint" in phases:
        items.append(("checkpoint blocking per step", _pair(phases["checkpoint"], _median(
            _num(r.get("time.checkpoint")) for r in steady), "{:.4f} s")))
    items.append(("peak GPU memory" if p.get("gpu_gb") is not None else "host memory",
                  _pair(p.get("gpu_gb") if p.get("gpu_gb") is not None else p.get("host_gb"), peak, "{:.1f} GB")))
    for part, gb in (p.get("memory_gb") or {}).items():
        items.append((f"  {part}", f"{gb:.2f} GB predicted"))
    return _table(items) + _note("The plan's prediction for the chosen setting (after its calibration by trials) "
                                 "against this run's steady steps.")
