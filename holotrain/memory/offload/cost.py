"""What offloading costs in time, by the engine's overlap rule (engine.py), for the planner (holotrain/plan).

The CPU step updates the buckets at the measured AdamW rate. A step that speculates (its gradient norm does not
clip) updates each bucket as soon as its gradient lands, behind the rest of backward and the next forward. A step
that clips waits for the norm at the end of backward, so only the next forward hides the update: it runs unit by
unit behind the CPU, which is exposed by as much as it is longer than that forward, and never by less than the
first unit's share (the first unit the forward needs is the last one updated before it). With the delayed update
(memory.offload_delayed_update) the next step's forward and backward both hide it: the updates run in backward's
order, each bucket needed when that backward releases it."""

from __future__ import annotations

# The share of the machine's probed AdamW rate (hw probe: the kernel alone) that a training step's CPU update reaches:
# it shares the host with the data plane, the trainer's threads and the transfers. Measured through `holotrain train`
# on an H200's host: 0.83 for the 7B, 0.67-0.78 for the 1.4b (bench/RESULTS.md). Trials measure the job's own.
ADAMW_IN_TRAINING = 0.8


def exposed_cpu_step(n_offloaded: int, adamw_params_s: float, forward_s: float, backward_s: float, clipped: bool,
                     units: int, delayed: bool = False) -> float:
    """Seconds per step the GPU waits for the CPU step."""
    cpu = n_offloaded / adamw_params_s
    if delayed:  # bucket k of U is ready after k/U of the CPU step, needed after the forward and k/U of backward
        return max(0.0, cpu - forward_s - backward_s)
    hidden = forward_s if clipped else forward_s + backward_s
    return max(cpu / units, cpu - hidden * (1 - 1 / units))
