"""NVML plumbing shared by telemetry, probe and clock control: lazy pynvml loading, CUDA->NVML device mapping,
clock-event reason names.

Nothing here imports pynvml (nvidia-ml-py) at module import; `load()` does, on first use. Every function takes
the NVML module as an argument so that tests can pass `tests/fake_nvml.py` instead of the real library.
"""

from __future__ import annotations

import os
from typing import Any

# Clock-event ("throttle") reason bits, as in nvml.h / pynvml (nvmlClocksEventReason*; older drivers and
# bindings call them nvmlClocksThrottleReason*). The values are stable across driver versions.
REASONS: list[tuple[str, int]] = [
    ("GpuIdle", 0x001),
    ("ApplicationsClocksSetting", 0x002),
    ("SwPowerCap", 0x004),
    ("HwSlowdown", 0x008),
    ("SyncBoost", 0x010),
    ("SwThermalSlowdown", 0x020),
    ("HwThermalSlowdown", 0x040),
    ("HwPowerBrakeSlowdown", 0x080),
    ("DisplayClockSetting", 0x100),
]
REASON_BITS = dict(REASONS)
GPU_IDLE = REASON_BITS["GpuIdle"]
# Reasons that mean "the clock is held down by a power or thermal limit" (not idle, not a user setting).
CAP_REASONS = ("SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown")
CAP_MASK = sum(REASON_BITS[n] for n in CAP_REASONS)


def reason_names(mask: int | None) -> list[str]:
    """The reason names set in a clock-event bitmask ([] for 0 or None)."""
    if not mask:
        return []
    return [name for name, bit in REASONS if mask & bit]


def load(nvml: Any = None) -> Any:
    """The NVML module to use: `nvml` if given, else the real pynvml (None when nvidia-ml-py is missing)."""
    if nvml is not None:
        return nvml
    try:
        import pynvml  # nvidia-ml-py
    except Exception:
        return None
    return pynvml


def init(nvml: Any) -> bool:
    """nvmlInit(); False (never an exception) when there is no driver/library. NVML counts inits: pair each
    successful init() with one shutdown()."""
    if nvml is None:
        return False
    try:
        nvml.nvmlInit()
        return True
    except Exception:
        return False


def shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:
        pass


def error_value(e: BaseException) -> int | None:
    return getattr(e, "value", None)


def is_permission_error(nvml: Any, e: BaseException) -> bool:
    cls = getattr(nvml, "NVMLError_NoPermission", None)
    if cls is not None and isinstance(e, cls):
        return True
    return error_value(e) == getattr(nvml, "NVML_ERROR_NO_PERMISSION", 4)


def is_unsupported(nvml: Any, e: BaseException) -> bool:
    """NOT_SUPPORTED or FUNCTION_NOT_FOUND: asking again will not help (a missing function in an older
    binding shows up as AttributeError)."""
    if isinstance(e, AttributeError):
        return True
    v = error_value(e)
    return v is not None and v in (
        getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3),
        getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13),
    )


def as_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def reasons_getter(nvml: Any):
    """The clock-event reasons function: nvmlDeviceGetCurrentClocksEventReasons (driver >= 535), else the
    older nvmlDeviceGetCurrentClocksThrottleReasons."""
    fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    return fn if fn is not None else getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)


def _visible_devices() -> list[str] | None:
    var = os.environ.get("CUDA_VISIBLE_DEVICES")
    if var is None:
        return None
    return [s.strip() for s in var.split(",") if s.strip()]


def _handle_by_uuid_prefix(nvml: Any, prefix: str) -> Any:
    """CUDA_VISIBLE_DEVICES may hold a UUID prefix; NVML wants the whole UUID."""
    try:
        return nvml.nvmlDeviceGetHandleByUUID(prefix)
    except Exception:
        pass
    matches = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        if as_str(nvml.nvmlDeviceGetUUID(h)).startswith(prefix):
            matches.append(h)
    if len(matches) != 1:
        raise LookupError(f"CUDA_VISIBLE_DEVICES entry {prefix!r} matches {len(matches)} NVML devices")
    return matches[0]


def handle_for_cuda(nvml: Any, cuda_index: int) -> Any:
    """The NVML handle of CUDA device `cuda_index` (an index among the visible devices).

    By UUID first: torch reports the device's UUID, NVML knows it as "GPU-<uuid>"; this is exact whatever
    CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER say. Then by PCI bus id. Last, CUDA_VISIBLE_DEVICES read by
    hand (an integer entry is taken as the NVML index, which holds when CUDA orders devices by PCI bus id, as
    NVML does). Raises when nothing maps.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    props = torch.cuda.get_device_properties(cuda_index)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        candidates = [uuid] if uuid.startswith(("GPU-", "MIG-")) else ["GPU-" + uuid, "MIG-" + uuid]
        for cand in candidates:
            try:
                return nvml.nvmlDeviceGetHandleByUUID(cand)
            except Exception:
                pass
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        dom, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
        for fmt in ("{:08x}:{:02x}:{:02x}.0", "{:04x}:{:02x}:{:02x}.0"):
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(fmt.format(dom, bus, dev))
            except Exception:
                pass
    visible = _visible_devices()
    if visible is None:
        return nvml.nvmlDeviceGetHandleByIndex(cuda_index)
    entry = visible[cuda_index]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return _handle_by_uuid_prefix(nvml, entry)


def resolve_handles(nvml: Any, cuda_indices: list[int] | None = None, devices: list | None = None) -> list:
    """NVML handles: `devices` as given (an int is an NVML index, anything else a handle), else the handles
    of `cuda_indices`."""
    if devices is not None:
        return [nvml.nvmlDeviceGetHandleByIndex(d) if isinstance(d, int) else d for d in devices]
    return [handle_for_cuda(nvml, i) for i in (cuda_indices or [])]


def sm_clock_range(nvml: Any, handle: Any) -> tuple[int | None, int]:
    """(lowest supported SM clock or None, max SM clock) in MHz."""
    max_mhz = int(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
    lo = None
    try:
        mem = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_MEM)
        clocks = nvml.nvmlDeviceGetSupportedGraphicsClocks(handle, mem)
        if clocks:
            lo = int(min(clocks))
    except Exception:
        pass
    return lo, max_mhz
