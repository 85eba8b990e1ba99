"""Reading a run directory and the figures the report derives from its rows.

Only a missing metrics.jsonl is an error; any other missing or malformed file gives an empty result, and a
field that is null, NaN or not a number counts as missing (`_num`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from holotrain.errors import ConfigError
from holotrain.jsonl import read_jsonl

KNOWN_PHASES = ["data_wait", "forward", "backward", "optimizer"]


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


def _trace_files(run_dir: Path) -> list[tuple[str, int]]:
    traces = run_dir / "traces"
    if not traces.is_dir():
        return []
    out = []
    for p in sorted(traces.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            out.append((p.relative_to(run_dir).as_posix(), p.stat().st_size))
    return out[:200]


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


def _dev_key(d):
    return d if isinstance(d, (int, str)) and not isinstance(d, bool) else str(d)
