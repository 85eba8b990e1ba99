"""The optimizer step behind one interface, whichever lever runs it.

The trainer drives every optimizer the same way, once per optimizer step:

    optimizer.begin(lr, accum)        before the first micro-batch
    ... forward / backward of each micro-batch ...
    grad_norm = optimizer.finish()    after the last backward: clip, step, zero the gradients

Two implementations: `DeviceAdamW` (fused AdamW where the parameters live) and the offload engine
(holotrain/memory/offload: fp32 masters and moments in host memory, the step on the CPU). The parameter groups,
the clipping rule and the clip folded into the fused kernel are written once, here, and used by both.
"""

from holotrain.optim.adamw import (
    AdamWHyper,
    DeviceAdamW,
    StepOptimizer,
    fused_adamw,
    param_groups,
    step_clipped,
)

__all__ = ["AdamWHyper", "DeviceAdamW", "StepOptimizer", "fused_adamw", "param_groups", "step_clipped"]
