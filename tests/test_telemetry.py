"""NVML telemetry, DVFS analysis, clock control and the hw probe, all against tests/fake_nvml.py.

Nothing here changes a real GPU's settings: every ClockControl test passes the fake NVML explicitly.
"""

import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_nvml import FakeNVML, NVMLError_DriverNotLoaded

from holotrain.config import HwConfig
from holotrain.errors import ConfigError
from holotrain.hw import dvfs
from holotrain.hw import nvml as nv
from holotrain.hw.control import ClockControl
from holotrain.hw.telemetry import WINDOW_KEYS, Telemetry

HEADER_KEYS = {"kind", "t", "device", "cuda_index", "rank", "name", "uuid", "max_sm_clock_mhz",
               "max_mem_clock_mhz", "power_limit_w", "default_power_limit_w"}  # fmt: skip
SAMPLE_KEYS = {"kind", "t", "device", "sm_clock_mhz", "mem_clock_mhz", "power_w", "energy_j", "temp_c",
               "util_gpu", "util_mem", "throttle"}  # fmt: skip
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


def _lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ sampler


def test_sampler_rate_schema_and_marks(tmp_path):
    fake = FakeNVML(n_devices=2)
    path = tmp_path / "telemetry.jsonl"
    tel = Telemetry([0, 1], path, hz=100.0, rank=3, nvml=fake, devices=[0, 1])
    assert tel.available
    tel.start()
    time.sleep(0.5)
    fake.devices[0].set_load(True)
    tel.mark(7)
    time.sleep(0.5)
    tel.mark(8)
    stats = tel.stats()
    tel.stop()
    tel.stop()  # idempotent
    assert fake.init_count == 0  # nvmlInit paired with nvmlShutdown

    recs = _lines(path)
    headers = [r for r in recs if r["kind"] == "device"]
    samples = [r for r in recs if r["kind"] == "sample"]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [h["device"] for h in headers] == [0, 1]
    for h in headers:
        assert set(h) == HEADER_KEYS
        assert h["rank"] == 3 and h["name"] == "NVIDIA H200" and h["uuid"].startswith("GPU-")
        assert h["max_sm_clock_mhz"] == 1980 and h["max_mem_clock_mhz"] == 3201
        assert h["power_limit_w"] == 700.0 and h["default_power_limit_w"] == 700.0
    for s in samples:
        assert set(s) == SAMPLE_KEYS
        assert all(isinstance(s[k], int) for k in ("sm_clock_mhz", "mem_clock_mhz", "temp_c", "util_gpu",
                                                   "util_mem", "throttle"))  # fmt: skip
        assert isinstance(s["power_w"], float) and isinstance(s["energy_j"], float)
    assert steps == [{"kind": "step", "t": steps[0]["t"], "step": 7}, {"kind": "step", "t": steps[1]["t"], "step": 8}]

    # >= 50 Hz achieved (asked for 100), ticks on a drift-free grid.
    per_dev = [s for s in samples if s["device"] == 0]
    span = per_dev[-1]["t"] - per_dev[0]["t"]
    assert len(per_dev) >= 50 and stats["achieved_hz"] >= 50
    assert (len(per_dev) - 1) / span == pytest.approx(100.0, rel=0.15)
    # One device under load: its clock dropped to the capped level with SwPowerCap; the other stayed idle.
    loaded = [s for s in per_dev if s["t"] > steps[0]["t"] + 0.2]
    assert loaded and all(s["sm_clock_mhz"] == 1600 and s["throttle"] & 0x4 for s in loaded)
    assert all(s["throttle"] == 0x1 for s in samples if s["device"] == 1)
    print(f"\nper-sample cost (2 fake devices): {1e6 * stats['mean_sample_s']:.0f} us, {stats['achieved_hz']:.1f} Hz")


def test_sample_cost_at_high_rate(tmp_path):
    """The per-tick cost against the fake, and that the loop keeps up at 200 Hz."""
    fake = FakeNVML(n_devices=1)
    with Telemetry([0], tmp_path / "t.jsonl", hz=200.0, nvml=fake, devices=[0]) as tel:
        time.sleep(0.5)
        stats = tel.stats()
    assert stats["achieved_hz"] >= 150
    assert stats["mean_sample_s"] < 2e-3
    print(f"\nper-sample cost (1 fake device): {1e6 * stats['mean_sample_s']:.0f} us at {stats['achieved_hz']:.0f} Hz")


