"""A short trial of one candidate: the real job through `holotrain train` (its config, the candidate's settings, the
real corpus, clipping as configured) for a few steps in a scratch run directory, and what it measured."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from holotrain.jsonl import read_jsonl

_UNTIMED = 2  # the first steps: compilation, allocator and clock warm-up


@dataclass
class Measured:
    step_s: float | None  # mean over the timed steps
    tokens_per_s: float | None
    peak_gb: float | None  # GPU peak (host RSS on a CPU)
    cpu_step_s: float | None  # the offload engine's CPU step
    speculated: float | None  # share of steps the offload engine speculated (did not clip)
    j_per_token: float | None
    error: str  # "" when the trial ran
    data_wait_s: float | None = None  # mean wait for the data plane over the timed steps
    loaders: int | None = None  # the data plane's loader processes at the end
    host_gb: float | None = None  # the largest host RSS the training process logged


def as_override(name: str, value) -> str:
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"--{name}={value}"


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


# Several GPUs of one node: NVLink multicast off (NCCL's NVLS, symmetric memory's and NVSHMEM's), which these
# machines do not all allow; the user's own settings win.
_MULTI_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def timed_rows(rows: list[dict], steps: int) -> list[dict]:
    """The later half of a trial's per-step rows, and never the first two: the data plane may still be filling its
    caches."""
    return [r for r in rows if r["step"] > max(_UNTIMED, steps // 2)] or rows[-1:]


def steady_step_s(timed: list[dict]) -> float | None:
    """The mean step time of these rows, not the median: the rate the run gets, slow steps included (an offload
    step rolled back after a clip, a loader tokenizing its next chunk on the cores a CPU run trains on). Time spent
    compiling (the blocks' variant for masked micro-batches, when the first one comes) is paid once per run: left
    out."""
    return _mean([r["step_s"] - (r.get("host.compile_s") or 0.0) for r in timed if r.get("step_s") is not None])


def run_trial(config: str | None, overrides: list[str], settings: dict, steps: int, run_dir: Path,
              timeout_s: float, ranks: int = 1) -> Measured:
    """Trains `steps` steps of the job with `settings` ("section.key" -> value) in `run_dir` (removed after), on
    `ranks` processes of this node (torchrun) when more than one."""
    shutil.rmtree(run_dir, ignore_errors=True)
    launch = [sys.executable, "-m", "holotrain.cli"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m",
        "holotrain.cli"]
    env = None if ranks == 1 else {**_MULTI_GPU_ENV, **os.environ}
    args = launch + ["train"] + (["--config", config] if config else []) + overrides
    args += [as_override(k, v) for k, v in settings.items()]
    args += [f"--training.steps={steps}", "--training.log_every=1", f"--job.run_dir={run_dir}",
             "--checkpoint.every=0", "--checkpoint.save_final=false", "--checkpoint.memory_every=0",
             "--profile.report=false", "--profile.tensorboard=false", "--profile.progress=false"]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env)
        # A trial killed mid-row (out of host memory, say) leaves its last row cut short: whole rows only.
        rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
        if proc.returncode != 0 or not rows:
            lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit {proc.returncode}"
            return Measured(None, None, None, None, None, None, why[:300])
    except subprocess.TimeoutExpired:
        return Measured(None, None, None, None, None, None, f"did not finish within {timeout_s:.0f} s")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    timed = timed_rows(rows, steps)
    step_s = steady_step_s(timed)
    peaks = [r.get("mem.peak_gb") or r.get("mem.host_rss_gb") for r in rows]
    tokens = rows[-1]["tokens"] / rows[-1]["step"]
    return Measured(step_s, tokens / step_s if step_s else None, max((p for p in peaks if p), default=None),
                    _median([r.get("offload.cpu_step_s") for r in timed]),
                    _median([r.get("offload.speculated") for r in timed]),
                    rows[-1].get("energy.run_j_per_token") or _median([r.get("energy.j_per_token") for r in timed]),
                    "", _mean([r.get("time.data_wait") for r in timed]),
                    sum((rows[-1].get("data.workers") or {}).values()) or None,
                    max((r["mem.host_rss_gb"] for r in rows if r.get("mem.host_rss_gb")), default=None))
