"""This machine's rates for the cost model, measured in a few seconds and cached per machine.

  gemm_flops      a large dense GEMM held for about two seconds, so that a power-capped GPU has settled at its
                  sustained clock (an H200 at 700 W runs ~17% below its first 0.1 s); fp32 on a CPU
  attention_flops on a GPU, right after the GEMMs (clocks settled): causal SDPA forward and backward in bf16 at
                  T = 16384 (16 heads of 128, the kernel torch picks for the model's unmasked micro-batches), FLOPs
                  counted as the time model counts them (model/llama.py: attention_flops_per_token); not measured on
                  a CPU (the prior, plan/attention.py: ATTENTION_SHARE of the GEMM rate)
  host_copy_bytes_s  a large host-to-host copy: what a save of host-resident state blocks for
  adamw_params_s  the offload engine's own CPU AdamW (memory/offload/kernels.py) on 16M parameters, on the
                  threads the engine would use
  runtime_bytes   the host memory a training process holds before its model (measured on every plan, not cached)
The cache (HOLOTRAIN_CACHE or ~/.cache/holotrain, plan-machine.json) is keyed by the device's name, memory, and the
host's CPU model and core count, so another machine measures afresh."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from holotrain.hw.peak import peak_bf16_flops
from holotrain.memory.plan import (
    GPU_USABLE,
    HOST_USABLE,
    gpu_available_bytes,
    gpu_cap_bytes,
    host_available_bytes,
    process_rss_bytes,
    usable_cores,
)
from holotrain.plan.cost import Machine, fingerprint

_GEMM_S = 2.0
_VERSION = 3  # of what is measured: a cache of another version is measured afresh


def _cache_file(cache: Path) -> Path:
    return cache / "plan-machine.json"


def _key(device: torch.device) -> str:
    cores = usable_cores()
    gpu = ""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        gpu = f"{p.name}:{p.total_memory}"
    return f"v{_VERSION}:{device.type}:{gpu}:{platform.processor() or platform.machine()}:{cores}:{torch.__version__}"


def _gemm_rate(device: torch.device) -> float:
    if device.type == "cuda":
        n, dtype = 8192, torch.bfloat16
    else:
        n, dtype = 1024, torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    rates, start = [], time.perf_counter()
    while time.perf_counter() - start < (_GEMM_S if device.type == "cuda" else 0.5):
        t0 = time.perf_counter()
        for _ in range(8):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates.append(8 * 2 * n ** 3 / (time.perf_counter() - t0))
    settled = rates[len(rates) // 2:]  # the second half: after the clocks settled
    return sorted(settled)[len(settled) // 2]


def _attention_rate(device: torch.device) -> float:
    """Causal attention's FLOP/s, forward and backward, on a GPU (0 on a CPU: the cost model takes its prior)."""
    if device.type != "cuda":
        return 0.0
    import torch.nn.functional as F

    from holotrain.model.args import ModelArgs
    from holotrain.model.costs import attention_flops_per_token

    T, heads, head_dim = 16384, 16, 128
    q, k, v = (torch.randn(1, heads, T, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(1, heads, T, head_dim, device=device, dtype=torch.bfloat16)
    work = attention_flops_per_token(ModelArgs(dim=heads * head_dim, n_layers=1, n_heads=heads), T) * T
    rates, start = [], time.perf_counter()
    while time.perf_counter() - start < 1.0 or len(rates) < 4:
        t0 = time.perf_counter()
        for _ in range(4):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        torch.cuda.synchronize(device)
        rates.append(4 * work / (time.perf_counter() - t0))
    settled = rates[len(rates) // 2:]
    return sorted(settled)[len(settled) // 2]


def _adamw_rate() -> float:
    from holotrain.memory.offload.kernels import adamw_flat, cpu_kernels

    kernels = cpu_kernels("auto")
    cores = usable_cores()
    n = 16 << 20
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n).to(torch.bfloat16)
    times = []
    for step in range(1, 5):
        t0 = time.perf_counter()
        adamw_flat(p, m, v, g, None, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, t=step,
                   kernels=kernels, threads=max(1, cores - 1))
        times.append(time.perf_counter() - t0)
    return n / sorted(times[1:])[1]


def _copy_rate() -> float:
    src = torch.randn(64 << 20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.numel() * 4 / sorted(times[1:])[1]


def _runtime_bytes() -> float:
    """Host memory a training process holds before its model: this process's resident memory, torch imported
    (and, on a GPU, the CUDA context its GEMM probe created)."""
    return float(process_rss_bytes() or 0)


def _power_limit_w(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        from holotrain.hw.nvml import handle_for_cuda

        handle = handle_for_cuda(pynvml, device.index or 0)
        return pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0
    except Exception:  # noqa: BLE001 - no NVML: J/token is left unpredicted
        return None


def _identity(device: torch.device, gpu_memory_gb: float) -> tuple[str, float | None]:
    """(name, GPU bytes a run may use) of this machine."""
    if device.type != "cuda":
        return platform.processor() or platform.machine(), None
    props = torch.cuda.get_device_properties(device)
    return props.name, gpu_cap_bytes(props.total_memory, gpu_memory_gb)


def machine_fingerprint(device: torch.device, gpu_memory_gb: float) -> str:
    name, total = _identity(device, gpu_memory_gb)
    return fingerprint(device.type, name, total)


def measure_machine(device: torch.device, gpu_memory_gb: float, cache: Path) -> Machine:
    """This machine as the cost model sees it; the rates from the cache when this machine measured them before."""
    key = _key(device)
    path = _cache_file(cache)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    rates = cached.get(key)
    if rates is None:
        rates = {"gemm_flops": _gemm_rate(device), "attention_flops": _attention_rate(device),
                 "adamw_params_s": _adamw_rate(), "host_copy_bytes_s": _copy_rate(), "power_w": _power_limit_w(device)}
        cached[key] = rates
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    name, total = _identity(device, gpu_memory_gb)
    gpu_memory, fp8 = None, False
    if device.type == "cuda":
        gpu_memory = min(total, gpu_available_bytes(device)) * GPU_USABLE
        fp8 = torch.cuda.get_device_capability(device) >= (8, 9)
    return Machine(device.type, name, total, gpu_memory, host_available_bytes() * HOST_USABLE, rates["gemm_flops"],
                   peak_bf16_flops(device) if device.type == "cuda" else None, rates["adamw_params_s"],
                   rates.get("host_copy_bytes_s", 10e9), rates["power_w"], fp8, _runtime_bytes(),
                   rates.get("attention_flops", 0.0))