def test_window_energy_power_and_capping(tmp_path):
    fake = FakeNVML(n_devices=1)
    dev = fake.devices[0]
    path = tmp_path / "telemetry.jsonl"
    tel = Telemetry([0], path, hz=100.0, nvml=fake, devices=[0]).start()
    time.sleep(0.3)
    w1 = tel.window()
    t_w1 = tel.now()
    dev.set_load(True)
    time.sleep(0.6)
    w2 = tel.window()
    t_w2 = tel.now()
    tel.stop()
    assert set(w1) == set(WINDOW_KEYS) == set(w2)

    assert w1["hw.power_capped_frac"] == 0.0 and w1["hw.util_gpu"] == 0.0
    assert w1["hw.sm_clock_mhz"] == 1980 and w1["hw.power_w"] == pytest.approx(90.0)
    assert w1["energy.joules"] == pytest.approx(0.3 * 90.0, rel=0.1)
    # Under load: power-capped after the 0.12 s burst, so ~80% of the samples show SwPowerCap.
    assert 0.65 <= w2["hw.power_capped_frac"] <= 0.92
    assert 1600 < w2["hw.sm_clock_mhz"] < 1750
    assert w2["hw.power_w"] == pytest.approx(700.0, rel=0.05)
    assert w2["hw.temp_c"] == 62 and w2["hw.util_gpu"] > 90
    # The energy counter read at window() agrees with the integral of the sampled power over the window.
    samples = [r for r in _lines(path) if r["kind"] == "sample" and t_w1 <= r["t"] <= t_w2]
    integral = sum(0.5 * (a["power_w"] + b["power_w"]) * (b["t"] - a["t"]) for a, b in zip(samples, samples[1:]))
    integral += samples[0]["power_w"] * (samples[0]["t"] - t_w1) + samples[-1]["power_w"] * (t_w2 - samples[-1]["t"])
    assert w2["energy.joules"] == pytest.approx(integral, rel=0.03)
    assert w2["energy.joules"] == pytest.approx(0.6 * 700.0, rel=0.05)


def test_failing_field_is_null_not_a_dead_thread(tmp_path):
    fake = FakeNVML(n_devices=1, instant_power=False)  # nvmlDeviceGetPowerUsage path
    fake.devices[0].fail = {"nvmlDeviceGetTemperature", "nvmlDeviceGetCurrentClocksEventReasons"}
    path = tmp_path / "telemetry.jsonl"
    with Telemetry([0], path, hz=100.0, nvml=fake, devices=[0]) as tel:
        time.sleep(0.2)
        fake.devices[0].fail = set()  # recovers: the field comes back
        time.sleep(0.2)
        assert tel._thread.is_alive()
    samples = [r for r in _lines(path) if r["kind"] == "sample"]
    assert samples[0]["temp_c"] is None and samples[0]["throttle"] is None
    assert samples[0]["power_w"] == 90.0 and samples[0]["sm_clock_mhz"] == 1980
    assert samples[-1]["temp_c"] == 34 and samples[-1]["throttle"] == 1


def test_unavailable_nvml_is_a_noop(tmp_path, monkeypatch):
    def check(tel, path):
        assert not tel.available
        tel.start()
        tel.mark(1)
        assert tel.window() == dict.fromkeys(WINDOW_KEYS)
        tel.stop()
        tel.stop()
        assert not path.exists()

    fake = FakeNVML()
    fake.init_error = NVMLError_DriverNotLoaded()
    check(Telemetry([0], tmp_path / "a.jsonl", nvml=fake, devices=[0]), tmp_path / "a.jsonl")
    # pynvml missing altogether
    monkeypatch.setitem(sys.modules, "pynvml", None)
    check(Telemetry([0], tmp_path / "b.jsonl"), tmp_path / "b.jsonl")
    # a device that does not exist
    check(Telemetry([0], tmp_path / "c.jsonl", nvml=FakeNVML(), devices=[5]), tmp_path / "c.jsonl")


@NO_CUDA
def test_no_cuda_is_unavailable(tmp_path):
    tel = Telemetry([0], tmp_path / "t.jsonl", nvml=FakeNVML())  # CUDA indices need CUDA to map
    assert not tel.available and tel.window()["energy.joules"] is None


