"""DVFS analysis of a telemetry.jsonl trace: how fast the GPUs really ran, why, and what it cost.

    result = analyze(load_telemetry(run_dir / "telemetry.jsonl"), metrics_rows)
    print("\n".join(summarize(result)))

Assumptions (each a keyword argument of analyze()):
- A sample is *busy* when NVML utilization >= `busy_util` % (without a utilization reading: when the GpuIdle
  reason bit is clear). It is *idle* when utilization <= `idle_util` % and the GpuIdle bit is set (or there
  is no reasons reading). NVML utilization is averaged over the last 1/6..1 s and lags a change of load; the
  GpuIdle bit is instantaneous, which is why an idle gap ends at the first sample whose GpuIdle bit clears.
- *Burst* is the clock a card reaches when work starts: the 99th percentile of the SM clocks of non-idle
  samples in the first `burst_window_s` after each end of idleness (and of all busy samples; the higher). A
  power-capped card holds it only briefly (an H200 leaves 1980 MHz within ~0.12 s of sustained GEMM), so
  over a long run it is far from the 99th percentile of all samples.
- *Sustained* is the median busy SM clock after the first `warm_s` seconds of busy time of each device's
  trace (after half the busy time when there is less than 2 x `warm_s`).
- An idle gap is a run of idle samples lasting >= `min_gap_s` that ends in non-idle samples. Its *ramp* is the
  time from its end until the SM clock reaches `ramp_level` x the sustained clock (the level the work runs at;
  the burst clock when there is no sustained figure): ~0 when clocks stay up while idle, or when the card
  jumps straight to its boost clock. Its *boost* is how long the clock, once above the midpoint between burst
  and sustained, stays there (only when they differ by > 3%): the free speed-up a card gives after idling.
- A header line ("kind": "device") starts a new segment for its device: a resumed run appends to the same
  file, and neither energy deltas nor integrals span the gap between two runs. Device indices are NVML
  indices, unique within one node: analyze one node's trace at a time.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from holotrain.hw.nvml import GPU_IDLE, REASONS
from holotrain.jsonl import read_jsonl


def load_telemetry(path: str | Path) -> list[dict]:
    """The records of a telemetry.jsonl file, in file order; a truncated last line is skipped."""
    return read_jsonl(path)


def _percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _stats(values: list[float]) -> dict:
    return {
        "count": len(values),
        "median": statistics.median(values) if values else None,
        "max": max(values) if values else None,
    }


def _segments(records: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(header records, per-device segments of sample records sorted by time)."""
    headers: list[dict] = []
    current: dict[Any, list[dict]] = {}
    segments: list[list[dict]] = []
    for r in records:
        kind = r.get("kind")
        if kind == "device":
            headers.append(r)
            seg: list[dict] = []
            segments.append(seg)
            current[r.get("device")] = seg
        elif kind == "sample" and isinstance(r.get("t"), (int, float)):
            seg = current.get(r.get("device"))
            if seg is None:  # samples without a header (a file cut at its start)
                seg = current[r.get("device")] = []
                segments.append(seg)
            seg.append(r)
    return headers, [sorted(s, key=lambda r: r["t"]) for s in segments if s]


