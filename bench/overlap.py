"""Tensor-parallel compute/communication overlap on 2 GPUs: NCCL-then-GEMM, torch async-TP and holotrain's fused
Triton kernels, for all-gather + GEMM and GEMM + reduce-scatter; then the 1.4b model end to end with TP=2.

Kernels (--part kernels): for M in {8192, 16384} and (K, N) in {(4096, 14336), (8192, 14336)}, bf16,
  all-gather + GEMM   a_shard [M/2, K] gathered, times w [K, N/2]      -> [M, N/2]
  GEMM + scatter      a [M, N/2] times w [N/2, K], reduce-scattered    -> [M/2, K]
each timed as: the collective alone (NCCL), the GEMM alone (cuBLAS), NCCL then GEMM ("sequential"), torch async-TP,
ours ("fused"), and our Triton GEMM alone (no communication). Per-iteration CUDA events over back-to-back calls
after warm-up, the median, the slower rank's. Overlap efficiency = (sequential - t) / (sequential - max(GEMM, comm)):
1 = the communication fully hidden behind the cuBLAS GEMM, 0 = none of it. Targets: >= 90% and >= 1.10x faster than
async-TP at M=16384, K=8192, N=14336, both directions. First a few tile configurations of the fused kernels are tried
on that shape (--tiles); the best serves every shape and the end-to-end runs.

Then the same table for the TP ops of the end-to-end model (1.4b, TP=2, 16384 tokens: QKV and gate/up all-gather +
GEMM, wo and w2 GEMM + reduce-scatter, forward and the backward's input-gradient ops), labelled by op: whether a
mode's op is slower in isolation or only inside the model.

End to end (--part e2e): the 1.4b preset (T=2048, B=8, bf16, AdamW) with TP=2 on the 2 GPUs (FSDP2 over dp=1),
holotrain's TrainStep on synthetic batches, tokens/s per parallel.tp_overlap mode; also the host's time to enqueue a
step (host_ms; close to step_ms: host-bound, or a synchronization inside the step) and, with --e2e-profile, one
profiled step's top GPU kernels per mode.

  torchrun --standalone --nproc_per_node=2 bench/overlap.py --part kernels --out OUT/kernels.json
  torchrun --standalone --nproc_per_node=2 bench/overlap.py --part e2e --tiles BEST --out OUT/e2e.json
Set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (bench/gpu/parallel.sh does).
--spin-limit, --barrier-ms, --piece-mb: the fused path's parallel.tp_spin_limit, tp_barrier_ms, tp_piece_mb, for
every part (the e2e runs pass them as config overrides).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import ParallelConfig  # noqa: E402
from holotrain.parallel.overlap import TPComm, all_gather_matmul, matmul_reduce_scatter  # noqa: E402
from holotrain.parallel.tiles import Tiles, parse_tiles  # noqa: E402

SHAPES = [(8192, 4096, 14336), (8192, 8192, 14336), (16384, 4096, 14336), (16384, 8192, 14336)]
LARGE = (16384, 8192, 14336)
# (direction, M, K, N, op) of the 1.4b TP=2 step (dim 2048, ffn 5632, 16 heads, B*T = 16384), in kernel_ops' terms:
# ag: gathered [M, K] @ [K, N/2]; rs: [M, N/2] @ [N/2, K] reduce-scattered to [M/2, K]. The backward's input-gradient
# ops use the weight as [K, N] ("kn") in the model; here "nk" (cuBLAS takes either without a copy).
E2E_OPS = [("ag", 16384, 2048, 6144, "qkv fwd"), ("ag", 16384, 2048, 11264, "gate_up fwd"),
           ("rs", 16384, 2048, 2048, "wo fwd"), ("rs", 16384, 2048, 5632, "w2 fwd"),
           ("rs", 16384, 2048, 6144, "qkv bwd dx"), ("rs", 16384, 2048, 11264, "gate_up bwd dx"),
           ("ag", 16384, 2048, 2048, "wo bwd dx"), ("ag", 16384, 2048, 5632, "w2 bwd dx")]
# f1: the all-gather GEMM's tile and K loops flattened; e2: its epilogue in two halves (room for a 4th stage)
TILES = ["128x256x64-s3-w8", "128x256x64-s3-w8-f1", "128x256x64-s4-w8-f1-e2", "128x256x64-s4-w8-e2",
         "256x128x64-s3-w8", "128x256x64-s3-w8-x1"]


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def median_call_ms(fn, iters: int) -> float:
    """Median time (ms) of `iters` back-to-back calls of fn, each bracketed by CUDA events; this process only."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(iters))


def time_ms(fn, iters: int, warmup: int) -> float:
    """Median per-call time of back-to-back calls (ms), the slower rank's."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    med = median_call_ms(fn, iters)
    t = torch.tensor([med], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


HOOKS: dict = {}  # "comms": the running part's TPComm per mode (diagnostics); "save": writes the results so far


def context_error() -> str | None:
    """None if this rank's CUDA context still runs kernels, else the (sticky) error."""
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return None
    except Exception as e:
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0] if text else ''}"