def test_cuda_to_nvml_mapping(monkeypatch):
    """By UUID whatever CUDA_VISIBLE_DEVICES says; by CUDA_VISIBLE_DEVICES when there is no UUID."""
    fake = FakeNVML(n_devices=4)
    fake.nvmlInit()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    visible = [2, 0]  # CUDA_VISIBLE_DEVICES=2,0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    uuid = lambda i: fake.devices[visible[i]].uuid.removeprefix("GPU-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuid(i)))
    assert [h.index for h in nv.resolve_handles(fake, [0, 1])] == [2, 0]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=""))
    assert [h.index for h in nv.resolve_handles(fake, [0, 1])] == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", fake.devices[3].uuid[:12])  # a UUID prefix
    assert nv.handle_for_cuda(fake, 0).index == 3
    tel = Telemetry([0], None, nvml=fake)
    assert tel.available and tel._devices[0].index == 3 and tel._devices[0].cuda_index == 0
    tel.stop()


def test_resumed_run_appends_and_truncated_line_is_tolerated(tmp_path):
    fake = FakeNVML()
    path = tmp_path / "telemetry.jsonl"
    for _ in range(2):
        with Telemetry([0], path, hz=100.0, nvml=fake, devices=[0]):
            time.sleep(0.1)
    with open(path, "a") as f:
        f.write('{"kind": "sample", "t": 17')  # a crash mid-write
    recs = dvfs.load_telemetry(path)
    assert sum(r["kind"] == "device" for r in recs) == 2
    res = dvfs.analyze(recs)
    # Energy does not count the gap between the runs: each run is its own segment.
    assert res["energy_j"] == pytest.approx(res["energy_j_integrated"], rel=0.1)
    assert res["energy_j"] < 0.3 * 90.0


# ------------------------------------------------------------------------------------------------ DVFS