def analyze(
    records: list[dict],
    metrics: list[dict] | None = None,
    *,
    busy_util: float = 50.0,
    idle_util: float = 5.0,
    min_gap_s: float = 0.5,
    warm_s: float = 3.0,
    burst_window_s: float = 0.5,
    ramp_level: float = 0.9,
) -> dict:
    """Clock, throttle and energy figures of a telemetry trace (module docstring: definitions).

    `clock_normalized_mfu` is the mean MFU of the `metrics` rows scaled by max_clock / mean busy SM clock:
    what the MFU would have been had the SM clock stayed at its maximum, assuming the step time is
    compute-bound and scales with 1/clock. It is an upper bound (memory-bound kernels, communication and host
    stalls do not speed up with the SM clock); the gap to the measured MFU is the throughput the clock policy
    (power cap, thermals) cost. `clock_loss_frac` = 1 - mean busy clock / max clock is the same loss as a
    share of the busy (compute-bound) time.
    """
    headers, segments = _segments(records)

    def busy(s: dict) -> bool | None:
        u, thr = s.get("util_gpu"), s.get("throttle")
        if u is not None:
            return u >= busy_util
        if thr is not None:
            return not thr & GPU_IDLE
        return None

    def idle(s: dict) -> bool:
        u, thr = s.get("util_gpu"), s.get("throttle")
        if u is None and thr is None:
            return False
        return (u is None or u <= idle_util) and (thr is None or bool(thr & GPU_IDLE))

    busy_clocks: list[float] = []  # all busy SM clocks
    start_clocks: list[float] = []  # busy SM clocks within burst_window_s of a start of busy work
    sustained_clocks: list[float] = []
    n_classified = n_busy = 0
    thr_busy: list[int] = []
    powers: list[float] = []
    energy = integrated = 0.0
    have_energy = have_integral = False
    t_min = t_max = None

    for seg in segments:
        t_min = seg[0]["t"] if t_min is None else min(t_min, seg[0]["t"])
        t_max = seg[-1]["t"] if t_max is None else max(t_max, seg[-1]["t"])
        # Energy: counter delta and trapezoid of power, within the segment only.
        e = [s["energy_j"] for s in seg if s.get("energy_j") is not None]
        if len(e) >= 2 and e[-1] >= e[0]:
            energy += e[-1] - e[0]
            have_energy = True
        for a, b in zip(seg, seg[1:]):
            if a.get("power_w") is not None and b.get("power_w") is not None:
                integrated += 0.5 * (a["power_w"] + b["power_w"]) * (b["t"] - a["t"])
                have_integral = True
        powers += [s["power_w"] for s in seg if s.get("power_w") is not None]

        # Busy time, with the dt of a sample capped so that a sampling hole does not count as busy time.
        dts = [b["t"] - a["t"] for a, b in zip(seg, seg[1:])]
        cap = 5 * statistics.median(dts) if dts else 0.0
        flags = [busy(s) for s in seg]
        busy_t = []  # cumulative busy time at each sample
        acc = 0.0
        for i, s in enumerate(seg):
            busy_t.append(acc)
            if flags[i] and i + 1 < len(seg):
                acc += min(dts[i], cap)
        warm = min(warm_s, acc / 2)
        active_start = None  # first non-idle sample after idle (or the segment start)
        for i, s in enumerate(seg):
            clk = s.get("sm_clock_mhz")
            if idle(s):
                active_start = None
            else:
                if active_start is None:
                    active_start = s["t"]
                if clk is not None and s["t"] - active_start <= burst_window_s:
                    start_clocks.append(clk)
            if flags[i] is None:
                continue
            n_classified += 1
            if not flags[i]:
                continue
            n_busy += 1
            if s.get("throttle") is not None:
                thr_busy.append(s["throttle"])
            if clk is None:
                continue
            busy_clocks.append(clk)
            if busy_t[i] >= warm:
                sustained_clocks.append(clk)

    burst = max(
        (p for p in (_percentile(busy_clocks, 99), _percentile(start_clocks, 99)) if p is not None), default=None
    )
    sustained = statistics.median(sustained_clocks) if sustained_clocks else None
    mean_busy = statistics.fmean(busy_clocks) if busy_clocks else None
    max_hdr = [h["max_sm_clock_mhz"] for h in headers if h.get("max_sm_clock_mhz")]
    observed = [s["sm_clock_mhz"] for seg in segments for s in seg if s.get("sm_clock_mhz") is not None]
    max_clock = max(max_hdr) if max_hdr else (max(observed) if observed else None)

    # Idle gaps, ramps and post-idle boosts.
    ref = sustained if sustained is not None else burst
    target = ramp_level * ref if ref is not None else None
    boost_mid = (burst + sustained) / 2 if burst and sustained and burst > 1.03 * sustained else None
    gaps: list[dict] = []
    for seg in segments:
        i, n = 0, len(seg)
        while i < n:
            if not idle(seg[i]):
                i += 1
                continue
            j = i
            while j < n and idle(seg[j]):
                j += 1
            if j >= n:  # idle until the end of the trace: not a gap that ends in work
                break
            duration = seg[j]["t"] - seg[i]["t"]
            if duration >= min_gap_s:
                t_end = seg[j]["t"]
                k = j  # the busy stretch after the gap: until the next idle sample
                while k < n and not idle(seg[k]):
                    k += 1
                after = [s for s in seg[j:k] if s.get("sm_clock_mhz") is not None]
                ramp = boost = None
                if target is not None:
                    hit = next((s for s in after if s["sm_clock_mhz"] >= target), None)
                    if hit is not None:
                        ramp = hit["t"] - t_end
                if boost_mid is not None:
                    up = next((m for m, s in enumerate(after) if s["sm_clock_mhz"] >= boost_mid), None)
                    if up is not None:
                        drop = next((s for s in after[up:] if s["sm_clock_mhz"] < boost_mid), None)
                        if drop is not None:
                            boost = drop["t"] - after[up]["t"]
                gaps.append(
                    {"device": seg[i].get("device"), "start_t": seg[i]["t"], "duration_s": duration,
                     "ramp_s": ramp, "boost_s": boost}
                )  # fmt: skip
            i = j

    breakdown = (
        {name: sum(1 for t in thr_busy if t & bit) / len(thr_busy) for name, bit in REASONS} if thr_busy else None
    )
    mfu_rows = [m["mfu"] for m in (metrics or []) if isinstance(m.get("mfu"), (int, float))]
    mean_mfu = statistics.fmean(mfu_rows) if mfu_rows else None
    clock_ratio = max_clock / mean_busy if max_clock and mean_busy else None

    return {
        "devices": headers,
        "duration_s": (t_max - t_min) if t_min is not None else None,
        "burst_clock_mhz": burst,
        "sustained_clock_mhz": sustained,
        "mean_busy_clock_mhz": mean_busy,
        "max_clock_mhz": max_clock,
        "sustained_over_burst": sustained / burst if sustained and burst else None,
        "ramp_after_idle_s": _stats([g["ramp_s"] for g in gaps if g["ramp_s"] is not None]),
        "boost_after_idle_s": _stats([g["boost_s"] for g in gaps if g["boost_s"] is not None]),
        "idle_gaps": gaps,
        "throttle_breakdown": breakdown,
        "busy_frac": n_busy / n_classified if n_classified else None,
        "mean_power_w": statistics.fmean(powers) if powers else None,
        "energy_j": energy if have_energy else None,
        "energy_j_integrated": integrated if have_integral else None,
        "mean_mfu": mean_mfu,
        "clock_normalized_mfu": mean_mfu * clock_ratio if mean_mfu is not None and clock_ratio else None,
        "clock_loss_frac": 1.0 - mean_busy / max_clock if mean_busy and max_clock else None,
    }