def attempt(results: dict, key: str, fn):
    """Runs one measurement; a failure is recorded (and printed, with the fused path's state) and the benchmark goes
    on, unless the CUDA context is lost (a trapped or faulting kernel): then the results so far are saved and the
    process ends at once, rather than every later measurement failing or hanging until the watchdog."""
    try:
        value = fn()
        results[key] = value
        return value
    except Exception as e:
        rank = dist.get_rank()
        results[key] = None
        results.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
        print(f"[rank {rank}] {key} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}", flush=True)
        dead = context_error()
        if dead is not None:
            print(f"[rank {rank}] DIAG {key}: CUDA context lost ({dead}): a kernel trapped (a symmetric-memory "
                  "barrier timing out: the ranks went out of step) or faulted; ending this part now", flush=True)
            results["errors"][key] += f" [CUDA context lost on rank {rank}: {dead}]"
            if "save" in HOOKS:
                HOOKS["save"]()
            sys.stdout.flush()
            os._exit(3)
        comm = HOOKS.get("comms", {}).get("fused")
        if comm is not None and comm._fused is not None:
            try:
                print(f"[rank {rank}] DIAG {key}: {comm.fused.state()}", flush=True)
            except Exception as e2:
                print(f"[rank {rank}] DIAG {key}: fused state unavailable: {e2}", flush=True)
        return None


