"""`holotrain hw probe`: characterize this machine in under a minute and save the figures as JSON.

Host: CPUs, RAM (/proc/meminfo), a pinned-memory allocation (with CUDA), host memcpy GB/s, CPU fused AdamW
params/s (what the offload engine plans with). GPU (null without CUDA): bf16 GEMM TFLOP/s at burst (the
first ~0.1 s after idle) and sustained (after seconds of load), the SM clock and clock-event reasons meanwhile
(NVML through hw/telemetry.py at 100 Hz), the clock ramp after idle, H2D/D2H pinned, pageable H2D and D2D copy
GB/s, power limit and max clocks.

Measuring: warm-up first, CUDA events on the GPU, medians, random inputs. Copy figures are bytes copied per
second (a D2D copy moves twice that through HBM). The budget `seconds` is split over the phases; with CUDA a
45 s budget (the default) takes ~30 s: up to ~7 s of host tests, ~17 s of sustained GEMM, two idle periods of
~1.5 s, a second short burst and ~1 s of copies; `--seconds 5` takes ~5 s plus CUDA start-up.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

GIB = 2**30
GEMM_N = 8192  # bf16 GEMM size: 2 * 8192^3 FLOP, ~1.4 ms on an H200


def _clamp(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


def _meminfo() -> dict:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return None


def median_time(fn, reps: int, warmup: int = 1) -> float:
    """Median wall time of fn() (CPU work)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


# ------------------------------------------------------------------------------------------------ host


def _host(budget_s: float, errors: list[str]) -> dict:
    import torch

    mem = _meminfo()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    host: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "cpu_model": _cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "ram_total_gib": mem["MemTotal"] / GIB if "MemTotal" in mem else None,
        "ram_available_gib": mem["MemAvailable"] / GIB if "MemAvailable" in mem else None,
        "pinned_alloc": None,
        "memcpy_gb_s": None,
        "adamw_params_per_s": None,
        "adamw_params": None,
    }
    avail = mem.get("MemAvailable", 4 * GIB)
    t0 = time.monotonic()

    if torch.cuda.is_available():
        size = int(min(GIB, avail / 8))
        try:
            t = time.perf_counter()
            torch.empty(size, dtype=torch.uint8, pin_memory=True)  # freed at once: the allocation is what is timed
            host["pinned_alloc"] = {"ok": True, "gib": size / GIB, "seconds": time.perf_counter() - t}
        except Exception as e:
            host["pinned_alloc"] = {"ok": False, "gib": size / GIB, "error": str(e).splitlines()[0][:200]}

    try:  # host memcpy: large fp32 tensors, random contents, median of a few copies
        nbytes = int(min(512 * 2**20 if budget_s >= 10 else 128 * 2**20, avail / 16))
        src = torch.rand(nbytes // 4)
        dst = torch.empty_like(src)
        host["memcpy_gb_s"] = nbytes / median_time(lambda: dst.copy_(src), reps=5) / 1e9
    except Exception as e:
        errors.append(f"host memcpy: {e}")

    try:  # CPU fused AdamW, ~50M fp32 params when the budget and the RAM allow it
        left = max(0.3, budget_s - (time.monotonic() - t0))
        steps = 5

        def make(n: int):
            p = torch.rand(n)
            p.grad = torch.rand(n)
            return p, torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)

        p, opt = make(1000)
        opt.step()  # first use of the optimizer: imports and lazy setup (~1 s), not timed
        cal = 2_000_000
        t = time.perf_counter()
        p, opt = make(cal)
        opt.step()  # creates the state
        t_setup = time.perf_counter() - t
        step = median_time(opt.step, reps=3, warmup=0)
        # A step has a fixed cost of a few ms, so small sizes look slower per parameter: a safe estimate.
        left = max(0.3, budget_s - (time.monotonic() - t0))
        per_param = (t_setup + steps * step) / cal
        n = int(_clamp(0.8 * left / per_param, cal, 50_000_000))
        n = int(min(n, avail / 4 / 16))  # param, grad, exp_avg, exp_avg_sq: 16 bytes/param
        if n > cal:
            del p, opt
            p, opt = make(n)
            opt.step()
            step = median_time(opt.step, reps=steps, warmup=0)
        host["adamw_params"] = n
        host["adamw_params_per_s"] = n / step
        del p, opt
    except Exception as e:
        errors.append(f"CPU AdamW: {e}")
    return host


