"""NVML telemetry: a background thread samples clocks, power, energy, temperature, utilization and clock-event
reasons of this rank's GPUs and appends them to RUN_DIR/telemetry.jsonl; `window()` aggregates them per logged
step for metrics.jsonl.

    tel = Telemetry(local_cuda_indices, run_dir / "telemetry.jsonl", cfg.hw.telemetry_hz, rank)
    tel.start()
    ...                                  # after a device sync at each logged step:
    tel.mark(step); w = tel.window()     # w["energy.joules"] / steps_in_window = J per step
    tel.stop()

telemetry.jsonl lines (the file is opened for append: a resumed run continues it):
    {"kind": "device", "t", "device", "cuda_index", "rank", "name", "uuid", "max_sm_clock_mhz",
     "max_mem_clock_mhz", "power_limit_w", "default_power_limit_w"}          one per device at start()
    {"kind": "sample", "t", "device", "sm_clock_mhz", "mem_clock_mhz", "power_w", "energy_j", "temp_c",
     "util_gpu", "util_mem", "throttle"}                                      one per device per tick
    {"kind": "step", "t", "step"}                                             one per mark()
`t` is unix seconds (anchored once, then advanced with time.monotonic), `device` the NVML index, `energy_j`
the card's cumulative energy counter, `throttle` the clock-event reasons bitmask (hw/nvml.py names the bits).
A field whose NVML call fails is null; a field the device does not support stays null.

Cost: a tick is one NVML call per field per device (~7-8 calls; ctypes releases the GIL during each call, the
JSON encoding holds it). Against tests/fake_nvml.py a tick costs ~45 us for one device and ~85 us for two
(Python only, 2-core CI box; 200 Hz sustained). On a real card each NVML call is a driver ioctl, so
`stats()["mean_sample_s"]` is the number to look at: at 100 Hz a tick must stay well under 10 ms, and the
thread skips missed ticks (staying on its time.monotonic grid) instead of bunching them up. The file grows
by ~230 bytes per device per tick (~80 MB per device-hour at 100 Hz).

Without NVML (nvidia-ml-py missing, no driver, no CUDA, a device that does not map) `available` is False and
every method is a no-op: start/mark/stop do nothing and window() returns the same keys with None values.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from holotrain.hw import nvml as nv

WINDOW_KEYS = (
    "energy.joules",
    "hw.sm_clock_mhz",
    "hw.mem_clock_mhz",
    "hw.power_w",
    "hw.temp_c",
    "hw.power_capped_frac",
    "hw.util_gpu",
)

_SAMPLE_FIELDS = ("sm_clock_mhz", "mem_clock_mhz", "power_w", "energy_j", "temp_c", "util", "throttle")


def _field_value(v: Any) -> float | int:
    """The number in an nvmlFieldValue_t, by its valueType (NVML_VALUE_TYPE_*: 0 double, 1 uint, 2 ulong,
    3 ulonglong, 4 slonglong, 5 sint, 6 ushort)."""
    attr = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(
        int(v.valueType), "uiVal"
    )
    return getattr(v.value, attr)


class _Device:
    """One sampled GPU: its handle, which optional readings it supports, and its energy bookkeeping."""

    def __init__(self, handle: Any, cuda_index: int | None):
        self.handle = handle
        self.cuda_index = cuda_index
        self.index: int | None = None
        self.disabled: set[str] = set()  # fields the device does not support: not asked again
        self.instant_power = False  # NVML_FI_DEV_POWER_INSTANT works (else nvmlDeviceGetPowerUsage)
        self.reasons_fn: Any = None  # nvmlDeviceGetCurrentClocksEventReasons or ...ThrottleReasons
        self.energy_mark_mj: float | None = None  # counter at the previous window()
        self.integrated_j = 0.0  # trapezoid of power samples since the previous window()
        self.last_power: tuple[float, float] | None = None  # (monotonic t, W) of the previous sample


class Telemetry:
    def __init__(
        self,
        cuda_indices: list[int] | None,
        path: Path | str | None,
        hz: float = 100.0,
        rank: int = 0,
        nvml: Any = None,
        *,
        devices: list | None = None,
        keep: bool = False,
        flush_s: float = 1.0,
    ):
        """`devices`: NVML indices or handles to sample instead of mapping `cuda_indices` (tests, tools).
        `keep`: also keep every record in `self.records` (the probe analyzes them in memory)."""
        self.path = Path(path) if path is not None else None
        self.hz = max(float(hz), 0.1)
        self.rank = rank
        self.keep = keep
        self.flush_s = flush_s
        self.records: list[dict] = []
        self.available = False
        self._devices: list[_Device] = []
        self._lock = threading.Lock()  # buffer, window accumulators, records
        self._write_lock = threading.Lock()  # order of writes to the file
        self._window_lock = threading.Lock()  # one window() at a time
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._buf: list[str] = []
        self._started = self._stopped = False
        self._owns_init = False
        self._mono0 = time.monotonic()
        self._unix0 = time.time()
        self._reset_window()
        self._n_samples = 0
        self._sample_cost = 0.0
        self._run_t0: float | None = None
        self._run_t1: float | None = None
        self._final_energy: list[float | None] | None = None

        self._nvml = nv.load(nvml)
        if not nv.init(self._nvml):
            return
        self._owns_init = True
        try:
            cuda = list(cuda_indices or [])
            handles = nv.resolve_handles(self._nvml, cuda, devices)
            if not handles:
                raise RuntimeError("no device to sample")
            self._devices = [_Device(h, cuda[i] if i < len(cuda) else None) for i, h in enumerate(handles)]
            for d in self._devices:
                self._probe_device(d)
        except Exception:
            self._devices = []
            nv.shutdown(self._nvml)
            self._owns_init = False
            return
        self.available = True

    # ---------------------------------------------------------------------------------------- setup

    def _probe_device(self, d: _Device) -> None:
        m = self._nvml
        try:
            d.index = int(m.nvmlDeviceGetIndex(d.handle))
        except Exception:
            d.index = d.cuda_index
        fi = getattr(m, "NVML_FI_DEV_POWER_INSTANT", None)
        if fi is not None and hasattr(m, "nvmlDeviceGetFieldValues"):
            try:
                v = m.nvmlDeviceGetFieldValues(d.handle, [fi])[0]
                instant = _field_value(v) if int(v.nvmlReturn) == 0 else 0
                try:
                    usage = m.nvmlDeviceGetPowerUsage(d.handle)
                except Exception:
                    usage = None
                # Both in mW; a wildly different reading means a unit we do not understand: use PowerUsage.
                d.instant_power = instant > 0 and (not usage or 0.05 < instant / usage < 20)
            except Exception:
                pass
        # Clock-event reasons: the new name (driver >= 535), else the old one (same bits).
        for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            f = getattr(m, fn, None)
            if f is None:
                continue
            try:
                f(d.handle)
            except Exception as e:
                if nv.is_unsupported(m, e):
                    continue
            d.reasons_fn = f
            break
        else:
            d.disabled.add("throttle")

    def _header(self, d: _Device) -> dict:
        m, h = self._nvml, d.handle

        def get(fn, *args, scale=None, cast=int):
            try:
                v = getattr(m, fn)(h, *args)
                return cast(v / scale) if scale else cast(v)
            except Exception:
                return None

        return {
            "kind": "device",
            "t": round(self._now_unix(), 6),
            "device": d.index,
            "cuda_index": d.cuda_index,
            "rank": self.rank,
            "name": get("nvmlDeviceGetName", cast=nv.as_str),
            "uuid": get("nvmlDeviceGetUUID", cast=nv.as_str),
            "max_sm_clock_mhz": get("nvmlDeviceGetMaxClockInfo", m.NVML_CLOCK_SM),
            "max_mem_clock_mhz": get("nvmlDeviceGetMaxClockInfo", m.NVML_CLOCK_MEM),
            "power_limit_w": get("nvmlDeviceGetPowerManagementLimit", scale=1000.0, cast=float),
            "default_power_limit_w": get("nvmlDeviceGetPowerManagementDefaultLimit", scale=1000.0, cast=float),
        }

    def _now_unix(self) -> float:
        return self._unix0 + (time.monotonic() - self._mono0)

    def now(self) -> float:
        """Unix seconds on the clock of the records' "t" (to line events up with samples)."""
        return self._now_unix()

    # ---------------------------------------------------------------------------------------- sampling

    def _read(self, d: _Device, field: str) -> Any:
        """One reading, or None. An unsupported field is disabled for good; any other failure is one null."""
        if field in d.disabled:
            return None
        m, h = self._nvml, d.handle
        try:
            if field == "sm_clock_mhz":
                return int(m.nvmlDeviceGetClockInfo(h, m.NVML_CLOCK_SM))
            if field == "mem_clock_mhz":
                return int(m.nvmlDeviceGetClockInfo(h, m.NVML_CLOCK_MEM))
            if field == "power_w":
                if d.instant_power:
                    v = m.nvmlDeviceGetFieldValues(h, [m.NVML_FI_DEV_POWER_INSTANT])[0]
                    if int(v.nvmlReturn) != 0:
                        return None
                    return _field_value(v) / 1000.0
                return m.nvmlDeviceGetPowerUsage(h) / 1000.0
            if field == "energy_j":
                return m.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0
            if field == "temp_c":
                return int(m.nvmlDeviceGetTemperature(h, m.NVML_TEMPERATURE_GPU))
            if field == "util":
                u = m.nvmlDeviceGetUtilizationRates(h)
                return int(u.gpu), int(u.memory)
            if field == "throttle":
                return int(d.reasons_fn(h))
        except Exception as e:
            if nv.is_unsupported(m, e):
                d.disabled.add(field)
        return None

    def _sample_device(self, d: _Device) -> dict:
        vals = {f: self._read(d, f) for f in _SAMPLE_FIELDS}
        util = vals["util"] or (None, None)
        return {
            "kind": "sample",
            "t": round(self._now_unix(), 6),
            "device": d.index,
            "sm_clock_mhz": vals["sm_clock_mhz"],
            "mem_clock_mhz": vals["mem_clock_mhz"],
            "power_w": None if vals["power_w"] is None else round(vals["power_w"], 3),
            "energy_j": None if vals["energy_j"] is None else round(vals["energy_j"], 3),
            "temp_c": vals["temp_c"],
            "util_gpu": util[0],
            "util_mem": util[1],
            "throttle": vals["throttle"],
        }

    def sample_once(self) -> list[dict]:
        """Take one tick now (the thread calls this; callable directly when no thread runs)."""
        t0 = time.monotonic()
        recs = [self._sample_device(d) for d in self._devices]
        now = time.monotonic()
        lines = [json.dumps(r) for r in recs] if self._fd is not None else []
        with self._lock:
            for d, r in zip(self._devices, recs):
                self._accumulate(d, r, now)
            self._buf.extend(lines)
            if self.keep:
                self.records.extend(recs)
            self._n_samples += 1
            self._sample_cost += time.monotonic() - t0
        return recs

    def _accumulate(self, d: _Device, r: dict, now: float) -> None:
        w = self._win
        w["n"] += 1
        for key, src in (("sm", "sm_clock_mhz"), ("mem", "mem_clock_mhz"), ("power", "power_w"), ("util", "util_gpu")):
            v = r[src]
            if v is not None:
                w[key + "_sum"] += v
                w[key + "_n"] += 1
        if r["temp_c"] is not None:
            w["temp_max"] = r["temp_c"] if w["temp_max"] is None else max(w["temp_max"], r["temp_c"])
        if r["throttle"] is not None:
            w["thr_n"] += 1
            if r["throttle"] & nv.CAP_MASK:
                w["capped"] += 1
        p = r["power_w"]
        if p is not None:
            if d.last_power is not None:
                t_prev, p_prev = d.last_power
                d.integrated_j += 0.5 * (p + p_prev) * (now - t_prev)
            d.last_power = (now, p)

    def _reset_window(self) -> None:
        self._win = {
            "n": 0, "sm_sum": 0.0, "sm_n": 0, "mem_sum": 0.0, "mem_n": 0, "power_sum": 0.0, "power_n": 0,
            "util_sum": 0.0, "util_n": 0, "temp_max": None, "thr_n": 0, "capped": 0,
        }  # fmt: skip

    def _run(self) -> None:
        period = 1.0 / self.hz
        next_t = time.monotonic()
        last_flush = next_t
        while not self._stop_event.is_set():
            try:
                self.sample_once()
            except Exception:  # never let the sampler die; the tick is lost
                pass
            now = time.monotonic()
            next_t += period
            if next_t <= now:  # fell behind: skip the missed ticks, stay on the grid
                next_t += math.ceil((now - next_t) / period + 1e-9) * period
            if now - last_flush >= self.flush_s:
                self._flush()
                last_flush = now
            self._stop_event.wait(max(0.0, next_t - time.monotonic()))

    # ---------------------------------------------------------------------------------------- output

    def _flush(self) -> None:
        with self._write_lock:
            with self._lock:
                lines, self._buf = self._buf, []
            if not lines or self._fd is None:
                return
            data = ("\n".join(lines) + "\n").encode()
            try:
                # One write() of whole lines on an O_APPEND descriptor: ranks sharing the file do not interleave.
                while data:
                    n = os.write(self._fd, data)
                    data = data[n:]
            except OSError:
                pass

    def _emit(self, rec: dict) -> None:
        line = json.dumps(rec) if self._fd is not None else None
        with self._lock:
            if line is not None:
                self._buf.append(line)
            if self.keep:
                self.records.append(rec)

    # ---------------------------------------------------------------------------------------- API

    def start(self) -> Telemetry:
        if not self.available or self._started:
            return self
        self._started = True
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError:
                self._fd = None
        for d in self._devices:
            self._emit(self._header(d))
        self._flush()
        # The first window starts now: energy counters and integrals from here.
        for d in self._devices:
            d.energy_mark_mj = self._energy_mj(d)
        self._run_t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="holotrain-telemetry", daemon=True)
        self._thread.start()
        return self

    def mark(self, step: int) -> None:
        if not self.available or not self._started or self._stopped:
            return
        self._emit({"kind": "step", "t": round(self._now_unix(), 6), "step": int(step)})

    def _energy_mj(self, d: _Device) -> float | None:
        if "energy_j" in d.disabled:
            return None
        try:
            return float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(d.handle))
        except Exception as e:
            if nv.is_unsupported(self._nvml, e):
                d.disabled.add("energy_j")
            return None

    def window(self) -> dict:
        """Aggregates since the previous window() (or start()). `energy.joules` is read from the devices'
        energy counters now (a device without a counter contributes its integrated power samples instead);
        the hw.* values are means over the window's samples of all devices (hw.temp_c: the max)."""
        out: dict[str, Any] = dict.fromkeys(WINDOW_KEYS)
        if not self.available or not self._started:
            return out
        with self._window_lock:  # counters read and marks moved in one piece: concurrent windows partition time
            return self._window(out)

    def _window(self, out: dict) -> dict:
        if self._final_energy is not None:  # stopped: the counters were read one last time at stop()
            now_mj = self._final_energy
        else:
            now_mj = [self._energy_mj(d) for d in self._devices]
        with self._lock:
            w = self._win
            self._reset_window()
            energy, any_energy = 0.0, False
            for d, mj in zip(self._devices, now_mj):
                if mj is not None and d.energy_mark_mj is not None and mj >= d.energy_mark_mj:
                    energy += (mj - d.energy_mark_mj) / 1000.0
                    any_energy = True
                elif d.last_power is not None:
                    energy += d.integrated_j
                    any_energy = True
                if mj is not None:
                    d.energy_mark_mj = mj
                d.integrated_j = 0.0
        out["energy.joules"] = energy if any_energy else None
        mean = lambda k: w[k + "_sum"] / w[k + "_n"] if w[k + "_n"] else None
        out["hw.sm_clock_mhz"] = mean("sm")
        out["hw.mem_clock_mhz"] = mean("mem")
        out["hw.power_w"] = mean("power")
        out["hw.util_gpu"] = mean("util")
        out["hw.temp_c"] = w["temp_max"]
        out["hw.power_capped_frac"] = w["capped"] / w["thr_n"] if w["thr_n"] else None
        return out

    def stats(self) -> dict:
        """Sampler health: ticks taken, mean cost of a tick (all devices) and the achieved rate."""
        with self._lock:
            n, cost = self._n_samples, self._sample_cost
        end = self._run_t1 if self._run_t1 is not None else time.monotonic()
        elapsed = (end - self._run_t0) if self._run_t0 is not None else None
        return {
            "samples": n,
            "mean_sample_s": cost / n if n else None,
            "achieved_hz": n / elapsed if n and elapsed else None,
        }

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self._stop_event.set()
            self._thread.join()
            self._thread = None
            self._run_t1 = time.monotonic()
        if self._started:
            with self._window_lock:
                self._final_energy = [self._energy_mj(d) for d in self._devices]
            self._flush()
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        if self._owns_init:
            nv.shutdown(self._nvml)
            self._owns_init = False

    close = stop

    def __enter__(self) -> Telemetry:
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False
