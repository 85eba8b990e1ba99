"""The hardware lever as the trainer sees it: NVML telemetry of the job's GPUs, the opt-in clock lock / power limit,
and the energy and clock fields of each metrics row. Built from the `hw` section alone."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from holotrain.hw.config import HwConfig
    from holotrain.parallel import DistEnv

HW_FIELDS = ("hw.sm_clock_mhz", "hw.mem_clock_mhz", "hw.power_w", "hw.temp_c", "hw.power_capped_frac", "hw.util_gpu")


class Hardware:
    """Samples the GPUs while training runs (start() ... close()) and reports per-step energy and clocks."""

    def __init__(self, section: HwConfig, env: DistEnv, run_dir: Path):
        self.section, self.env, self.run_dir = section, env, Path(run_dir)
        self.telemetry = None
        self._control = contextlib.ExitStack()
        # The run's energy from counter totals over the timed steps (the first interval, with compilation, left
        # out): NVML's counter moves in coarse steps, so one interval's J/token swings by +-20%, the run's does not.
        self._intervals, self._run_joules, self._run_tokens = 0, 0.0, 0

    def start(self) -> None:
        self.telemetry = self._start_telemetry()
        self._control.enter_context(self._clock_control())

    def begin_interval(self) -> None:
        """The next metrics interval starts now (not at sampler start)."""
        if self.telemetry is not None:
            self.telemetry.window()

    def mark(self, step: int) -> None:
        if self.telemetry is not None:
            self.telemetry.mark(step)

    def metrics(self, steps: int, tokens_per_step: int) -> dict:
        """Per-step energy of every GPU in the job (summed over samplers), the run's J/token so far (counter totals
        since the first interval), and the clock/power figures this rank sampled. Collective with several ranks:
        every rank calls it at the same step."""
        window = self.telemetry.window() if self.telemetry is not None else {}
        joules = window.get("energy.joules")
        if self.env.world_size > 1:
            # Each sampler contributes the energy of the cards it samples and a count of one, other ranks zeros; NaN
            # marks a sampler without NVML, so a partial sum is never reported as the job's energy.
            mine = [0.0, 0.0] if self.telemetry is None else [joules if joules is not None else math.nan, 1.0]
            value = torch.tensor(mine, dtype=torch.float64, device=self.env.device)
            dist.all_reduce(value)
            total, samplers = value.tolist()
            joules = total if samplers > 0 and math.isfinite(total) else None
        per_step = joules / steps if joules is not None else None
        if joules is not None and self._intervals > 0:
            self._run_joules += joules
            self._run_tokens += steps * tokens_per_step
        self._intervals += 1
        return {
            "energy.joules": per_step,
            "energy.j_per_token": per_step / tokens_per_step if per_step is not None else None,
            "energy.run_j_per_token": self._run_joules / self._run_tokens if self._run_tokens else None,
            **{k: window.get(k) for k in HW_FIELDS},
        }

    def close(self) -> None:
        """Restores clocks and power limits it changed, and stops sampling."""
        self._control.close()
        if self.telemetry is not None:
            self.telemetry.stop()
            self.telemetry = None

    def _start_telemetry(self):
        """NVML sampling. A process that sees every card of its node (the usual torchrun layout) makes its node's
        first rank sample them all; with one visible card per process, each rank samples its own."""
        env = self.env
        if not self.section.telemetry or env.device.type != "cuda":
            return None
        from holotrain.hw.telemetry import Telemetry

        local = env.local_world_size
        if torch.cuda.device_count() >= local:
            if env.local_rank != 0:
                return None
            node = env.rank // local
            indices, name = list(range(local)), "telemetry.jsonl" if node == 0 else f"telemetry.node{node}.jsonl"
        else:
            indices = [env.device.index or 0]
            name = "telemetry.jsonl" if env.rank == 0 else f"telemetry.rank{env.rank}.jsonl"
        telemetry = Telemetry(indices, self.run_dir / name, self.section.telemetry_hz, rank=env.rank)
        telemetry.start()
        return telemetry

    def _clock_control(self):
        """Opt-in clock lock / power limit (hw.allow_clock_control) on this node's cards, restored at close."""
        hw, env = self.section, self.env
        wanted = hw.lock_sm_clock_mhz > 0 or hw.power_limit_w > 0
        if not wanted or env.device.type != "cuda" or env.local_rank != 0:
            return contextlib.nullcontext()
        from holotrain.hw.control import ClockControl

        return ClockControl(hw, cuda_indices=list(range(env.local_world_size)))


def build(section: HwConfig, env: DistEnv, run_dir: Path) -> Hardware:
    return Hardware(section, env, run_dir)
