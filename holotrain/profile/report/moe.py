"""The report's mixture-of-experts section, from the moe.* fields of metrics.jsonl (holotrain/train/routing.py): the
load per block and expert at the latest logged step as a heat map (each expert's token copies over the block's
mean), each block's max / mean load over the steps, and the latest routing figures."""

from __future__ import annotations

import math

from holotrain.profile.report.charts import PALETTE, _heatmap, _line_chart
from holotrain.profile.report.data import _num
from holotrain.profile.report.markup import _figs, _fmt, _note, _table

MAX_LINES = 10  # blocks drawn in the max / mean chart: the most imbalanced at the latest step


def moe_section(rows: list[dict]) -> str | None:
    """The section's body, or None for a run without moe.* fields (a dense model)."""
    latest = next((r for r in reversed(rows) if _loads(r)), None)
    if latest is None:
        return None
    loads = _loads(latest)
    layers = _layers(latest, len(loads))
    ratios = [[n / (sum(load) / len(load)) if sum(load) else None for n in load] for load in loads]
    heat = _heatmap(ratios, [f"block {i}" for i in layers], [str(e) for e in range(len(loads[0]))],
                    chart_id="chart-moe-load", title=f"Load per block and expert at step {latest['step']} (÷ the "
                    "block's mean)", x_label="expert", y_label="block", unit="×")

    # Each block's max / mean over the logged steps; with many blocks, the most imbalanced at the latest step.
    last = _by_layer(latest, "moe.load_max_over_mean")
    shown = sorted(layers, key=lambda i: -(last.get(i) or 0.0))[:MAX_LINES]
    by_row = [(r["step"], _by_layer(r, "moe.load_max_over_mean")) for r in rows]
    series = [{"name": f"block {layer}", "color": PALETTE[n % len(PALETTE)],
               "points": [(step, values.get(layer)) for step, values in by_row]}
              for n, layer in enumerate(sorted(shown))]
    lines = _line_chart(series, chart_id="chart-moe-max-load", title="Max / mean load per block", x_label="step",
                        y_label="max / mean", refs=[(1.0, "balanced")])

    n_experts = len(loads[0])
    facts = [("step", _fmt(latest["step"])),
             ("worst block's max / mean load", _fmt(_num(latest.get("moe.max_load")))),
             ("router entropy (mean over blocks), nats",
              f"{_fmt(_num(latest.get('moe.router_entropy')))} (uniform over {n_experts} experts: "
              f"{math.log(n_experts):.3g})"),
             ("balance loss (mean over blocks; 1 = balanced)", _fmt(_num(latest.get("moe.balance_loss")))),
             ("z-loss (mean over blocks)", _fmt(_num(latest.get("moe.z_loss"))))]
    if _num(latest.get("moe.top_gate")) is not None:  # rows written before this metric have none
        facts.append(("a token's largest weight over its k (mean over blocks; 1/k: alike)",
                      _fmt(_num(latest["moe.top_gate"]))))
    if _num(latest.get("moe.expert_bias_max_abs")) is not None:
        facts.append(("largest |balancing bias|", _fmt(_num(latest["moe.expert_bias_max_abs"]))))
    note = ("Loads are token copies (a token counts once for each of its experts) of one logged step, summed over its "
            "micro-batches and the data-parallel ranks; white is the block's mean, red above it, blue below.")
    if len(layers) > len(shown):
        note += f" The line chart shows the {len(shown)} blocks most imbalanced at the latest step of {len(layers)}."
    return _figs(heat, lines) + _table(facts) + _note(note)


def _loads(row: dict) -> list[list[float]] | None:
    """The row's moe.tokens_per_expert when it is a non-empty rectangle of numbers, else None."""
    loads = row.get("moe.tokens_per_expert")
    if not isinstance(loads, list) or not loads or not all(isinstance(load, list) and load for load in loads):
        return None
    if len({len(load) for load in loads}) != 1:
        return None
    values = [[_num(n) for n in load] for load in loads]
    return None if any(v is None for load in values for v in load) else values


def _layers(row: dict, n: int) -> list[int]:
    """The blocks the row's per-layer lists are of (moe.layers), else 0..n-1."""
    layers = row.get("moe.layers")
    good = isinstance(layers, list) and len(layers) == n and all(type(i) is int for i in layers)
    return layers if good else list(range(n))


def _by_layer(row: dict, key: str) -> dict[int, float | None]:
    """A per-layer list of the row by block (empty when either list is missing or malformed)."""
    values = row.get(key)
    if not isinstance(values, list):
        return {}
    return {layer: _num(v) for layer, v in zip(_layers(row, len(values)), values)}