def _synthetic_trace() -> list[dict]:
    """100 Hz: idle 2 s (345 MHz), load 10 s, idle 1 s, load 5 s. Under load the clock ramps from 1200 MHz to
    1980 MHz in 30 ms, holds it for 120 ms, then sits power-capped at 1600 MHz with SwPowerCap."""
    recs = [{"kind": "device", "t": 1000.0, "device": 0, "cuda_index": 0, "rank": 0, "name": "NVIDIA H200",
             "uuid": "GPU-x", "max_sm_clock_mhz": 1980, "max_mem_clock_mhz": 3201, "power_limit_w": 700.0,
             "default_power_limit_w": 700.0}]  # fmt: skip
    t, energy, dt = 1000.0, 5.0e6, 0.01
    for load, seconds in ((False, 2.0), (True, 10.0), (False, 1.0), (True, 5.0)):
        for i in range(round(seconds / dt)):
            tl = i * dt
            if not load:
                clk, thr, util, power = 345, 0x1, 0, 80.0
            elif tl < 0.025:
                clk, thr, util, power = 1200, 0x0, 100, 700.0
            elif tl < 0.145:
                clk, thr, util, power = 1980, 0x0, 100, 700.0
            else:
                clk, thr, util, power = 1600, 0x4, 100, 700.0
            recs.append({"kind": "sample", "t": round(t, 6), "device": 0, "sm_clock_mhz": clk, "mem_clock_mhz": 2619,
                         "power_w": power, "energy_j": round(energy, 3), "temp_c": 50, "util_gpu": util,
                         "util_mem": util // 2, "throttle": thr})  # fmt: skip
            t += dt
            energy += power * dt
    return recs


def test_dvfs_analyze_synthetic_trace():
    recs = _synthetic_trace()
    res = dvfs.analyze(recs, metrics=[{"step": 1, "mfu": 0.4}, {"step": 2, "mfu": 0.5}, {"step": 3, "mfu": None}])
    assert res["devices"] == [recs[0]]
    assert res["burst_clock_mhz"] == 1980
    assert res["sustained_clock_mhz"] == 1600
    assert res["max_clock_mhz"] == 1980
    assert res["sustained_over_burst"] == pytest.approx(1600 / 1980)
    assert res["ramp_after_idle_s"]["count"] == 2
    assert res["ramp_after_idle_s"]["median"] == pytest.approx(0.03, abs=1e-6)
    assert res["ramp_after_idle_s"]["max"] == pytest.approx(0.03, abs=1e-6)
    assert res["boost_after_idle_s"]["median"] == pytest.approx(0.12, abs=1e-6)
    assert [round(g["duration_s"], 2) for g in res["idle_gaps"]] == [2.0, 1.0]
    bd = res["throttle_breakdown"]
    assert set(bd) == {
        "GpuIdle",
        "ApplicationsClocksSetting",
        "SwPowerCap",
        "HwSlowdown",
        "SyncBoost",
        "SwThermalSlowdown",
        "HwThermalSlowdown",
        "HwPowerBrakeSlowdown",
        "DisplayClockSetting",
    }
    assert bd["SwPowerCap"] == pytest.approx((1500 - 30) / 1500)
    assert bd["GpuIdle"] == 0.0 and bd["HwSlowdown"] == 0.0
    assert res["busy_frac"] == pytest.approx(1500 / 1800)
    mean_busy = (6 * 1200 + 24 * 1980 + 1470 * 1600) / 1500
    assert res["mean_busy_clock_mhz"] == pytest.approx(mean_busy)
    assert res["clock_loss_frac"] == pytest.approx(1 - mean_busy / 1980)
    assert res["clock_normalized_mfu"] == pytest.approx(0.45 * 1980 / mean_busy)
    assert res["mean_power_w"] == pytest.approx((300 * 80 + 1500 * 700) / 1800)
    exact = 3.0 * 80 + 15.0 * 700
    assert res["energy_j"] == pytest.approx(exact, rel=0.01)
    assert res["energy_j_integrated"] == pytest.approx(exact, rel=0.01)
    lines = dvfs.summarize(res)
    assert any("burst 1980 MHz, sustained 1600 MHz" in line for line in lines)
    assert any("SwPowerCap 98%" in line for line in lines)


def test_dvfs_ramp_zero_when_clocks_stay_high_and_empty_input():
    recs = _synthetic_trace()
    for r in recs:
        if r["kind"] == "sample" and r["util_gpu"] == 0:
            r["sm_clock_mhz"] = 1980  # clocks held up while idle
        if r["kind"] == "sample" and r["sm_clock_mhz"] == 1200:
            r["sm_clock_mhz"] = 1980
    res = dvfs.analyze(recs)
    assert res["ramp_after_idle_s"]["median"] == 0.0
    empty = dvfs.analyze([])
    assert empty["burst_clock_mhz"] is None and empty["energy_j"] is None and empty["throttle_breakdown"] is None
    assert empty["ramp_after_idle_s"] == {"count": 0, "median": None, "max": None}
    assert isinstance(dvfs.summarize(empty), list)


def test_dvfs_on_a_sampled_fake_trace(tmp_path):
    """End to end: the sampler's file through analyze()."""
    fake = FakeNVML(idle_sm_mhz=345, burst_s=0.12)
    dev = fake.devices[0]
    path = tmp_path / "telemetry.jsonl"
    with Telemetry([0], path, hz=100.0, nvml=fake, devices=[0]):
        time.sleep(0.6)
        dev.set_load(True)
        time.sleep(0.8)
    res = dvfs.analyze(dvfs.load_telemetry(path), warm_s=0.3)
    assert res["burst_clock_mhz"] == 1980 and res["sustained_clock_mhz"] == 1600
    assert res["ramp_after_idle_s"]["count"] == 1 and res["ramp_after_idle_s"]["median"] < 0.02
    assert res["boost_after_idle_s"]["median"] == pytest.approx(0.12, abs=0.03)
    assert res["throttle_breakdown"]["SwPowerCap"] > 0.7
    assert res["energy_j_integrated"] == pytest.approx(res["energy_j"], rel=0.05)


# ------------------------------------------------------------------------------------------------ control


def _hw(**kw):
    return HwConfig(**kw)


def test_clock_control_noop_when_nothing_requested():
    fake = FakeNVML()
    fake.init_error = NVMLError_DriverNotLoaded()  # NVML is not even needed
    with ClockControl(_hw(), nvml=fake, handles=[0]) as cc:
        assert not cc.requested
    with ClockControl(_hw(allow_clock_control=True), nvml=fake, handles=[0]):
        pass
    assert fake.calls == []


def test_clock_control_refuses_without_opt_in():
    fake = FakeNVML()
    with pytest.raises(ConfigError, match=r"hw\.allow_clock_control"):
        ClockControl(_hw(lock_sm_clock_mhz=1500), nvml=fake, handles=[0])
    with pytest.raises(ConfigError, match=r"hw\.allow_clock_control"):
        ClockControl(_hw(power_limit_w=500.0), nvml=fake, handles=[0])
    assert fake.calls == [] and fake.init_count == 0


def test_clock_control_validates_ranges():
    fake = FakeNVML()
    with pytest.raises(ConfigError, match=r"hw\.lock_sm_clock_mhz = 2500 .*345\.\.1980 MHz"):
        ClockControl(_hw(allow_clock_control=True, lock_sm_clock_mhz=2500), nvml=fake, handles=[0])
    with pytest.raises(ConfigError, match=r"hw\.lock_sm_clock_mhz = 100 .*345\.\.1980 MHz"):
        ClockControl(_hw(allow_clock_control=True, lock_sm_clock_mhz=100), nvml=fake, handles=[0])
    with pytest.raises(ConfigError, match=r"hw\.power_limit_w = 900 .*200\.\.700 W"):
        ClockControl(_hw(allow_clock_control=True, power_limit_w=900.0), nvml=fake, handles=[0])
    with pytest.raises(ConfigError, match=r"hw\.power_limit_w = -5"):
        ClockControl(_hw(allow_clock_control=True, power_limit_w=-5.0), nvml=fake, handles=[0])
    assert fake.calls == [] and fake.init_count == 0


def test_clock_control_applies_and_restores():
    fake = FakeNVML(n_devices=2)
    hw = _hw(allow_clock_control=True, lock_sm_clock_mhz=1500, power_limit_w=600.0)
    with ClockControl(hw, nvml=fake, handles=[0, 1]) as cc:
        assert cc.active
        for d in fake.devices:
            assert d.locked == (1500, 1500) and d.limit_mw == 600_000
    for d in fake.devices:
        assert d.locked is None and d.limit_mw == 700_000
        assert d.calls == [
            ("SetPowerManagementLimit", 600_000),
            ("SetGpuLockedClocks", 1500, 1500),
            ("ResetGpuLockedClocks",),
            ("SetPowerManagementLimit", 700_000),
        ]
    assert fake.init_count == 0


def test_clock_control_restores_on_exception():
    fake = FakeNVML()
    fake.devices[0].limit_mw = 650_000  # a non-default limit set by someone else: it is what comes back
    hw = _hw(allow_clock_control=True, lock_sm_clock_mhz=1410, power_limit_w=500.0)
    with pytest.raises(RuntimeError, match="boom"):
        with ClockControl(hw, nvml=fake, handles=[0]):
            assert fake.devices[0].locked == (1410, 1410)
            raise RuntimeError("boom")
    d = fake.devices[0]
    assert d.locked is None and d.limit_mw == 650_000
    assert d.calls[-2:] == [("ResetGpuLockedClocks",), ("SetPowerManagementLimit", 650_000)]
    assert fake.init_count == 0


def test_clock_control_only_clock_or_only_power():
    fake = FakeNVML()
    with ClockControl(_hw(allow_clock_control=True, lock_sm_clock_mhz=1755), nvml=fake, handles=[0]):
        pass
    with ClockControl(_hw(allow_clock_control=True, power_limit_w=450.0), nvml=fake, handles=[0]):
        pass
    assert fake.devices[0].calls == [
        ("SetGpuLockedClocks", 1755, 1755),
        ("ResetGpuLockedClocks",),
        ("SetPowerManagementLimit", 450_000),
        ("SetPowerManagementLimit", 700_000),
    ]


def test_clock_control_permission_error():
    fake = FakeNVML(n_devices=2)
    fake.deny_permission = True
    cc = ClockControl(_hw(allow_clock_control=True, lock_sm_clock_mhz=1500), nvml=fake, handles=[0, 1])
    with pytest.raises(ConfigError, match=r"hw\.lock_sm_clock_mhz = 1500.*root"):
        with cc:
            pass
    assert fake.init_count == 0
    # The second card refuses: the first one is put back before the error.
    fake = FakeNVML(n_devices=2)
    fake.devices[1].deny_permission = True
    hw = _hw(allow_clock_control=True, lock_sm_clock_mhz=1500, power_limit_w=600.0)
    with pytest.raises(ConfigError, match=r"hw\.power_limit_w = 600.*root"):
        with ClockControl(hw, nvml=fake, handles=[0, 1]):
            pass
    d0 = fake.devices[0]
    assert d0.locked is None and d0.limit_mw == 700_000
    assert d0.calls[-2:] == [("ResetGpuLockedClocks",), ("SetPowerManagementLimit", 700_000)]
    assert fake.init_count == 0


def test_nvml_reason_table_matches_pynvml():
    pynvml = pytest.importorskip("pynvml")  # constants only: no nvmlInit, no device
    for name, bit in nv.REASONS:
        assert getattr(pynvml, "nvmlClocksEventReason" + name, bit) == bit
        assert getattr(pynvml, "nvmlClocksThrottleReason" + name, bit) == bit
    for fn in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetPowerUsage",
               "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetTemperature", "nvmlDeviceGetUtilizationRates",
               "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByPciBusId",
               "nvmlDeviceGetIndex", "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetFieldValues",
               "nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetPowerManagementDefaultLimit",
               "nvmlDeviceGetPowerManagementLimitConstraints", "nvmlDeviceSetGpuLockedClocks",
               "nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetPowerManagementLimit",
               "nvmlDeviceGetSupportedGraphicsClocks", "nvmlDeviceGetCount", "nvmlInit", "nvmlShutdown"):  # fmt: skip
        assert callable(getattr(pynvml, fn)), fn
        assert callable(getattr(FakeNVML(), fn)), fn
    assert nv.reasons_getter(pynvml) is not None
    for const in ("NVML_CLOCK_SM", "NVML_CLOCK_MEM", "NVML_TEMPERATURE_GPU", "NVML_FI_DEV_POWER_INSTANT"):
        assert getattr(pynvml, const) == getattr(FakeNVML, const), const
    assert pynvml.NVML_ERROR_NO_PERMISSION == FakeNVML.NVML_ERROR_NO_PERMISSION
    assert issubclass(pynvml.NVMLError_NoPermission, pynvml.NVMLError)


# ------------------------------------------------------------------------------------------------ probe


@NO_CUDA
def test_probe_cpu_only(tmp_path):
    from holotrain.hw.probe import run_probe

    out = tmp_path / "sub" / "probe.json"
    t = time.monotonic()
    res = run_probe(out, seconds=1.5)
    assert time.monotonic() - t < 15
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(res))
    assert saved["gpu"] is None and saved["errors"] == []
    host = saved["host"]
    assert host["cpu_count"] >= 1 and host["ram_total_gib"] > 0 and host["ram_available_gib"] > 0
    assert host["memcpy_gb_s"] > 0 and host["adamw_params_per_s"] > 0 and host["adamw_params"] >= 1_000_000
    assert host["pinned_alloc"] is None
    assert "CPU AdamW" in saved["summary"] and "\n" not in saved["summary"]
    assert not list(out.parent.glob(".*tmp*"))  # atomic write left nothing behind