def inputs(direction: str, M: int, K: int, N: int, world: int, gen):
    dev = torch.device("cuda")

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(torch.bfloat16)

    if direction == "ag":  # column-parallel: gathered [M, K] times this rank's N/world output columns
        return rand(M // world, K), rand(N // world, K, scale=K ** -0.5)
    return rand(M, N // world), rand(K, N // world, scale=N ** -0.5)  # row-parallel: [M, N/world] -> [M/world, K]


def kernel_ops(direction, a, w, comms, world):
    """name -> zero-argument callable, for one direction and shape."""
    ops = {}
    if direction == "ag":
        gathered = a.new_empty((a.shape[0] * world, a.shape[1]))
        ops["comm"] = lambda: dist.all_gather_into_tensor(gathered, a)
        ops["gemm"] = lambda: gathered @ w.t()
        ops["sequential"] = lambda: all_gather_matmul(a, w, comms["none"])
        ops["async_tp"] = lambda: all_gather_matmul(a, w, comms["async_tp"])
        ops["fused"] = lambda: comms["fused"].fused.all_gather_matmul(a, w)
    else:
        partial = a @ w.t()
        out = partial.new_empty((partial.shape[0] // world, partial.shape[1]))
        ops["comm"] = lambda: dist.reduce_scatter_tensor(out, partial)
        ops["gemm"] = lambda: a @ w.t()
        ops["sequential"] = lambda: matmul_reduce_scatter(a, w, comms["none"])
        ops["async_tp"] = lambda: matmul_reduce_scatter(a, w, comms["async_tp"])
        ops["fused"] = lambda: comms["fused"].fused.matmul_reduce_scatter(a, w)
    return ops


def derived(r: dict) -> dict:
    seq, gemm, comm = r.get("sequential"), r.get("gemm"), r.get("comm")
    out = {}
    for mode in ["async_tp"] + [k for k in r if k == "fused" or (k.startswith("fused ") and not k.endswith("_mhz"))]:
        t = r.get(mode)
        if None not in (seq, gemm, comm, t) and seq > max(gemm, comm):
            out[f"{mode}_efficiency"] = (seq - t) / (seq - max(gemm, comm))
        if mode != "async_tp" and t and r.get("async_tp"):
            out[f"{mode}_vs_async_tp"] = r["async_tp"] / t
    if r.get("fused") and r.get("triton_gemm"):  # what the communication still costs over our own GEMM
        out["fused_minus_triton_gemm"] = r["fused"] - r["triton_gemm"]
    return out


def agree(flag: bool) -> bool:
    """Rank 0's decision, on every rank (the ranks must make the same calls)."""
    t = torch.tensor([1 if flag else 0], device="cuda")
    dist.broadcast(t, 0)
    return bool(t.item())


def set_tiles(comm: TPComm, text: str) -> None:
    comm.fused.tiles = Tiles(**parse_tiles(text))


def run_kernels(args, comms, world, result, save):
    """Baselines for every shape first (safe), then the fused kernels' tiles, then fused on every shape."""
    from holotrain.parallel.overlap_kernels import triton_matmul

    gen = torch.Generator(device="cuda").manual_seed(1000 + dist.get_rank())
    rows = result.setdefault("rows", [])
    cases = [(d, M, K, N, None) for M, K, N in SHAPES for d in ("ag", "rs")] + (E2E_OPS if args.e2e_ops else [])
    for direction, M, K, N, op in cases:
        r = {"direction": direction, "M": M, "K": K, "N": N}
        if op:
            r["op"] = op
        a, w = inputs(direction, M, K, N, world, gen)
        ops = kernel_ops(direction, a, w, comms, world)
        for name in ("comm", "gemm", "sequential", "async_tp"):
            if name == "async_tp" and name not in comms:
                r[name] = None
                continue
            attempt(r, name, lambda: time_ms(ops[name], args.iters, args.warmup))
        rows.append(r)
        log(json.dumps(r))
        save()
    gc.collect()
    torch.cuda.empty_cache()
    if "fused" not in comms:
        return
    # Tile configurations of the fused kernels on the large shape; the best serves every shape.
    tuning = result.setdefault("tiles", {})
    t_tune = time.perf_counter()
    for i, text in enumerate(args.tiles.split(",")):
        if i and not agree(time.perf_counter() - t_tune < args.tune_budget):  # compiling each costs seconds
            log(f"tile tuning stops after {i} configurations (--tune-budget {args.tune_budget} s)")
            break
        row = tuning.setdefault(text, {})
        set_tiles(comms["fused"], text)
        for direction in ("ag", "rs"):
            a, w = inputs(direction, *LARGE, world, gen)
            ops = kernel_ops(direction, a, w, comms, world)
            t0 = time.perf_counter()
            attempt(row, direction, lambda: time_ms(ops["fused"], args.iters, args.warmup))
            row[f"{direction}_first_s"] = round(time.perf_counter() - t0, 1)  # compilation included
            if direction == "ag":  # our GEMM alone, same tiles, on the gathered rows
                tiles = Tiles(**parse_tiles(text))
                gathered = torch.cat([a] * world)
                attempt(row, "triton_gemm", lambda: time_ms(lambda: triton_matmul(gathered, w, "nk", tiles),
                                                            args.iters, args.warmup))
        log(f"tiles {text}: " + json.dumps(row))
        save()
    scored = {t: r["ag"] + r["rs"] for t, r in tuning.items() if r.get("ag") and r.get("rs")}
    best = min(scored, key=scored.get) if scored else str(Tiles())
    result["best_tiles"] = best
    # The reduce-scatter's tiles handed out round-robin instead of by an atomic counter.
    row = tuning.setdefault(best + "-d0", {})
    set_tiles(comms["fused"], best + "-d0")
    a, w = inputs("rs", *LARGE, world, gen)
    attempt(row, "rs", lambda: time_ms(kernel_ops("rs", a, w, comms, world)["fused"], args.iters, args.warmup))
    set_tiles(comms["fused"], best)
    log(f"best tiles {best} (sum of the large shape's two directions); round-robin reduce-scatter: {row}")
    save()
    for r in rows:
        direction, M, K, N = r["direction"], r["M"], r["K"], r["N"]
        a, w = inputs(direction, M, K, N, world, gen)
        ops = kernel_ops(direction, a, w, comms, world)
        attempt(r, "fused", lambda: time_ms(ops["fused"], args.iters, args.warmup))
        gathered = torch.cat([a] * world) if direction == "ag" else a
        tiles = comms["fused"].fused.tiles
        attempt(r, "triton_gemm", lambda: time_ms(lambda: triton_matmul(gathered, w, "nk", tiles),
                                                  args.iters, args.warmup))
        attempt(r, "fused_errors_checked", lambda: comms["fused"].fused.check() or True)
        r.update(derived(r))
        log(json.dumps(r))
        save()
        gc.collect()
        torch.cuda.empty_cache()


def with_tiles(comm: TPComm, tiles, fn):
    """fn() with the fused path's tiles set to `tiles` for the call."""
    saved, comm.fused.tiles = comm.fused.tiles, tiles
    try:
        return fn()
    finally:
        comm.fused.tiles = saved


def steady_ms(fn, args, into: dict, key: str) -> float:
    """Median ms per call in the power steady state, the slower rank's; this rank's mean SM clock over the timed
    calls goes to into[key] (a float, so the rounds' medians take it in).

    The H200 sits at its 700 W cap under these GEMMs, and its power limiter averages over tens to hundreds of ms:
    a variant timed right after a light one (the collective alone) borrows its power headroom and runs at a higher
    clock. So every variant first runs back to back for --settle-s seconds, then is timed over at least
    --window-s seconds. Both ranks make the same number of calls (the slower rank's estimate decides)."""
    est = torch.tensor([time_ms(fn, max(3, args.warmup), 2)], device="cuda")  # ms per call, rank-agreed below
    dist.all_reduce(est, op=dist.ReduceOp.MAX)
    settle = int(args.settle_s * 1000 / max(est.item(), 1e-3))
    calls = max(args.iters, int(args.window_s * 1000 / max(est.item(), 1e-3)))
    for _ in range(settle):
        fn()
    with ClockSampler() as clock:
        ms = time_ms(fn, calls, 0)
    mhz = clock.summary().get("sm_mhz_mean")
    if mhz:
        into[key] = float(mhz)
    return ms


def run_rounds(args, comms, world, result, save):
    """The large shape's targets measured in interleaved rounds: every variant of both directions once per round,
    in its power steady state (steady_ms), --rounds rounds with the order rotated each round, so that drift in the
    clock or power state over the run falls on all variants alike; per variant the median over rounds, and the
    per-round ratios' median."""
    from holotrain.parallel.overlap_kernels import triton_matmul

    gen = torch.Generator(device="cuda").manual_seed(2000 + dist.get_rank())
    if "fused" in comms and args.e2e_tiles:
        set_tiles(comms["fused"], args.e2e_tiles)
    out = result.setdefault("rounds", {"tiles": str(comms["fused"].fused.tiles) if "fused" in comms else None,
                                       "rounds": args.rounds, "iters": args.iters, "settle_s": args.settle_s,
                                       "window_s": args.window_s, "per_round": []})
    variants = {}
    for direction in ("ag", "rs"):
        a, w = inputs(direction, *LARGE, world, gen)
        ops = {k: v for k, v in kernel_ops(direction, a, w, comms, world).items()
               if k != "async_tp" or "async_tp" in comms}
        gathered = torch.cat([a] * world) if direction == "ag" else a
        if "fused" in comms:
            base = comms["fused"].fused.tiles
            ops["triton_gemm"] = lambda g=gathered, w=w: triton_matmul(g, w, "nk", base)
            if direction == "ag" and args.rounds_diag:  # wrong results by design: what waiting and copies cost
                for d in ("no_wait", "no_comm"):
                    ops[f"fused_{d}"] = lambda a=a, w=w, d=d: comms["fused"].fused.all_gather_matmul(a, w, diag=d)
            if direction == "rs" and args.rounds_diag:  # no NVLink stores, no waits (a wrong result by design)
                ops["fused_local_stores"] = lambda a=a, w=w: comms["fused"].fused.matmul_reduce_scatter(
                    a, w, diag_local_stores=True)
            for text in filter(None, args.rounds_alt.split(",")):  # the same ops with other tiles
                alt = Tiles(**parse_tiles(text))
                if direction == "rs" and dataclasses.replace(alt, core=0, epi=1, flat=0) == \
                        dataclasses.replace(base, core=0, epi=1, flat=0):
                    continue  # core, epi and flat change only the all-gather kernel
                ops[f"fused {text}"] = lambda fn=ops["fused"], alt=alt: with_tiles(comms["fused"], alt, fn)
                ops[f"gemm {text}"] = lambda g=gathered, w=w, alt=alt: triton_matmul(g, w, "nk", alt)
        variants[direction] = ops
    for _ in range(args.rounds):
        this = {}
        for direction, ops in variants.items():
            r = {}
            names = list(ops)
            names = names[len(out["per_round"]) % len(names):] + names[:len(out["per_round"]) % len(names)]
            for name in names:  # each round starts one variant later: no variant always follows the same one
                attempt(r, name, lambda fn=ops[name], name=name, r=r: steady_ms(fn, args, r, f"{name}_mhz"))
            r.update(derived(r))
            this[direction] = r
        out["per_round"].append(this)
        save()
    summary = {}
    for direction in variants:
        rows = [rd[direction] for rd in out["per_round"]]
        med = {k: statistics.median(r[k] for r in rows if isinstance(r.get(k), float))
               for k in rows[0] if isinstance(rows[0].get(k), float)}
        summary[direction] = med
    out["median"] = summary
    log("rounds: " + json.dumps(summary))
    save()
    if args.rounds_diag:  # where a call's time goes in the steady state: 3 calls back to back after settling
        for direction, name in (("ag", "fused"), ("ag", "async_tp"), ("rs", "fused"), ("rs", "async_tp")):
            if name in variants[direction]:
                key = f"steady timeline {direction} {name}"
                attempt(out, key, lambda: gpu_timeline(variants[direction][name], calls=3, settle_s=args.settle_s))
                if out.get(key):
                    log(key + ":\n" + "\n".join(f"  {r[0]:48s} s{r[1]} +{r[2]:8.1f} us {r[3]:8.1f} us"
                                                  for r in out[key]))
        save()


def profile_step(fn, top: int = 12) -> list:
    """Runs fn (one training step, on every rank) under the profiler, GPU activity only; this rank's top kernels by
    GPU time as [name, calls, ms]. A profiler that fails does not stop the step (the ranks must stay in step)."""
    prof, err = None, None
    try:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
    except Exception as e:
        prof, err = None, e
    fn()
    torch.cuda.synchronize()
    if prof is None:
        return [f"profiler failed to start: {type(err).__name__}: {err}"]
    try:
        prof.__exit__(None, None, None)
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
            if t:
                rows.append([e.key[:90], e.count, round(t / 1e3, 3)])
        rows.sort(key=lambda r: -r[2])
        total = sum(r[2] for r in rows)
        return [["(all kernels)", sum(r[1] for r in rows), round(total, 3)]] + rows[:top]
    except Exception as e:
        return [f"profiler failed: {type(e).__name__}: {e}"]


class ClockSampler:
    """This rank's GPU SM clock (MHz) and clock-event reasons, polled through NVML every ~2 ms on a thread while a
    measurement runs: whether a variant is slower because its GEMM runs at a lower clock (the H200 sits at its
    power cap under a large GEMM, and concurrent NVLink / copy-engine traffic draws from the same budget)."""

    def __init__(self):
        import threading

        import pynvml

        from holotrain.hw.nvml import handle_for_cuda, reasons_getter  # the event-reasons call this driver has

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = handle_for_cuda(pynvml, torch.cuda.current_device())
        self.reasons = reasons_getter(pynvml)
        self.samples: list[tuple[int, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            clock = self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)
            reasons = self.reasons(self.handle)
            self.samples.append((clock, reasons))
            time.sleep(0.002)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks = [c for c, _ in self.samples]
        sw_power = 0x004  # SwPowerCap (holotrain/hw/nvml.py)
        return {"sm_mhz_mean": round(statistics.mean(clocks)), "sm_mhz_min": min(clocks),
                "power_capped_frac": round(sum(1 for _, r in self.samples if r & sw_power) / len(self.samples), 2),
                "samples": len(clocks)}


def clocked(fn, seconds: float, warmup: int) -> dict:
    """fn back to back for about `seconds` with the SM clock sampled: median ms per call (slower rank), clock."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    iters = torch.tensor([max(10, int(seconds / max(one, 1e-4)))], device="cuda")
    dist.all_reduce(iters, op=dist.ReduceOp.MIN)  # the ranks make the same number of calls
    dist.barrier()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(int(iters) + 1)]
    with ClockSampler() as clock:
        events[0].record()
        for i in range(int(iters)):
            fn()
            events[i + 1].record()
        torch.cuda.synchronize()
    med = statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(int(iters)))
    t = torch.tensor([med], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"ms": round(t.item(), 4), "calls": int(iters), **clock.summary()}


def gpu_timeline(fn, path: Path | None = None, calls: int = 1, settle_s: float = 0.0) -> list:
    """`calls` back-to-back calls of fn under the profiler (after settle_s seconds of calls: the power steady
    state): this rank's GPU activities (kernels, copies) in start order as [name, stream, start us, duration us],
    relative to the first; where the time of a fused call goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    settle = 0
    if settle_s > 0:
        est = time_ms(fn, 3, 1)  # the slower rank's ms per call: both ranks settle with the same number of calls
        settle = int(settle_s * 1000 / max(est, 1e-3))
    for _ in range(settle):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    tmp = Path(f"/tmp/holotrain-timeline-{dist.get_rank()}.json")
    prof.export_chrome_trace(str(tmp))
    trace = json.loads(tmp.read_text())
    if path is not None:
        path.write_text(json.dumps(trace))
    gpu = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
           and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu.sort(key=lambda e: e["ts"])
    t0 = gpu[0]["ts"] if gpu else 0
    return [[e["name"][:48], e.get("tid"), round(e["ts"] - t0, 1), round(e.get("dur", 0), 1)] for e in gpu]


def run_diag(args, comms, world, result, save):
    """Clocks per variant on the large shape, and the GPU timeline of one fused call per direction (large shape and
    the e2e model's QKV / w2 shapes)."""
    from holotrain.parallel.overlap_kernels import triton_matmul

    gen = torch.Generator(device="cuda").manual_seed(2000 + dist.get_rank())
    if args.e2e_tiles and "fused" in comms:
        set_tiles(comms["fused"], args.e2e_tiles)
    diag = result.setdefault("diag", {})
    for direction in ("ag", "rs"):
        a, w = inputs(direction, *LARGE, world, gen)
        ops = kernel_ops(direction, a, w, comms, world)
        if "fused" in comms:
            gathered = torch.cat([a] * world) if direction == "ag" else a
            tiles = comms["fused"].fused.tiles
            ops["triton_gemm"] = lambda: triton_matmul(gathered, w, "nk", tiles)
            if direction == "rs":  # the same kernel without NVLink stores or waits (its result is wrong)
                ops["fused_local_stores"] = lambda: comms["fused"].fused.matmul_reduce_scatter(
                    a, w, diag_local_stores=True)
        row = diag.setdefault(f"clocks {direction} {LARGE}", {})
        for name in ("gemm", "triton_gemm", "comm", "sequential", "async_tp", "fused", "fused_local_stores"):
            if name in ops and (name not in ("async_tp", "fused") or name in comms):
                attempt(row, name, lambda: clocked(ops[name], args.diag_seconds, args.warmup))
        log(f"clocks {direction} {LARGE}: " + json.dumps(row))
        save()
    if "fused" not in comms:
        return
    shapes = [("ag", *LARGE), ("rs", *LARGE), ("ag", 16384, 2048, 6144), ("rs", 16384, 2048, 5632)]
    for direction, M, K, N in shapes:
        a, w = inputs(direction, M, K, N, world, gen)
        ops = kernel_ops(direction, a, w, comms, world)
        key = f"timeline fused {direction} {(M, K, N)}"
        for mode in ("fused", "async_tp"):
            if mode in comms:
                k = key.replace("fused", mode)
                attempt(diag, k, lambda: gpu_timeline(ops[mode]))
                if diag.get(k):
                    log(k + ":\n" + "\n".join(f"  {r[0]:48s} s{r[1]} +{r[2]:8.1f} us {r[3]:8.1f} us" for r in diag[k]))
        save()


def run_e2e(args, world, result, save):
    from holotrain.config import MemoryConfig, load_config, resolve
    from holotrain.model.costs import flops_per_token
    from holotrain.parallel import DistEnv
    from holotrain.train.trainer import TrainStep, build_model, build_optimizer, model_args

    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    env = DistEnv(rank=rank, world_size=world, local_rank=local, device=torch.device("cuda", local))
    rows = result.setdefault("e2e", [])
    runs = [(mode, int(c)) for mode in args.modes.split(",") for c in args.e2e_compile.split(",")]
    for mode, compiled in runs:
        # Compiled: regional compile of the blocks; the TP layers stay out of the graphs (compiler-disabled), so
        # each block compiles into the pieces between them.
        row = {"mode": mode + ("+compile" if compiled else ""), "overlap": mode, "compile": bool(compiled),
               "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch, "tp": world}
        overrides = [f"--model.preset={args.preset}", f"--data.seq_len={args.seq_len}",
                     f"--training.batch_size={args.batch}", f"--training.compile={'true' if compiled else 'false'}",
                     f"--parallel.tp={world}", f"--parallel.tp_overlap={mode}",
                     f"--parallel.tp_spin_limit={args.spin_limit}", f"--parallel.tp_barrier_ms={args.barrier_ms}",
                     f"--parallel.tp_piece_mb={args.piece_mb}"]
        if hasattr(MemoryConfig(), "check_fit"):
            overrides.append("--memory.check_fit=false")  # a throughput run: no memory planner in the way
        if mode == "fused" and args.e2e_tiles:
            overrides.append(f"--parallel.tp_tiles={args.e2e_tiles}")
        row["tiles"] = args.e2e_tiles if mode == "fused" else None

        def run():
            cfg = resolve(load_config(None, overrides), tokenizer_vocab=32000)
            a = model_args(cfg)
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            model = build_model(cfg, env, torch.bfloat16)
            tp_comm = getattr(model, "tp_comm", None)  # for attempt()'s diagnostic should this mode fail
            HOOKS["comms"] = {"fused": tp_comm} if tp_comm is not None and tp_comm.mode == "fused" else {}
            opt = build_optimizer(model, cfg, env, torch.bfloat16)
            step = TrainStep(model, opt, cfg, env, torch.bfloat16)
            gen = torch.Generator(device="cuda").manual_seed(0)  # the same batches on both ranks (one TP group)
            batches = []
            for _ in range(2):
                x = torch.randint(0, a.vocab_size, (args.batch, args.seq_len + 1), device="cuda", generator=gen)
                batches.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
            losses = []
            for i in range(args.e2e_warmup):
                losses.append(step(lambda m: batches[i % 2], 1, 3e-4)[0])
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(args.e2e_steps + 1)]
            host = []
            ev[0].record()
            for i in range(args.e2e_steps):
                h0 = time.perf_counter()
                losses.append(step(lambda m: batches[i % 2], 1, 3e-4)[0])
                host.append((time.perf_counter() - h0) * 1e3)  # enqueue time (the step does not synchronize)
                ev[i + 1].record()
            torch.cuda.synchronize()
            step_ms = statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(args.e2e_steps))
            t = torch.tensor([step_ms, statistics.median(host)], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            step_ms, host_ms = t.tolist()
            top = profile_step(lambda s=step: s(lambda m: batches[0], 1, 3e-4)) if args.e2e_profile else None
            tokens = args.batch * args.seq_len
            comm = getattr(model, "tp_comm", None)
            if comm is not None and comm.mode == "fused":
                comm.fused.check()
            out = {"tokens_per_s": tokens / step_ms * 1e3, "step_ms": step_ms, "host_ms": host_ms, "warmup_s": warm_s,
                   "tflops_per_gpu": flops_per_token(a, args.seq_len) * tokens / (step_ms / 1e3) / world / 1e12,
                   "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
                   "losses": [round(float(v), 4) for v in losses]}
            if top is not None:
                out["profile_top"] = top
            del model, opt, step
            return out

        res = {}
        attempt(res, "run", run)
        HOOKS["comms"] = {}
        row.update(res.get("run") or {"error": res.get("errors", {}).get("run")})
        rows.append(row)
        log(json.dumps(row))
        save()
        gc.collect()
        torch.cuda.empty_cache()
    base = {r["compile"]: r.get("tokens_per_s") for r in rows if r["overlap"] == "none"}
    for r in rows:  # against none with the same compile setting
        if r.get("tokens_per_s") and base.get(r["compile"]):
            r["vs_none"] = r["tokens_per_s"] / base[r["compile"]]


def markdown(result) -> str:
    lines = [f"### Tensor-parallel overlap, {result['device']} x{result['world']} ({result['date']})", "",
             f"torch {result['torch']}, triton {result['triton']}; `{result['command']}`; fused tiles "
             f"{result.get('best_tiles', '-')}. Times in ms (median, slower rank); efficiency = (sequential - t) / "
             "(sequential - max(GEMM, comm)).", ""]
    if result.get("rows"):
        lines += ["| dir | M | K | N | comm | GEMM (cuBLAS) | Triton GEMM | sequential | async-TP | fused | "
                  "eff. async-TP | eff. fused | fused vs async-TP |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def f(v, fmt="{:.3f}"):
            return fmt.format(v) if isinstance(v, (int, float)) else "-"

        for r in result["rows"]:
            what = ("AG+GEMM" if r["direction"] == "ag" else "GEMM+RS") + (f" ({r['op']})" if r.get("op") else "")
            lines.append(
                f"| {what} | {r['M']} | {r['K']} | {r['N']} | "
                f"{f(r.get('comm'))} | {f(r.get('gemm'))} | {f(r.get('triton_gemm'))} | {f(r.get('sequential'))} | "
                f"{f(r.get('async_tp'))} | {f(r.get('fused'))} | {f(r.get('async_tp_efficiency'), '{:.0%}')} | "
                f"{f(r.get('fused_efficiency'), '{:.0%}')} | {f(r.get('fused_vs_async_tp'), '{:.2f}x')} |")
        lines.append("")
        for r in result["rows"]:
            for key, msg in (r.get("errors") or {}).items():
                lines.append(f"Error, {r['direction']} {r['M']}x{r['K']}x{r['N']} {key}: {msg.splitlines()[0][:300]}")
        for r in result["rows"]:
            if (r["M"], r["K"], r["N"]) == LARGE and not r.get("op"):
                eff, sp = r.get("fused_efficiency"), r.get("fused_vs_async_tp")
                ok = eff is not None and sp is not None and eff >= 0.9 and sp >= 1.10
                lines.append(f"Target ({r['direction']}, large shape): efficiency >= 90% and >= 1.10x async-TP: "
                             f"{f(eff, '{:.0%}')}, {f(sp, '{:.2f}x')} -> {'MET' if ok else 'NOT MET'}")
        lines.append("")
    for t, r in (result.get("tiles") or {}).items():
        for key, msg in (r.get("errors") or {}).items():
            lines.append(f"Error, tiles {t} {key}: {msg.splitlines()[0][:300]}")
    if result.get("tiles"):
        lines += ["Tile configurations (large shape, fused ms): " + "; ".join(
            f"{t}: AG {r.get('ag') or '-'} RS {r.get('rs') or '-'} Triton GEMM {r.get('triton_gemm') or '-'}"
            for t, r in result["tiles"].items()), ""]
    rounds = result.get("rounds") or {}
    if rounds.get("median"):
        lines += [f"Large shape {LARGE}, {len(rounds['per_round'])} interleaved rounds, each variant timed over "
                  f">= {rounds.get('window_s', '-')} s after {rounds.get('settle_s', '-')} s of settling (fused tiles "
                  f"{rounds['tiles']}); medians over rounds, ms:", "",
                  "| dir | comm | GEMM (cuBLAS) | Triton GEMM | sequential | async-TP | fused | eff. async-TP | "
                  "eff. fused | fused vs async-TP |", "|---|---|---|---|---|---|---|---|---|---|"]
        targets = []
        for d, m in rounds["median"].items():
            def g(k, fmt="{:.3f}", m=m):
                return fmt.format(m[k]) if isinstance(m.get(k), float) else "-"
            name = "AG+GEMM" if d == "ag" else "GEMM+RS"
            eff, speedup = g("fused_efficiency", "{:.0%}"), g("fused_vs_async_tp", "{:.2f}x")
            lines.append(f"| {name} | {g('comm')} | {g('gemm')} | {g('triton_gemm')} | {g('sequential')} | "
                         f"{g('async_tp')} | {g('fused')} | {g('async_tp_efficiency', '{:.0%}')} | {eff} | {speedup} |")
            met = (m.get("fused_efficiency") or 0) >= 0.9 and (m.get("fused_vs_async_tp") or 0) >= 1.10
            targets.append(f"Target ({d}, rounds): efficiency >= 90% and >= 1.10x async-TP: {eff}, {speedup} -> "
                           f"{'MET' if met else 'NOT MET'}")
        for d, m in rounds["median"].items():
            for k in m:
                if k.startswith("fused ") and not k.endswith(("_mhz", "_efficiency", "_vs_async_tp")):
                    tiles = k[len("fused "):]
                    lines.append(f"Other tiles, {d}, {tiles}: fused {m[k]:.3f} ms, GEMM alone "
                                 f"{m.get('gemm ' + tiles, float('nan')):.3f} ms, efficiency "
                                 f"{m.get(k + '_efficiency', float('nan')):.0%}, vs async-TP "
                                 f"{m.get(k + '_vs_async_tp', float('nan')):.2f}x")
        clocks = [f"{'AG' if d == 'ag' else 'RS'}: " + ", ".join(
            f"{k[:-4]} {m[k]:.0f}" for k in m if k.endswith("_mhz")) for d, m in rounds["median"].items()]
        lines += [""] + targets + ["", "Mean SM clock while each variant ran (MHz, rank 0): " + "; ".join(clocks), ""]
    if result.get("e2e"):
        lines += ["| 1.4b TP=2, T=2048, B=8 | tokens/s | step ms | host ms | TFLOP/s per GPU | peak GB | vs none |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["e2e"]:
            if r.get("tokens_per_s"):
                host = f"{r['host_ms']:.1f}" if isinstance(r.get("host_ms"), (int, float)) else "-"
                lines.append(f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {host} | "
                             f"{r['tflops_per_gpu']:.0f} | {r['peak_mem_gb']:.1f} | {r.get('vs_none', 1):.3f} |")
            else:
                lines.append(f"| {r['mode']} | failed: {r.get('error')} | | | | | |")
        lines.append("")
        for r in result["e2e"]:
            if r.get("profile_top"):
                lines.append(f"Top GPU kernels, one profiled step, {r['mode']} (rank 0; name, calls, ms): " + "; ".join(
                    f"{x[0]} x{x[1]} {x[2]}" if isinstance(x, list) else str(x) for x in r["profile_top"]))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", default="kernels,e2e", help="comma list of kernels, diag (clocks per variant and fused "
                                                             "calls' GPU timelines), e2e")
    p.add_argument("--tiles", default=",".join(TILES), help="fused tile configurations to try (kernels part)")
    p.add_argument("--e2e-tiles", default="", help="fused tiles for the end-to-end runs (default: the best found, "
                                                   "else the built-in default)")
    p.add_argument("--modes", default="none,async_tp,fused", help="end-to-end tp_overlap modes")
    p.add_argument("--tune-budget", type=float, default=80, help="seconds of tile tuning (compiles included)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds-diag", type=int, default=0, help="rounds: 1 adds the all-gather's no-wait / no-comm "
                   "variants, the reduce-scatter's local-stores variant and steady-state timelines")
    p.add_argument("--rounds-alt", default="", help="rounds: comma list of other fused tiles measured beside")
    p.add_argument("--settle-s", type=float, default=0.3, help="rounds: seconds each variant runs before it is timed")
    p.add_argument("--window-s", type=float, default=0.2, help="rounds: at least this many seconds timed per variant")
    p.add_argument("--rounds", type=int, default=10, help="rounds: interleaved rounds on the large shape")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--preset", default="1.4b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--e2e-steps", type=int, default=8)
    p.add_argument("--e2e-warmup", type=int, default=3)
    p.add_argument("--e2e-compile", default="0", help="end-to-end: training.compile values to run each mode with, "
                                                        "comma list of 0 / 1")
    p.add_argument("--e2e-ops", type=int, default=1, help="1: also time the e2e model's TP op shapes (kernels part)")
    p.add_argument("--e2e-profile", type=int, default=1, help="1: profile one step per e2e mode (top GPU kernels)")
    p.add_argument("--out", default="", help="JSON results (written after every measurement); .md beside it")
    p.add_argument("--diag-seconds", type=float, default=0.4, help="diag: seconds per clocked variant")
    p.add_argument("--watchdog", type=float, default=0, help="dump stacks and exit after this many seconds")
    defaults = ParallelConfig()  # the fused path's settings, as in a training config's parallel section
    p.add_argument("--spin-limit", type=int, default=defaults.tp_spin_limit, help="parallel.tp_spin_limit")
    p.add_argument("--barrier-ms", type=int, default=defaults.tp_barrier_ms, help="parallel.tp_barrier_ms")
    p.add_argument("--piece-mb", type=float, default=defaults.tp_piece_mb, help="parallel.tp_piece_mb")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world = dist.get_world_size()
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "world": world,
              "torch": torch.__version__, "triton": triton_version, "command": "torchrun ... " + " ".join(sys.argv),
              "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                     "NVSHMEM_DISABLE_NVLS")},
              "fused_settings": {"spin_limit": args.spin_limit, "barrier_ms": args.barrier_ms,
                                 "piece_mb": args.piece_mb}}
    out = Path(args.out) if args.out else None

    def save():
        if out is not None and dist.get_rank() == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))
            out.with_suffix(".md").write_text(markdown(result))

    HOOKS["save"] = save
    log(f"{result['device']} x{world}, torch {result['torch']}, triton {triton_version}, env {result['env']}")
    parts = args.part.split(",")
    if "kernels" in parts or "diag" in parts or "rounds" in parts:
        comms = {}
        for mode in ("none", "async_tp", "fused"):
            attempt(comms, mode, lambda: TPComm(dist.group.WORLD, mode, spin_limit=args.spin_limit,
                                                barrier_ms=args.barrier_ms, piece_mb=args.piece_mb))
        comms = {k: v for k, v in comms.items() if isinstance(v, TPComm)}
        HOOKS["comms"] = comms
    if "kernels" in parts:
        run_kernels(args, comms, world, result, save)
        if not args.e2e_tiles:
            args.e2e_tiles = result.get("best_tiles", "")
    if "rounds" in parts:
        run_rounds(args, comms, world, result, save)
    if "diag" in parts:
        run_diag(args, comms, world, result, save)
    if "e2e" in parts:
        run_e2e(args, world, result, save)
    save()
    log("\n" + markdown(result))
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