def summarize(result: dict) -> list[str]:
    """A few human lines about an analyze() result."""
    r = result
    fmt = lambda v, f="{:.0f}": "?" if v is None else f.format(v)
    names = sorted({h.get("name") for h in r.get("devices") or [] if h.get("name")})
    lines = []
    head = f"{len(r.get('devices') or [])} device(s)" + (f" ({', '.join(names)})" if names else "")
    if r.get("duration_s") is not None:
        head += f", {r['duration_s']:.1f} s traced, busy {fmt(r.get('busy_frac') and 100 * r['busy_frac'])}%"
    lines.append(head)
    if r.get("burst_clock_mhz") is not None:
        line = (
            f"SM clock: burst {fmt(r['burst_clock_mhz'])} MHz, sustained {fmt(r.get('sustained_clock_mhz'))} MHz"
            f", busy mean {fmt(r.get('mean_busy_clock_mhz'))} MHz (max {fmt(r.get('max_clock_mhz'))})"
        )
        if r.get("clock_loss_frac") is not None:
            line += f"; {100 * r['clock_loss_frac']:.0f}% of compute-bound time lost to clocks below max"
        lines.append(line)
    bd = r.get("throttle_breakdown")
    if bd:
        top = [f"{k} {100 * v:.0f}%" for k, v in sorted(bd.items(), key=lambda kv: -kv[1]) if v >= 0.01]
        lines.append("while busy, clocks held by: " + (", ".join(top) if top else "nothing"))
    if r.get("mean_power_w") is not None or r.get("energy_j") is not None:
        line = f"power: mean {fmt(r.get('mean_power_w'))} W per device"
        if r.get("energy_j") is not None:
            line += f"; energy {r['energy_j'] / 1e3:.1f} kJ (counter)"
        if r.get("energy_j_integrated") is not None:
            line += f", {r['energy_j_integrated'] / 1e3:.1f} kJ (integrated samples)"
        lines.append(line)
    ramp, boost = r.get("ramp_after_idle_s") or {}, r.get("boost_after_idle_s") or {}
    if ramp.get("count") or r.get("idle_gaps"):
        line = (
            f"{len(r.get('idle_gaps') or [])} idle gap(s): clock ramp after idle median "
            f"{fmt(ramp.get('median'), '{:.3f}')} s, max {fmt(ramp.get('max'), '{:.3f}')} s"
        )
        if boost.get("count"):
            line += f"; boost above sustained lasts {fmt(boost.get('median'), '{:.2f}')} s"
        lines.append(line)
    if r.get("clock_normalized_mfu") is not None:
        lines.append(f"MFU {r['mean_mfu']:.3f} measured, {r['clock_normalized_mfu']:.3f} at max clock (upper bound)")
    return lines
