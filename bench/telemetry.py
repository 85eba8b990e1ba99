"""What the profiler and NVML telemetry cost, whether their energy figures hold, and J/token against HF.

One process, one GPU, the trunk's peer shape (1.4b, T=2048, B=8):
  1. Overhead: holotrain's training step built once, then run in alternating blocks with the phase clock
     and the telemetry sampler off and on (paired, so clock and thermal drift hit both alike). Each block
     ends with the log-time work the trainer does (phase collection, telemetry window); overhead is the
     median on-block time over the median off-block time, minus one.
  2. Energy check: over all on-blocks, the NVML energy counter against the integral of the sampled power.
  3. J/token of holotrain against HF Transformers (sdpa) on the same batches, each with its own sampler.

  python bench/telemetry.py --out telemetry.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers  # noqa: E402

from holotrain.hw.dvfs import analyze, load_telemetry  # noqa: E402
from holotrain.hw.telemetry import Telemetry  # noqa: E402
from holotrain.model.costs import flops_per_token  # noqa: E402
from holotrain.profile import PhaseClock  # noqa: E402


def window_records(records: list[dict], t0: float, t1: float) -> list[dict]:
    return [r for r in records if r.get("kind") == "device" or t0 <= r.get("t", 0) <= t1]


def timed_block(step, batches, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        loss = step(*batches[i % len(batches)])
    loss.item()  # the trainer's log-time synchronization
    return (time.perf_counter() - t0) / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1.4b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pairs", type=int, default=6, help="off/on block pairs")
    p.add_argument("--block", type=int, default=10, help="steps per block (= the trainer's log_every)")
    p.add_argument("--hz", type=float, default=100.0)
    p.add_argument("--energy-steps", type=int, default=30, help="steps per variant for J/token")
    p.add_argument("--out", default="")
    args = p.parse_args()
    peers.ARGS = argparse.Namespace(preset=args.preset, seq_len=args.seq_len, batch=args.batch)
    device = torch.device("cuda")
    a, batches = peers.model_and_batches(args.preset, args.seq_len, args.batch, device)
    tokens = args.batch * args.seq_len
    tmp = Path(tempfile.mkdtemp())
    result = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "command": "python " + " ".join(sys.argv),
        "shape": {"preset": args.preset, "seq_len": args.seq_len, "batch": args.batch},
    }

    # 1 + 2: overhead, energy agreement ------------------------------------------------------------
    step, keep = peers.build_variant("holotrain", a, device)
    train_step = keep[2]
    for i in range(8):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    off, on, on_windows, counter_j, sampler = [], [], [], 0.0, []
    for pair in range(args.pairs):
        for mode in ("off", "on") if pair % 2 == 0 else ("on", "off"):
            if mode == "off":
                train_step.clock = None
                off.append(timed_block(step, batches, args.block))
                continue
            # "on" is what the trainer runs: the phase clock in the step, the sampler beside it, and the
            # log-time phase collection and telemetry window inside the timed block.
            clock = PhaseClock(device)
            train_step.clock = clock
            with Telemetry([torch.cuda.current_device()], tmp / "holotrain.jsonl", args.hz) as tel:
                tel.window()
                t0, wall0 = time.time(), time.perf_counter()
                for i in range(args.block):
                    loss = step(*batches[i % len(batches)])
                loss.item()
                tel.mark(pair)
                w = tel.window()
                result["phases_last_block"] = clock.collect(args.block)
                on.append((time.perf_counter() - wall0) / args.block)
                on_windows.append((t0, time.time()))
                sampler.append(tel.stats())
            counter_j += w["energy.joules"] or 0.0
            result["hw_last_block"] = w
    records = load_telemetry(tmp / "holotrain.jsonl")
    integrated = sum(
        analyze(window_records(records, t0, t1))["energy_j_integrated"] or 0.0 for t0, t1 in on_windows
    )
    counted = sum(analyze(window_records(records, t0, t1))["energy_j"] or 0.0 for t0, t1 in on_windows)
    off_s, on_s = statistics.median(off), statistics.median(on)
    result["overhead"] = {
        "off_step_ms": [x * 1000 for x in off], "on_step_ms": [x * 1000 for x in on],
        "median_off_ms": off_s * 1000, "median_on_ms": on_s * 1000, "overhead_frac": on_s / off_s - 1,
        "sampler_hz_achieved": statistics.median(x["achieved_hz"] for x in sampler if x["achieved_hz"]),
        "sampler_cost_ms": statistics.median(x["mean_sample_s"] for x in sampler if x["mean_sample_s"]) * 1000,
    }
    result["energy_check"] = {
        "counter_j_window": counter_j, "counter_j_samples": counted, "integrated_power_j": integrated,
        "integrated_over_counter": integrated / counter_j if counter_j else None,
    }
    print(json.dumps({k: result[k] for k in ("overhead", "energy_check")}), flush=True)
    del step, keep, train_step
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()

    # 3: J/token, holotrain vs HF ---------------------------------------------------------------------
    fpt = flops_per_token(a, args.seq_len)
    result["energy"] = {}
    for name in ("holotrain", "hf"):
        step, keep = peers.build_variant(name, a, device)
        for i in range(6):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
        with Telemetry([torch.cuda.current_device()], tmp / f"{name}.jsonl", args.hz) as t:
            t.window()
            s = timed_block(step, batches, args.energy_steps)
            w = t.window()
        result["energy"][name] = {
            "step_ms": s * 1000, "tokens_per_s": tokens / s, "tflops": fpt * tokens / s / 1e12,
            "j_per_token": w["energy.joules"] / (tokens * args.energy_steps) if w["energy.joules"] else None,
            "mean_power_w": w["hw.power_w"], "sm_clock_mhz": w["hw.sm_clock_mhz"],
            "power_capped_frac": w["hw.power_capped_frac"],
        }
        print(name, json.dumps(result["energy"][name]), flush=True)
        del step, keep
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    e = result["energy"]
    if e["hf"]["j_per_token"] and e["holotrain"]["j_per_token"]:
        result["hf_over_holotrain_j_per_token"] = e["hf"]["j_per_token"] / e["holotrain"]["j_per_token"]
    print(json.dumps({"overhead_frac": result["overhead"]["overhead_frac"],
                      "integrated_over_counter": result["energy_check"]["integrated_over_counter"],
                      "hf_over_holotrain_j_per_token": result.get("hf_over_holotrain_j_per_token")}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
