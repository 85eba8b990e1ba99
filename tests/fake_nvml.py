"""A fake of the parts of nvidia-ml-py's `pynvml` that holotrain uses, with a simulated H200-like device.

    nvml = FakeNVML(n_devices=1)
    dev = nvml.devices[0]
    dev.set_load(True)      # sustained load: SM clock max for `burst_s`, then power-capped, SwPowerCap set
    dev.set_load(False)     # idle: clock back to `idle_sm_mhz`, GpuIdle set, low power

Names, constants, units and error classes follow pynvml (power in mW, energy in mJ, clocks in MHz, the field
value struct of nvmlDeviceGetFieldValues). The energy counter integrates the simulated power over real time
exactly (power is piecewise constant between state changes). Every Set/Reset call is recorded in `dev.calls`
and `nvml.calls`; `nvml.deny_permission = True` makes them raise NVMLError_NoPermission; `dev.fail` holds
function names (e.g. "nvmlDeviceGetTemperature") that raise NVMLError_Unknown; `nvml.init_error` makes
nvmlInit raise. Nothing here touches a real GPU.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_UNKNOWN = 999


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {
            NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
            NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            NVML_ERROR_NOT_FOUND: "Not Found",
            NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
            NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        }.get(self.value, f"NVML Error with code {self.value}")


def _error_class(name: str, value: int):
    return type(name, (NVMLError,), {"__init__": lambda self, *a: NVMLError.__init__(self, value)})


NVMLError_NoPermission = _error_class("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NotFound = _error_class("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_DriverNotLoaded = _error_class("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_Unknown = _error_class("NVMLError_Unknown", NVML_ERROR_UNKNOWN)

GPU_IDLE, SW_POWER_CAP = 0x1, 0x4


class FakeDevice:
    def __init__(
        self,
        index: int,
        *,
        name: str = "NVIDIA H200",
        max_sm_mhz: int = 1980,
        max_mem_mhz: int = 3201,
        idle_sm_mhz: int | None = None,  # None: clocks stay at max while idle ("starts at max")
        capped_sm_mhz: int = 1600,
        burst_s: float = 0.12,
        idle_power_w: float = 90.0,
        load_power_w: float = 700.0,
        power_limit_w: float = 700.0,
        power_limit_range_w: tuple[float, float] = (200.0, 700.0),
        supported_sm_mhz: tuple[int, int] = (345, 1980),
        instant_power: bool = True,
    ):
        self.index = index
        self.name = name
        self.uuid = f"GPU-{0xA0 + index:08x}-0000-4000-8000-{index:012x}"
        self.max_sm_mhz, self.max_mem_mhz = max_sm_mhz, max_mem_mhz
        self.idle_sm_mhz = max_sm_mhz if idle_sm_mhz is None else idle_sm_mhz
        self.capped_sm_mhz, self.burst_s = capped_sm_mhz, burst_s
        self.idle_power_w, self.load_power_w = idle_power_w, load_power_w
        self.default_limit_mw = int(power_limit_w * 1000)
        self.limit_mw = self.default_limit_mw
        self.limit_range_mw = (int(power_limit_range_w[0] * 1000), int(power_limit_range_w[1] * 1000))
        self.supported_sm_mhz = supported_sm_mhz
        self.instant_power = instant_power
        self.locked: tuple[int, int] | None = None
        self.calls: list[tuple] = []
        self.fail: set[str] = set()
        self.deny_permission = False
        self._lock = threading.Lock()
        self._load = False
        self._load_t0 = 0.0
        self._t = time.monotonic()
        self._energy_mj = 1.0e9  # counters start far from zero, as on a card that has been up a while

    # -- simulation
    def _power_w(self) -> float:
        if not self._load:
            return self.idle_power_w
        return min(self.load_power_w, self.limit_mw / 1000.0)

    def _advance(self) -> None:
        now = time.monotonic()
        self._energy_mj += self._power_w() * (now - self._t) * 1000.0
        self._t = now

    def set_load(self, on: bool) -> None:
        with self._lock:
            self._advance()
            if on and not self._load:
                self._load_t0 = time.monotonic()
            self._load = on

    def sm_clock(self) -> int:
        with self._lock:
            if not self._load:
                mhz = self.idle_sm_mhz
            elif time.monotonic() - self._load_t0 < self.burst_s:
                mhz = self.max_sm_mhz
            else:
                mhz = self.capped_sm_mhz
            if self.locked is not None:
                mhz = min(mhz, self.locked[1]) if self._load else self.locked[1]
            return mhz

    def reasons(self) -> int:
        with self._lock:
            if not self._load:
                return GPU_IDLE
            return SW_POWER_CAP if time.monotonic() - self._load_t0 >= self.burst_s else 0

    def energy_mj(self) -> int:
        with self._lock:
            self._advance()
            return int(self._energy_mj)

    def power_mw(self) -> int:
        with self._lock:
            return int(self._power_w() * 1000)

    @property
    def loaded(self) -> bool:
        return self._load


class FakeNVML:
    """Module-like: pass it wherever holotrain takes `nvml=`."""

    NVML_SUCCESS = NVML_SUCCESS
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    NVML_CLOCK_GRAPHICS, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
    NVML_TEMPERATURE_GPU = 0
    NVML_FI_DEV_POWER_INSTANT = 186
    NVML_VALUE_TYPE_DOUBLE, NVML_VALUE_TYPE_UNSIGNED_INT = 0, 1
    nvmlClocksEventReasonGpuIdle = 0x1
    nvmlClocksEventReasonApplicationsClocksSetting = 0x2
    nvmlClocksEventReasonSwPowerCap = 0x4
    nvmlClocksEventReasonHwSlowdown = 0x8
    nvmlClocksEventReasonSyncBoost = 0x10
    nvmlClocksEventReasonSwThermalSlowdown = 0x20
    nvmlClocksEventReasonHwThermalSlowdown = 0x40
    nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
    nvmlClocksEventReasonDisplayClockSetting = 0x100
    NVMLError = NVMLError
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_Unknown = NVMLError_Unknown

    def __init__(self, n_devices: int = 1, **device_kwargs):
        self.devices = [FakeDevice(i, **device_kwargs) for i in range(n_devices)]
        self.calls: list[tuple] = []
        self.deny_permission = False
        self.init_error: NVMLError | None = None
        self.init_count = 0

    # -- library
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        if self.init_count <= 0:
            raise NVMLError_Uninitialized()
        self.init_count -= 1

    def _check(self, dev: FakeDevice, fn: str) -> None:
        if self.init_count <= 0:
            raise NVMLError_Uninitialized()
        if fn in dev.fail:
            raise NVMLError_Unknown()

    # -- handles
    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        if not 0 <= index < len(self.devices):
            raise NVMLError_InvalidArgument()
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for d in self.devices:
            if d.uuid == uuid:
                return d
        raise NVMLError_NotFound()

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> FakeDevice:
        raise NVMLError_NotFound()

    def nvmlDeviceGetIndex(self, h: FakeDevice) -> int:
        return h.index

    def nvmlDeviceGetName(self, h: FakeDevice) -> str:
        return h.name

    def nvmlDeviceGetUUID(self, h: FakeDevice) -> str:
        return h.uuid

    # -- readings
    def nvmlDeviceGetClockInfo(self, h: FakeDevice, clock: int) -> int:
        self._check(h, "nvmlDeviceGetClockInfo")
        return h.sm_clock() if clock in (self.NVML_CLOCK_SM, self.NVML_CLOCK_GRAPHICS) else h.max_mem_mhz

    def nvmlDeviceGetMaxClockInfo(self, h: FakeDevice, clock: int) -> int:
        self._check(h, "nvmlDeviceGetMaxClockInfo")
        return h.max_sm_mhz if clock in (self.NVML_CLOCK_SM, self.NVML_CLOCK_GRAPHICS) else h.max_mem_mhz

    def nvmlDeviceGetSupportedMemoryClocks(self, h: FakeDevice) -> list[int]:
        return [h.max_mem_mhz]

    def nvmlDeviceGetSupportedGraphicsClocks(self, h: FakeDevice, mem_mhz: int) -> list[int]:
        lo, hi = h.supported_sm_mhz
        return list(range(hi, lo - 1, -15))

    def nvmlDeviceGetPowerUsage(self, h: FakeDevice) -> int:
        self._check(h, "nvmlDeviceGetPowerUsage")
        return h.power_mw()

    def nvmlDeviceGetFieldValues(self, h: FakeDevice, field_ids: list) -> list:
        self._check(h, "nvmlDeviceGetFieldValues")
        out = []
        for fid in field_ids:
            ok = fid == self.NVML_FI_DEV_POWER_INSTANT and h.instant_power
            out.append(
                SimpleNamespace(
                    fieldId=fid,
                    scopeId=0,
                    timestamp=int(time.time() * 1e6),
                    latencyUsec=0,
                    valueType=self.NVML_VALUE_TYPE_UNSIGNED_INT,
                    nvmlReturn=NVML_SUCCESS if ok else NVML_ERROR_NOT_SUPPORTED,
                    value=SimpleNamespace(uiVal=h.power_mw() if ok else 0, dVal=0.0),
                )
            )
        return out

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeDevice) -> int:
        self._check(h, "nvmlDeviceGetTotalEnergyConsumption")
        return h.energy_mj()

    def nvmlDeviceGetTemperature(self, h: FakeDevice, sensor: int) -> int:
        self._check(h, "nvmlDeviceGetTemperature")
        return 62 if h.loaded else 34

    def nvmlDeviceGetUtilizationRates(self, h: FakeDevice):
        self._check(h, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=100, memory=45) if h.loaded else SimpleNamespace(gpu=0, memory=0)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeDevice) -> int:
        self._check(h, "nvmlDeviceGetCurrentClocksEventReasons")
        return h.reasons()

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: FakeDevice) -> int:
        self._check(h, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return h.reasons()

    def nvmlDeviceGetPowerManagementLimit(self, h: FakeDevice) -> int:
        self._check(h, "nvmlDeviceGetPowerManagementLimit")
        return h.limit_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeDevice) -> int:
        return h.limit_mw

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: FakeDevice) -> int:
        return h.default_limit_mw

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h: FakeDevice) -> list[int]:
        return list(h.limit_range_mw)

    # -- control (recorded)
    def _control(self, h: FakeDevice, call: tuple) -> None:
        if self.init_count <= 0:
            raise NVMLError_Uninitialized()
        if self.deny_permission or h.deny_permission:
            raise NVMLError_NoPermission()
        h.calls.append(call)
        self.calls.append((h.index, *call))

    def nvmlDeviceSetGpuLockedClocks(self, h: FakeDevice, lo: int, hi: int) -> None:
        self._control(h, ("SetGpuLockedClocks", lo, hi))
        h.locked = (lo, hi)

    def nvmlDeviceResetGpuLockedClocks(self, h: FakeDevice) -> None:
        self._control(h, ("ResetGpuLockedClocks",))
        h.locked = None

    def nvmlDeviceSetPowerManagementLimit(self, h: FakeDevice, limit_mw: int) -> None:
        lo, hi = h.limit_range_mw
        if not lo <= limit_mw <= hi:
            raise NVMLError_InvalidArgument()
        self._control(h, ("SetPowerManagementLimit", limit_mw))
        with h._lock:
            h._advance()
            h.limit_mw = limit_mw
