"""The memory plan's verdict for one job: check_fit refuses, with the numbers and the keys that would make it fit, a
plan that cannot fit GPU or host memory; choose_offload_ratio resolves memory.offload_ratio = "auto"."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from holotrain.errors import ConfigError
from holotrain.memory.activation_checkpointing import long_sequence_choices
from holotrain.memory.plan import (
    HOST_USABLE,
    Plan,
    gpu_usable_share,
    long_sequence_levers,
    model_units,
    offloaded_units,
    plan_memory,
)


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def _parts(parts: dict[str, float]) -> str:
    return " + ".join(f"{_gb(v)} {k}" for k, v in parts.items() if v >= 0.05e9)


def check_fit(model: nn.Module, cfg, world_size: int, device: torch.device, micro: int, accum: int, **capacity) -> Plan:
    """Raises ConfigError, naming the keys to change and with the numbers, when the plan cannot fit."""
    plan = plan_memory(model, cfg, world_size, device, micro, accum, **capacity)
    if plan.gpu_fits and plan.host_fits:
        return plan
    mem = cfg.memory
    lines = [
        f"the memory plan does not fit: {plan.n_params / 1e9:.2f}B parameters, micro-batch {micro} x "
        f"{cfg.data.seq_len}, memory.activation_checkpointing = {mem.activation_checkpointing!r}, "
        + (f"memory.offload = true with memory.offload_ratio = {plan.ratio:g} "
           f"({plan.n_offloaded / 1e9:.2f}B parameters' optimizer on the CPU)" if mem.offload else "memory.offload = false")
        + (f", {world_size} ranks" if world_size > 1 else "") + "."
    ]
    if not plan.gpu_fits:
        capped = f" within hw.gpu_memory_gb = {cfg.hw.gpu_memory_gb:g}" if cfg.hw.gpu_memory_gb > 0 else ""
        lines.append(f"GPU: needs {_gb(plan.gpu_need)} per rank = {_parts(plan.gpu)}, but {_gb(plan.gpu_capacity)} "
                     f"is usable ({gpu_usable_share(cfg):.0%} of free{capped}).")
    if not plan.host_fits:
        per = (f" ({plan.host_bytes_per_param} bytes per offloaded parameter: "
               + " + ".join(f"{k} {v}" for k, v in plan.host_per_param.items()) + ")") if mem.offload else ""
        pinned = (f", of which {_gb(plan.pinned)} pinned (pinned memory counts against host RAM; RLIMIT_MEMLOCK does "
                  f"not limit cudaHostAlloc)") if device.type == "cuda" else ""
        lines.append(f"Host: needs {_gb(plan.host_need)} per rank = {_parts(plan.host)}{per}{pinned}, but "
                     f"{_gb(plan.host_capacity)} is usable ({HOST_USABLE:.0%} of the available host RAM, MemAvailable or "
                     f"the container limit, shared by this node's ranks).")
    lines.append("To fit: " + "; ".join(_suggestions(model, cfg, world_size, device, micro, accum, plan, capacity)) + ".")
    raise ConfigError(" ".join(lines))


def choose_offload_ratio(model: nn.Module, cfg, world_size: int, device: torch.device, micro: int, accum: int,
                         **capacity) -> float:
    """memory.offload_ratio = "auto": the smallest ratio (in steps of 0.01) whose plan fits GPU and host memory,
    i.e. the most optimizer work left on the GPU (GPU memory falls and host memory grows with the ratio). Raises
    check_fit's error, with the numbers at ratio 1, when none fits. Ratios that offload the same units share
    one plan, so the plan is computed once per unit boundary, not per ratio."""
    units = model_units(model)
    fits: dict[frozenset, bool] = {}
    for i in range(101):
        chosen = frozenset(offloaded_units(units, i / 100))
        if chosen not in fits:
            plan = plan_memory(model, cfg, world_size, device, micro, accum, ratio=i / 100, **capacity)
            fits[chosen] = plan.gpu_fits and plan.host_fits
        if fits[chosen]:
            return i / 100
    check_fit(model, _with(cfg, offload_ratio=1.0), world_size, device, micro, accum, **capacity)
    return 1.0  # check_fit raised unless the capacities changed in between


def _suggestions(model, cfg, world_size, device, micro, accum, plan: Plan, capacity) -> list[str]:
    """Changes that make the plan fit, each tried on its own; or, where none does, what each would save."""
    mem = cfg.memory
    caps = {"gpu_capacity": plan.gpu_capacity, "host_capacity": plan.host_capacity, **capacity}

    def outcome(trial_cfg, trial_micro, trial_accum, ratio=None) -> str:
        p = plan_memory(model, trial_cfg, world_size, device, trial_micro, trial_accum, ratio=ratio, **caps)
        if p.gpu_fits and p.host_fits:
            return "fits"
        # A change can fit one memory and overflow the other (accumulation adds an fp32 accumulator on the host).
        for fits, was_fine, need, capacity, name in ((p.gpu_fits, plan.gpu_fits, p.gpu_need, p.gpu_capacity, "GPU"),
                                                     (p.host_fits, plan.host_fits, p.host_need, p.host_capacity,
                                                      "host")):
            if not fits and was_fine:
                return f"then the {name} needs {_gb(need)} of {_gb(capacity)}"
        saved = (0 if plan.gpu_fits else plan.gpu_need - p.gpu_need) + (0 if plan.host_fits else plan.host_need - p.host_need)
        return f"saves {_gb(saved)}, not enough alone" if saved > 0 else ""

    out = []
    # The offload ratios that fit as configured otherwise (they step at unit boundaries).
    on = _with(cfg, offload=True)
    fitting = [r / 100 for r in range(101) if outcome(on, micro, accum, ratio=r / 100) == "fits"]
    if fitting:
        if mem.offload:
            best = min(fitting, key=lambda r: abs(r - plan.ratio))
            out.append(f"memory.offload_ratio = {best:g} (fits from {min(fitting):g} to {max(fitting):g})")
        else:
            out.append(f"memory.offload = true with memory.offload_ratio from {min(fitting):g} to {max(fitting):g}")
    elif mem.offload:
        out.append("no memory.offload_ratio fits both memories as configured")
    tries = []
    if mem.activation_checkpointing != "full" or mem.activation_checkpointing_blocks:
        tries.append(('memory.activation_checkpointing = "full" on every block',
                      _with(cfg, activation_checkpointing="full", activation_checkpointing_blocks=0), micro, accum))
    if not mem.offload and mem.adamw_moments == "fp32":
        tries.append(('memory.adamw_moments = "bf16" (stochastically rounded moments, 4 bytes a parameter less)',
                      _with(cfg, adamw_moments="bf16"), micro, accum))
    if micro > 1:
        tries.append((f"training.micro_batch_size = {micro // 2} (accumulation keeps the batch)", cfg, micro // 2,
                      accum * 2))
    if accum > 1 and world_size == 1 and mem.offload:
        tries.append(("no gradient accumulation (no fp32 accumulator on the host; larger activations)", cfg,
                      micro * accum, 1))
    for text, trial, m, a in tries:
        result = outcome(trial, m, a)
        if result:
            out.append(f"{text}: {result}")
    # A long sequence: "full" with tiled feed-forwards and the fewest block inputs in host memory that fit.
    if device.type == "cuda" and not long_sequence_levers(mem):
        for choice in long_sequence_choices(cfg.model.n_layers, cfg.data.seq_len):
            if outcome(_with(cfg, **choice), micro, accum) == "fits":
                tiles, moved = choice["ffn_tiles"], choice["activation_offload_blocks"]
                segment = choice["activation_checkpointing_segment"]
                out.append('memory.activation_checkpointing = "full"' + (f", memory.ffn_tiles = {tiles}" if tiles > 1
                                                                         else "")
                           + (f", memory.activation_offload_blocks = {moved} (those blocks' inputs in host memory)"
                              if moved else "")
                           + (f", memory.activation_checkpointing_segment = {segment} (one input kept every {segment} "
                              "blocks)" if segment > 1 else "") + ": fits")
                break
    out.append("memory.check_fit = false to try anyway")
    return out


def _with(cfg, **memory):
    """A copy of cfg with some memory.* keys changed (the resolved config itself is read-only)."""
    return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, **memory))
