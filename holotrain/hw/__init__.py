from holotrain.hw.peak import peak_bf16_flops

__all__ = ["ClockControl", "Telemetry", "analyze", "load_telemetry", "peak_bf16_flops", "run_probe", "summarize"]

# The rest loads on first use (no pynvml import when holotrain is imported).
_LAZY = {
    "Telemetry": "holotrain.hw.telemetry",
    "ClockControl": "holotrain.hw.control",
    "load_telemetry": "holotrain.hw.dvfs",
    "analyze": "holotrain.hw.dvfs",
    "summarize": "holotrain.hw.dvfs",
    "run_probe": "holotrain.hw.probe",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'holotrain.hw' has no attribute {name!r}")