def test_telemetry_thread_safety(tmp_path):
    """window() and mark() from other threads while the sampler runs."""
    fake = FakeNVML(n_devices=2)
    fake.devices[0].set_load(True)
    t0 = time.monotonic()
    tel = Telemetry([0, 1], tmp_path / "t.jsonl", hz=200.0, nvml=fake, devices=[0, 1]).start()
    errors, energies = [], []

    def hammer(k):
        try:
            for i in range(50):
                tel.mark(k * 100 + i)
                energies.append(tel.window()["energy.joules"])
                time.sleep(0.002)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    final = tel.window()["energy.joules"]
    elapsed = time.monotonic() - t0
    tel.stop()
    assert not errors
    total = sum(e for e in energies if e) + (final or 0)
    # Windows partition the time: their energies add up to the whole (700 W + 90 W over the elapsed time).
    assert total == pytest.approx(790.0 * elapsed, rel=0.1)
    steps = [r for r in _lines(tmp_path / "t.jsonl") if r["kind"] == "step"]
    assert len(steps) == 150


def test_old_driver_throttle_reasons_and_power_usage_fallback(tmp_path):
    """A driver without nvmlDeviceGetCurrentClocksEventReasons (FUNCTION_NOT_FOUND) and without the
    instantaneous power field: the sampler uses ...ThrottleReasons and nvmlDeviceGetPowerUsage."""
    from fake_nvml import NVMLError

    fake = FakeNVML(instant_power=False)

    def missing(h):
        raise NVMLError(FakeNVML.NVML_ERROR_FUNCTION_NOT_FOUND)

    fake.nvmlDeviceGetCurrentClocksEventReasons = missing
    fake.devices[0].set_load(True)
    time.sleep(0.15)
    tel = Telemetry([0], None, nvml=fake, devices=[0], keep=True)
    assert not tel._devices[0].instant_power
    tel.start()
    time.sleep(0.05)
    tel.stop()
    s = [r for r in tel.records if r["kind"] == "sample"][-1]
    assert s["throttle"] == 0x4 and s["power_w"] == 700.0