# ------------------------------------------------------------------------------------------------ GPU


def _gemm_loop(a, b, c, seconds: float, depth: int = 8) -> list[float]:
    """Back-to-back c = a @ b for `seconds` of wall time; the seconds of each GEMM (CUDA events between
    consecutive GEMMs: no bubbles while the queue is full). The host stays at most `depth` GEMMs ahead, so
    wall time and GPU time stay aligned (the NVML samples are on wall time)."""
    import torch

    ev = [torch.cuda.Event(enable_timing=True)]
    ev[0].record()
    t_end = time.perf_counter() + seconds
    i = 0
    while True:
        torch.matmul(a, b, out=c)
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        ev.append(e)
        i += 1
        if i > depth:
            ev[i - depth].synchronize()
        if time.perf_counter() >= t_end:
            break
    torch.cuda.synchronize()
    return [ev[k].elapsed_time(ev[k + 1]) / 1e3 for k in range(len(ev) - 1)]


def cuda_event_median(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of fn() on the current stream, by CUDA events, after `warmup` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return statistics.median(ts)


def _copies(dev, budget_s: float, errors: list[str]) -> dict:
    import torch

    out: dict[str, Any] = {"copy_gib": None, "h2d_gb_s": None, "d2h_gb_s": None, "d2d_gb_s": None,
                           "h2d_pageable_gb_s": None}  # fmt: skip
    try:
        free, _ = torch.cuda.mem_get_info(dev)
        nbytes = int(min(GIB if budget_s >= 2 else 256 * 2**20, free / 4, _meminfo().get("MemAvailable", 8 * GIB) / 4))
        nbytes -= nbytes % 4096
        out["copy_gib"] = nbytes / GIB
        n = nbytes // 4
        d1 = torch.rand(n, device=dev)
        d2 = torch.empty_like(d1)
        h = torch.empty(n, dtype=torch.float32, pin_memory=True)
        h.copy_(d1)
        torch.cuda.synchronize()
        reps = 10 if budget_s >= 2 else 4
        out["h2d_gb_s"] = nbytes / cuda_event_median(lambda: d2.copy_(h, non_blocking=True), reps) / 1e9
        out["d2h_gb_s"] = nbytes / cuda_event_median(lambda: h.copy_(d1, non_blocking=True), reps) / 1e9
        out["d2d_gb_s"] = nbytes / cuda_event_median(lambda: d2.copy_(d1), reps) / 1e9
        m = min(n, 64 * 2**20 // 4)
        hp = torch.empty(m, dtype=torch.float32)  # pageable
        hp.copy_(h[:m])

        def pageable():  # staged through the driver's pinned buffer: timed on the wall clock, synchronized
            d2[:m].copy_(hp)
            torch.cuda.synchronize()

        out["h2d_pageable_gb_s"] = m * 4 / median_time(pageable, max(3, reps // 2)) / 1e9
    except Exception as e:
        errors.append(f"copies: {e}")
    return out


def _samples_between(samples: list[dict], t0: float, t1: float) -> list[dict]:
    return [s for s in samples if t0 <= s["t"] <= t1]


def _gpu(budget_s: float, errors: list[str]) -> dict:
    import torch

    from holotrain.hw import dvfs
    from holotrain.hw.nvml import REASONS
    from holotrain.hw.peak import peak_bf16_flops
    from holotrain.hw.telemetry import Telemetry

    idx = torch.cuda.current_device()
    dev = torch.device("cuda", idx)
    props = torch.cuda.get_device_properties(idx)
    peak = peak_bf16_flops(dev)
    gpu: dict[str, Any] = {
        "name": props.name,
        "cuda_index": idx,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": props.total_memory / GIB,
        "peak_bf16_tflops": peak / 1e12 if peak else None,
    }
    sustained_s = _clamp(0.45 * budget_s, 0.5, 20.0)
    idle_s = _clamp(0.04 * budget_s, 0.3, 2.0)
    burst_load_s = _clamp(0.015 * budget_s, 0.2, 0.6)
    gpu["phases_s"] = {"idle": idle_s, "sustained": sustained_s, "second_burst": burst_load_s}

    tel = Telemetry([idx], None, hz=100.0, keep=True)
    gpu["nvml"] = tel.available
    n = GEMM_N
    flops = 2.0 * n**3
    loads: list[tuple[float, float, list[float]]] = []  # (t0, t1 on telemetry's clock, GEMM seconds)
    idles: list[tuple[float, float]] = []
    tel.start()
    try:
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
        for _ in range(3):  # cuBLAS heuristics, workspace
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        for seconds in (sustained_s, burst_load_s):
            i0 = tel.now()
            time.sleep(idle_s)
            t0 = tel.now()
            idles.append((i0, t0))
            times = _gemm_loop(a, b, c, seconds)
            loads.append((t0, tel.now(), times))
        del a, b, c
    except Exception as e:
        errors.append(f"GEMM: {e}")
    finally:
        tel.stop()

    # GEMM throughput: burst = GEMMs starting in the first 0.1 s of each load, sustained = the last half of
    # the long load.
    burst, sustained, timeline = [], [], []
    for k, (_, _, times) in enumerate(loads):
        start, half = 0.0, sum(times) / 2
        first = []
        for t in times:
            if start < 0.1 or len(first) < 3:
                first.append(flops / t / 1e12)
            if k == 0 and start >= half:
                sustained.append(flops / t / 1e12)
            start += t
        burst += first
    if loads:
        times = loads[0][2]
        width, acc, start, flop = max(0.05, sum(times) / 100), 0.0, 0.0, 0.0
        for t in times:
            acc += t
            flop += flops
            if acc - start >= width:
                timeline.append([round(start, 3), round(flop / (acc - start) / 1e12, 1)])
                start, flop = acc, 0.0
    gpu["gemm_n"] = n
    gpu["gemm_burst_tflops"] = statistics.median(burst) if burst else None
    gpu["gemm_sustained_tflops"] = statistics.median(sustained) if sustained else None
    gpu["gemm_timeline"] = timeline  # [seconds into the long load, TFLOP/s]
    gpu["gemm_sustained_mfu"] = (
        gpu["gemm_sustained_tflops"] / gpu["peak_bf16_tflops"]
        if gpu["gemm_sustained_tflops"] and gpu["peak_bf16_tflops"]
        else None
    )

    # NVML: clocks, reasons and power in the same phases.
    keys = ("sm_clock_burst_mhz", "sm_clock_sustained_mhz", "sm_clock_idle_mhz", "throttle_reasons",
            "throttle_breakdown", "power_sustained_w", "ramp_after_idle_s", "clock_drop_s", "max_sm_clock_mhz",
            "max_mem_clock_mhz", "power_limit_w", "default_power_limit_w", "telemetry_hz", "dvfs")  # fmt: skip
    gpu.update(dict.fromkeys(keys))
    samples = [r for r in tel.records if r.get("kind") == "sample" and r.get("sm_clock_mhz") is not None]
    header = next((r for r in tel.records if r.get("kind") == "device"), None)
    if header:
        for k in ("max_sm_clock_mhz", "max_mem_clock_mhz", "power_limit_w", "default_power_limit_w"):
            gpu[k] = header.get(k)
    gpu["telemetry_hz"] = tel.stats()["achieved_hz"]
    if samples and loads:
        t0, t1, _ = loads[0]
        steady = _samples_between(samples, t0 + (t1 - t0) / 2, t1)
        early = [s["sm_clock_mhz"] for t0_, _, _ in loads for s in _samples_between(samples, t0_, t0_ + 0.15)]
        idle_clk = [s["sm_clock_mhz"] for i0, i1 in idles for s in _samples_between(samples, i0 + 0.2, i1)]
        if steady:
            gpu["sm_clock_sustained_mhz"] = statistics.median(s["sm_clock_mhz"] for s in steady)
            pw = [s["power_w"] for s in steady if s.get("power_w") is not None]
            gpu["power_sustained_w"] = statistics.fmean(pw) if pw else None
            thr = [s["throttle"] for s in steady if s.get("throttle") is not None]
            if thr:
                bd = {name: sum(1 for t in thr if t & bit) / len(thr) for name, bit in REASONS}
                gpu["throttle_breakdown"] = bd
                gpu["throttle_reasons"] = [name for name, f in bd.items() if f >= 0.5]
        gpu["sm_clock_burst_mhz"] = max(early) if early else None
        gpu["sm_clock_idle_mhz"] = statistics.median(idle_clk) if idle_clk else None
        ref = gpu["sm_clock_sustained_mhz"] or gpu["sm_clock_burst_mhz"]
        ramps, drops = [], []
        for t0_, t1_, _ in loads:
            during = _samples_between(samples, t0_, t1_)
            if ref:
                hit = next((s for s in during if s["sm_clock_mhz"] >= 0.9 * ref), None)
                ramps.append(None if hit is None else round(hit["t"] - t0_, 4))
            hi, lo = gpu["sm_clock_burst_mhz"], gpu["sm_clock_sustained_mhz"]
            if hi and lo and hi > 1.03 * lo:  # first above the midpoint, then back below it
                mid = (hi + lo) / 2
                up = next((m for m, s in enumerate(during) if s["sm_clock_mhz"] >= mid), None)
                drop = None if up is None else next((s for s in during[up:] if s["sm_clock_mhz"] < mid), None)
                drops.append(None if drop is None else round(drop["t"] - t0_, 4))
        gpu["ramp_after_idle_s"] = ramps  # per load; resolution ~1/telemetry_hz
        gpu["clock_drop_s"] = drops or None  # per load: time until the clock leaves its burst level
        res = dvfs.analyze(tel.records, min_gap_s=min(0.5, 0.8 * idle_s), warm_s=min(3.0, sustained_s / 3))
        gpu["dvfs"] = {k: res[k] for k in ("burst_clock_mhz", "sustained_clock_mhz", "sustained_over_burst",
                                           "ramp_after_idle_s", "boost_after_idle_s", "throttle_breakdown",
                                           "mean_power_w", "energy_j", "energy_j_integrated")}  # fmt: skip

    gpu.update(_copies(dev, _clamp(0.1 * budget_s, 0.5, 5.0), errors))
    return gpu


# ------------------------------------------------------------------------------------------------ entry


def _summary(host: dict, gpu: dict | None) -> str:
    def f(v, fmt="{:.0f}"):
        return "?" if v is None else fmt.format(v)

    adam = host.get("adamw_params_per_s")
    adam_s = f"CPU AdamW {f(adam and adam / 1e9, '{:.2f}')} Gparam/s"
    if gpu is None:
        return (
            f"no CUDA GPU; host {f(host.get('cpu_affinity') or host.get('cpu_count'))} CPUs, "
            f"{f(host.get('ram_available_gib'), '{:.1f}')}/{f(host.get('ram_total_gib'), '{:.1f}')} GiB RAM free, "
            f"memcpy {f(host.get('memcpy_gb_s'), '{:.1f}')} GB/s, {adam_s}"
        )
    reasons = gpu.get("throttle_reasons")
    clock = ""
    if gpu.get("sm_clock_sustained_mhz") is not None:
        clock = f" at {f(gpu['sm_clock_sustained_mhz'])} MHz" + (f" ({', '.join(reasons)})" if reasons else "")
    return (
        f"{gpu.get('name')}: GEMM {f(gpu.get('gemm_burst_tflops'))} TFLOP/s burst / "
        f"{f(gpu.get('gemm_sustained_tflops'))} sustained{clock}, H2D {f(gpu.get('h2d_gb_s'))} GB/s, "
        f"D2H {f(gpu.get('d2h_gb_s'))} GB/s, {adam_s}"
    )


def run_probe(out_path: str | Path, seconds: float = 45.0) -> dict:
    """Probe host and GPU within about `seconds` and write the JSON to `out_path` (atomically)."""
    import torch

    t_start = time.monotonic()
    budget = max(float(seconds), 1.0)
    cuda = torch.cuda.is_available()
    errors: list[str] = []
    host = _host(_clamp(0.15 * budget, 0.5, 8.0) if cuda else 0.9 * budget, errors)
    gpu = None
    if cuda:
        try:
            gpu = _gpu(max(1.0, budget - (time.monotonic() - t_start)), errors)
        except Exception as e:
            errors.append(f"GPU: {e}\n{traceback.format_exc(limit=3)}")
    result = {
        "kind": "hw_probe",
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seconds_budget": seconds,
        "seconds_taken": None,
        "host": host,
        "gpu": gpu,
        "errors": errors,
    }
    result["summary"] = _summary(host, gpu)
    result["seconds_taken"] = round(time.monotonic() - t_start, 2)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    return result
