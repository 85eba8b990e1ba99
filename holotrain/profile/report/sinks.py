"""The "Where the time goes" section: the step's time sinks ranked largest first, each with the holotrain setting
(the lever) that addresses it."""

from __future__ import annotations

from holotrain.profile.report.data import _num, _top_level, _weighted_mean
from holotrain.profile.report.markup import _code, _fmt, _note, _pct, esc


def _lever_for(phase: str, mfu: float | None) -> str:
    if phase == "data_wait":
        return "data plane: more loader processes (`data.workers`), a deeper prefetch (`data.prefetch_steps`)"
    if phase in ("forward", "backward"):
        m = f"MFU {mfu * 100:.1f}% of peak" if mfu is not None else "MFU unknown on this device"
        return f"compute efficiency: `training.compile`, attention kernel (`training.attention`); {m}"
    if phase == "optimizer":
        return "optimizer: fused AdamW, or overlap the CPU step with `memory.offload`"
    if "offload" in phase:
        return "offload transfers: keep more on the GPU with `memory.offload_ratio`; pinned, overlapped copies"
    if "comm" in phase:
        return "exposed communication: `parallel.tp_overlap`, FSDP prefetch (`parallel.reshard_after_forward`)"
    return f"the lever that records `time.{phase}`"


def _sinks(steady, nsteps, phase_keys, step_s, mfu, analysis) -> str:
    if step_s is None and not phase_keys:
        return _note("No step_s or time.* figures: nothing to rank.")
    items = []  # (name, seconds per step, lever)
    for k in phase_keys:
        v = _weighted_mean((r.get(k), nsteps[id(r)]) for r in steady)
        if v is not None:
            *parent, p = k[len("time."):].split(".")
            label = p.replace("_", " ") + (f" (inside {parent[-1]})" if parent else "")
            items.append((label, v, _lever_for(p, mfu)))
    stacked = _top_level(phase_keys)
    if step_s is not None and stacked:
        other = _weighted_mean(
            (max(0.0, _num(r.get("step_s")) - sum(_num(r.get(k)) or 0.0 for k in stacked)), nsteps[id(r)])
            for r in steady if _num(r.get("step_s")) is not None
        )
        if other is not None:
            items.append(("other (CPU / launch overhead)", other,
                          "host overhead: `training.compile` (fewer, larger kernels), CUDA graphs"))
    loss_frac = _num(analysis.get("clock_loss_frac"))
    if loss_frac is not None and step_s is not None:
        items.append(("clock drop (DVFS; inside the compute phases)", loss_frac * step_s,
                      ("power/DVFS: `hw` section (`hw.power_limit_w`, `hw.lock_sm_clock_mhz`); "
                       "measure the card with `holotrain hw probe`")))
    if not items:
        return _note("No phase times to rank.")
    items.sort(key=lambda it: -it[1])
    top = max(it[1] for it in items) or 1.0
    body = []
    for i, (label, secs, lever) in enumerate(items, 1):
        share = secs / step_s if step_s else None
        bar = f'<span class="bar" style="width:{max(1, round(120 * secs / top))}px"></span>'
        body.append(f"<tr><td class=\"num\">{i}</td><td>{esc(label)}</td><td class=\"num\">{esc(_fmt(secs))}</td>"
                    f"<td class=\"nowrap\">{bar}{esc(_pct(share))}</td><td>{_code(lever)}</td></tr>")
    head = "<tr><th>#</th><th>time sink</th><th>s / step</th><th>% of step</th><th>lever</th></tr>"
    return (f'<table class="sinks">{head}{"".join(body)}</table>'
            + _note(f"Mean step: {_fmt(step_s)} s. Largest first; the lever column names the holotrain setting "
                    "that addresses each sink."))
