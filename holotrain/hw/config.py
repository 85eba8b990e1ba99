"""The config's [hw] section: telemetry, clock and power control, the GPU memory cap, and the checks on its keys."""

from __future__ import annotations

from dataclasses import dataclass

from holotrain.section import Section, need


@dataclass
class HwConfig(Section):
    telemetry: bool = True  # NVML sampler: clocks, power, energy, throttle reasons -> RUN_DIR/telemetry.jsonl
    telemetry_hz: float = 100.0
    # Changing clocks or power limits affects everyone on the card: off unless the user asks explicitly.
    allow_clock_control: bool = False
    lock_sm_clock_mhz: int = 0  # 0 = leave the clocks alone
    power_limit_w: float = 0.0  # 0 = leave the power limit alone
    # GPU memory this run may use, in GB (0 = all of it): to plan for a smaller card, or to share one. The memory
    # plan and the allocator both keep to it.
    gpu_memory_gb: float = 0.0

    def check(self) -> None:
        need(0 < self.telemetry_hz <= 1000, f"hw.telemetry_hz must be in (0, 1000], got {self.telemetry_hz}")
        need(self.lock_sm_clock_mhz >= 0, f"hw.lock_sm_clock_mhz must be >= 0, got {self.lock_sm_clock_mhz}")
        need(self.power_limit_w >= 0, f"hw.power_limit_w must be >= 0, got {self.power_limit_w}")
        need(self.gpu_memory_gb >= 0,
             f"hw.gpu_memory_gb must be >= 0 (0 = the whole GPU), got {self.gpu_memory_gb}")
        wants_control = self.lock_sm_clock_mhz > 0 or self.power_limit_w > 0
        need(not wants_control or self.allow_clock_control, "hw.lock_sm_clock_mhz / hw.power_limit_w change the "
             "card's settings for every user of it: set hw.allow_clock_control = true to allow that")
