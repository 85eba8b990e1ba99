"""The optimizer step alone: torch's fused AdamW (fp32 moments) against memory.adamw_moments = "bf16"
(holotrain/optim/bf16_moments.py's one-launch kernel) over a config's parameters on the GPU, with the clip folded in
as training does it (optim.step_clipped). Prints the median step time of each and the moments' bytes.

Usage (on the GPU machine): python3 bench/adamw_moments.py [CONFIG] [REPEATS]
"""

from __future__ import annotations

import statistics
import sys

import torch

from holotrain.model import build
from holotrain.optim import AdamWHyper, fused_adamw, param_groups, step_clipped
from holotrain.optim.bf16_moments import AdamWBf16Moments
from holotrain.plan.planner import job_config
from holotrain.train.resolve import model_args


def time_steps(optimizer, params, repeats: int) -> float:
    times = []
    for i in range(repeats + 3):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step_clipped(optimizer, norm, 1.0)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:  # warm-up: state allocation, the kernel's compilation
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "1.4b"
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    cfg = job_config(name, [])
    hyper = AdamWHyper.from_section(cfg.training)
    results = {}
    for moments in ("fp32", "bf16"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = build(model_args(cfg))
        params = list(model.parameters())
        if moments == "fp32":
            optimizer = fused_adamw(params, 1e-4, hyper)
        else:
            optimizer = AdamWBf16Moments(param_groups(params, hyper.weight_decay), 1e-4, hyper.betas, hyper.eps)
        ms = time_steps(optimizer, params, repeats)
        state_gb = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()) / 1e9
        results[moments] = ms
        print(f"{name} {moments} moments: {sum(p.numel() for p in params) / 1e9:.2f}B parameters, step {ms:.2f} ms "
              f"(median of {repeats}), optimizer state {state_gb:.2f} GB", flush=True)
        del model, params, optimizer
        torch.cuda.empty_cache()
    print(f"bf16 / fp32 step time: {results['bf16'] / results['fp32']:.3f}")


if __name__ == "__main__":
    main()
