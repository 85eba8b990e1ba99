"""Opt-in GPU clock and power-limit control for the duration of a job.

    with ClockControl(cfg.hw, cuda_indices=local_cuda_indices):
        train()

Changing clocks or power limits affects every process on the card and outlives a crash of this one unless
restored, so it happens only when the user sets `hw.allow_clock_control = true` together with
`hw.lock_sm_clock_mhz` and/or `hw.power_limit_w`. With neither requested it does nothing and needs no NVML.

On enter: nvmlDeviceSetPowerManagementLimit(h, mW) (the previous limit remembered) and
nvmlDeviceSetGpuLockedClocks(h, mhz, mhz). On exit, also when the body raised: nvmlDeviceResetGpuLockedClocks
and the previous power limit. Both setters need root (or an admin-granted permission); NVML's "Insufficient
Permissions" becomes a ConfigError saying so. A locked SM clock is a ceiling and a floor, but the power cap
and thermal limits still pull the clock below it (telemetry's throttle reasons show when).
"""

from __future__ import annotations

import sys
from typing import Any

from holotrain.errors import ConfigError
from holotrain.hw import nvml as nv


class ClockControl:
    def __init__(self, hw: Any, nvml: Any = None, handles: list | None = None, cuda_indices: list[int] | None = None):
        """`hw`: the HwConfig (allow_clock_control, lock_sm_clock_mhz, power_limit_w). `handles`: NVML device
        handles (or NVML indices) to control; else those of `cuda_indices` (default: every visible CUDA
        device). Validates everything here, so a bad request fails before the job starts."""
        self.lock_mhz = int(getattr(hw, "lock_sm_clock_mhz", 0) or 0)
        self.power_w = float(getattr(hw, "power_limit_w", 0.0) or 0.0)
        self.allowed = bool(getattr(hw, "allow_clock_control", False))
        self._nvml: Any = None
        self._owns_init = False
        self._handles: list = []
        self._applied: list[tuple[Any, bool, int | None]] = []  # (handle, clocks locked, previous limit mW)
        self.active = False
        if self.lock_mhz < 0:
            raise ConfigError(f"hw.lock_sm_clock_mhz = {self.lock_mhz}: must be >= 0 (0 leaves the clocks alone)")
        if self.power_w < 0:
            raise ConfigError(f"hw.power_limit_w = {self.power_w:g}: must be >= 0 (0 leaves the power limit alone)")
        if not self.requested:
            return
        what = " and ".join(
            k for k, on in (("hw.lock_sm_clock_mhz", self.lock_mhz), ("hw.power_limit_w", self.power_w)) if on
        )
        if not self.allowed:
            raise ConfigError(
                f"{what} changes GPU settings for every process on the card; set hw.allow_clock_control = true "
                "to allow it"
            )
        m = nv.load(nvml)
        if not nv.init(m):
            raise ConfigError(f"{what} needs NVML (the nvidia-ml-py package and an NVIDIA driver)")
        self._nvml, self._owns_init = m, True
        try:
            if handles is None and cuda_indices is None:
                import torch

                cuda_indices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
            try:
                self._handles = nv.resolve_handles(m, cuda_indices, handles)
            except Exception as e:
                raise ConfigError(f"{what}: cannot find the GPUs in NVML ({e})") from None
            if not self._handles:
                raise ConfigError(f"{what}: no GPU to apply it to")
            self._validate()
        except BaseException:
            self._release()
            raise

    @property
    def requested(self) -> bool:
        return bool(self.lock_mhz or self.power_w)

    def _validate(self) -> None:
        m = self._nvml
        for h in self._handles:
            if self.lock_mhz:
                lo, hi = nv.sm_clock_range(m, h)
                lo = lo or 1
                if not lo <= self.lock_mhz <= hi:
                    raise ConfigError(
                        f"hw.lock_sm_clock_mhz = {self.lock_mhz} is outside the SM clock range of this GPU "
                        f"({lo}..{hi} MHz)"
                    )
            if self.power_w:
                try:
                    lo_mw, hi_mw = m.nvmlDeviceGetPowerManagementLimitConstraints(h)
                except Exception as e:
                    raise ConfigError(f"hw.power_limit_w: this GPU does not report its power limit range ({e})")
                if not lo_mw <= self.power_w * 1000 <= hi_mw:
                    raise ConfigError(
                        f"hw.power_limit_w = {self.power_w:g} is outside the power limit range of this GPU "
                        f"({lo_mw / 1000:g}..{hi_mw / 1000:g} W)"
                    )

    def _permission(self, e: BaseException, what: str) -> ConfigError:
        if nv.is_permission_error(self._nvml, e):
            return ConfigError(
                f"{what}: NVML refused (insufficient permissions): setting GPU clocks or power limits needs root "
                "(run as root or with sudo, or have an admin grant it), or unset the key"
            )
        return ConfigError(f"{what}: NVML error: {e}")

    def __enter__(self) -> ClockControl:
        if not self.requested or self.active:
            return self
        m = self._nvml
        try:
            for h in self._handles:
                prev = None
                if self.power_w:
                    try:
                        prev = int(m.nvmlDeviceGetPowerManagementLimit(h))
                        m.nvmlDeviceSetPowerManagementLimit(h, int(round(self.power_w * 1000)))
                    except Exception as e:
                        raise self._permission(e, f"hw.power_limit_w = {self.power_w:g}") from None
                self._applied.append((h, False, prev))
                if self.lock_mhz:
                    try:
                        m.nvmlDeviceSetGpuLockedClocks(h, self.lock_mhz, self.lock_mhz)
                    except Exception as e:
                        raise self._permission(e, f"hw.lock_sm_clock_mhz = {self.lock_mhz}") from None
                    self._applied[-1] = (h, True, prev)
        except BaseException:
            self._restore()
            self._release()
            raise
        self.active = True
        return self

    def _restore(self) -> None:
        """Undo what was applied, newest first; a failure is reported and does not stop the rest."""
        m = self._nvml
        while self._applied:
            h, locked, prev = self._applied.pop()
            if locked:
                try:
                    m.nvmlDeviceResetGpuLockedClocks(h)
                except Exception as e:
                    print(f"holotrain: warning: could not reset the locked GPU clocks: {e}", file=sys.stderr)
            if prev is not None:
                try:
                    m.nvmlDeviceSetPowerManagementLimit(h, prev)
                except Exception as e:
                    print(f"holotrain: warning: could not restore the power limit to {prev / 1000:g} W: {e}",
                          file=sys.stderr)  # fmt: skip

    def _release(self) -> None:
        if self._owns_init:
            nv.shutdown(self._nvml)
            self._owns_init = False

    def __exit__(self, *exc) -> bool:
        if self.active:
            self._restore()
            self.active = False
        self._release()
        return False

    def close(self) -> None:
        self.__exit__(None, None, None)