def _energy_sum_worker(rank: int, world: int, init_file: str, has_sampler: list, out: str) -> None:
    import torch.distributed as dist

    from holotrain.config import HwConfig
    from holotrain.hw.lever import Hardware
    from holotrain.parallel import DistEnv

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), local_world_size=world)
    tel, mine = None, 0.0
    if has_sampler[rank]:
        fake = FakeNVML(n_devices=1)
        handle = fake.nvmlDeviceGetHandleByIndex(0)
        tel = Telemetry([0], None, hz=100.0, nvml=fake, devices=[0])
        tel.start()
    # Both windows open together and last long enough that the ranks' skew at the all-reduce in metrics() (which
    # `mine` counts and the window does not) stays a small share, on a machine busy with other tests too.
    dist.barrier()
    if tel is not None:
        tel.window()
        e0 = fake.nvmlDeviceGetTotalEnergyConsumption(handle)
        time.sleep(1.0)
    hardware = Hardware(HwConfig(), env, Path(init_file).parent)
    hardware.telemetry = tel  # the lever samples only CUDA devices itself; here it reports a fake card's sampler
    fields = hardware.metrics(steps=2, tokens_per_step=100)
    if tel is not None:
        mine = (fake.nvmlDeviceGetTotalEnergyConsumption(handle) - e0) / 1000.0  # J this rank's card used
        tel.stop()
    Path(f"{out}.{rank}").write_text(json.dumps({"fields": fields, "mine": mine}))
    dist.destroy_process_group()


@pytest.mark.parametrize("has_sampler", [[True, True], [True, False], [False, False]])
def test_job_energy_sums_every_sampler(tmp_path, has_sampler):
    """Per-step energy in a 2-rank job is the sum over the ranks that sample (each its own cards), the same on
    every rank; with no sampler anywhere it is null, never zero."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "fields")
    mp.spawn(_energy_sum_worker, args=(2, str(tmp_path / "init"), has_sampler, out), nprocs=2)
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    rows = [r["fields"] for r in results]
    assert rows[0]["energy.joules"] == rows[1]["energy.joules"]
    if not any(has_sampler):
        assert rows[0]["energy.joules"] is None and rows[0]["energy.j_per_token"] is None
        return
    per_step = rows[0]["energy.joules"]
    assert rows[0]["energy.j_per_token"] == pytest.approx(per_step / 100)
    # Each sampler's window ends just before its counter is read again: the job's sum over 2 steps matches.
    assert per_step * 2 == pytest.approx(sum(r["mine"] for r in results), rel=0.1)
    assert per_step > 0


def test_the_runs_energy_per_token_comes_from_counter_totals_after_the_first_interval():
    """energy.run_j_per_token: the joules of every interval after the first (compilation) over their tokens, not a
    mean of the intervals' own J/token (which NVML's coarse counter makes swing)."""
    import torch

    from holotrain.config import HwConfig
    from holotrain.hw.lever import Hardware
    from holotrain.parallel import DistEnv

    class Windows:
        def __init__(self, joules):
            self.joules = iter(joules)

        def window(self):
            return {"energy.joules": next(self.joules)}

    hw = Hardware(HwConfig(), DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), ".")
    hw.telemetry = Windows([5000.0, 900.0, 1300.0, 1100.0])
    rows = [hw.metrics(steps, tokens_per_step=100) for steps in (1, 10, 10, 10)]
    assert rows[0]["energy.run_j_per_token"] is None  # only the first interval so far
    assert rows[1]["energy.run_j_per_token"] == pytest.approx(900.0 / 1000)
    assert rows[-1]["energy.run_j_per_token"] == pytest.approx((900.0 + 1300.0 + 1100.0) / 3000)
    assert rows[-1]["energy.j_per_token"] == pytest.approx(1100.0 / 1000)
