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

End to end (--part e2e): the 1.4b preset (T=2048, B=8, bf16, AdamW) with TP=2 on the 2 GPUs (FSDP2 over dp=1),
holotrain's TrainStep on synthetic batches, tokens/s per parallel.tp_overlap mode.

  torchrun --standalone --nproc_per_node=2 bench/overlap.py --part kernels --out OUT/kernels.json
  torchrun --standalone --nproc_per_node=2 bench/overlap.py --part e2e --tiles BEST --out OUT/e2e.json
Set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (bench/gpu_tp.sh does).
"""

from __future__ import annotations

import argparse
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

from holotrain.parallel.overlap import TPComm, all_gather_matmul, matmul_reduce_scatter, parse_tiles  # noqa: E402

SHAPES = [(8192, 4096, 14336), (8192, 8192, 14336), (16384, 4096, 14336), (16384, 8192, 14336)]
LARGE = (16384, 8192, 14336)
TILES = ["128x256x64-s3-w8", "128x256x64-s4-w8", "256x128x64-s3-w8", "128x256x128-s2-w8", "128x256x64-s3-w8-x1"]


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def time_ms(fn, iters: int, warmup: int) -> float:
    """Median per-call time of back-to-back calls (ms), the slower rank's."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        fn()
        events[i + 1].record()
    torch.cuda.synchronize()
    med = statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(iters))
    t = torch.tensor([med], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def attempt(results: dict, key: str, fn):
    """Runs one measurement; a failure is recorded (and printed) and the benchmark goes on."""
    try:
        value = fn()
        results[key] = value
        return value
    except Exception as e:
        results[key] = None
        results.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
        print(f"[rank {dist.get_rank()}] {key} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}", flush=True)
        torch.cuda.synchronize()
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
    for mode in ("async_tp", "fused"):
        t = r.get(mode)
        if None not in (seq, gemm, comm, t) and seq > max(gemm, comm):
            out[f"{mode}_efficiency"] = (seq - t) / (seq - max(gemm, comm))
    if r.get("fused") and r.get("async_tp"):
        out["fused_vs_async_tp"] = r["async_tp"] / r["fused"]
    if r.get("fused") and r.get("triton_gemm"):  # what the communication still costs over our own GEMM
        out["fused_minus_triton_gemm"] = r["fused"] - r["triton_gemm"]
    return out


def agree(flag: bool) -> bool:
    """Rank 0's decision, on every rank (the ranks must make the same calls)."""
    t = torch.tensor([1 if flag else 0], device="cuda")
    dist.broadcast(t, 0)
    return bool(t.item())


def set_tiles(comm: TPComm, text: str) -> None:
    from holotrain.parallel.overlap_kernels import Tiles

    comm.fused.tiles = Tiles(**parse_tiles(text))


def run_kernels(args, comms, world, result, save):
    """Baselines for every shape first (safe), then the fused kernels' tiles, then fused on every shape."""
    from holotrain.parallel.overlap_kernels import Tiles, triton_matmul

    gen = torch.Generator(device="cuda").manual_seed(1000 + dist.get_rank())
    rows = result.setdefault("rows", [])
    for M, K, N in SHAPES:
        for direction in ("ag", "rs"):
            r = {"direction": direction, "M": M, "K": K, "N": N}
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


def run_e2e(args, world, result, save):
    from holotrain.config import MemoryConfig, load_config, resolve
    from holotrain.model import flops_per_token
    from holotrain.parallel import DistEnv
    from holotrain.train.trainer import TrainStep, build_model, build_optimizer, model_args

    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    env = DistEnv(rank=rank, world_size=world, local_rank=local, device=torch.device("cuda", local))
    rows = result.setdefault("e2e", [])
    for mode in args.modes.split(","):
        row = {"mode": mode, "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch, "tp": world}
        overrides = [f"--model.preset={args.preset}", f"--data.seq_len={args.seq_len}",
                     f"--training.batch_size={args.batch}", "--training.compile=false",
                     f"--parallel.tp={world}", f"--parallel.tp_overlap={mode}"]
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
            opt = build_optimizer(model, cfg)
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
            ev[0].record()
            for i in range(args.e2e_steps):
                losses.append(step(lambda m: batches[i % 2], 1, 3e-4)[0])
                ev[i + 1].record()
            torch.cuda.synchronize()
            step_ms = statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(args.e2e_steps))
            t = torch.tensor([step_ms], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            step_ms = t.item()
            tokens = args.batch * args.seq_len
            comm = getattr(model, "tp_comm", None)
            if comm is not None and comm.mode == "fused":
                comm.fused.check()
            out = {"tokens_per_s": tokens / step_ms * 1e3, "step_ms": step_ms, "warmup_s": warm_s,
                   "tflops_per_gpu": flops_per_token(a, args.seq_len) * tokens / (step_ms / 1e3) / world / 1e12,
                   "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
                   "losses": [round(float(v), 4) for v in losses]}
            del model, opt, step
            return out

        res = {}
        attempt(res, "run", run)
        row.update(res.get("run") or {"error": res.get("errors", {}).get("run")})
        rows.append(row)
        log(json.dumps(row))
        save()
        gc.collect()
        torch.cuda.empty_cache()
    base = {r["mode"]: r.get("tokens_per_s") for r in rows}
    for r in rows:
        if r.get("tokens_per_s") and base.get("none"):
            r["vs_none"] = r["tokens_per_s"] / base["none"]


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
            lines.append(
                f"| {'AG+GEMM' if r['direction'] == 'ag' else 'GEMM+RS'} | {r['M']} | {r['K']} | {r['N']} | "
                f"{f(r.get('comm'))} | {f(r.get('gemm'))} | {f(r.get('triton_gemm'))} | {f(r.get('sequential'))} | "
                f"{f(r.get('async_tp'))} | {f(r.get('fused'))} | {f(r.get('async_tp_efficiency'), '{:.0%}')} | "
                f"{f(r.get('fused_efficiency'), '{:.0%}')} | {f(r.get('fused_vs_async_tp'), '{:.2f}x')} |")
        lines.append("")
        for r in result["rows"]:
            if (r["M"], r["K"], r["N"]) == LARGE:
                eff, sp = r.get("fused_efficiency"), r.get("fused_vs_async_tp")
                ok = eff is not None and sp is not None and eff >= 0.9 and sp >= 1.10
                lines.append(f"Target ({r['direction']}, large shape): efficiency >= 90% and >= 1.10x async-TP: "
                             f"{f(eff, '{:.0%}')}, {f(sp, '{:.2f}x')} -> {'MET' if ok else 'NOT MET'}")
        lines.append("")
    if result.get("tiles"):
        lines += ["Tile configurations (large shape, fused ms): " + "; ".join(
            f"{t}: AG {r.get('ag') or '-'} RS {r.get('rs') or '-'} Triton GEMM {r.get('triton_gemm') or '-'}"
            for t, r in result["tiles"].items()), ""]
    if result.get("e2e"):
        lines += ["| 1.4b TP=2, T=2048, B=8 | tokens/s | step ms | TFLOP/s per GPU | peak GB | vs none |",
                  "|---|---|---|---|---|---|"]
        for r in result["e2e"]:
            if r.get("tokens_per_s"):
                lines.append(f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | "
                             f"{r['tflops_per_gpu']:.0f} | {r['peak_mem_gb']:.1f} | {r.get('vs_none', 1):.3f} |")
            else:
                lines.append(f"| {r['mode']} | failed: {r.get('error')} | | | | |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", default="kernels,e2e", help="kernels, e2e, or both")
    p.add_argument("--tiles", default=",".join(TILES), help="fused tile configurations to try (kernels part)")
    p.add_argument("--e2e-tiles", default="", help="fused tiles for the end-to-end runs (default: the best found, "
                                                   "else the built-in default)")
    p.add_argument("--modes", default="none,async_tp,fused", help="end-to-end tp_overlap modes")
    p.add_argument("--tune-budget", type=float, default=80, help="seconds of tile tuning (compiles included)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--preset", default="1.4b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--e2e-steps", type=int, default=8)
    p.add_argument("--e2e-warmup", type=int, default=3)
    p.add_argument("--out", default="", help="JSON results (written after every measurement); .md beside it")
    p.add_argument("--watchdog", type=float, default=0, help="dump stacks and exit after this many seconds")
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
                                                     "NVSHMEM_DISABLE_NVLS")}}
    out = Path(args.out) if args.out else None

    def save():
        if out is not None and dist.get_rank() == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))
            out.with_suffix(".md").write_text(markdown(result))

    log(f"{result['device']} x{world}, torch {result['torch']}, triton {triton_version}, env {result['env']}")
    parts = args.part.split(",")
    if "kernels" in parts:
        comms = {}
        for mode in ("none", "async_tp", "fused"):
            attempt(comms, mode, lambda: TPComm(dist.group.WORLD, mode))
        comms = {k: v for k, v in comms.items() if isinstance(v, TPComm)}
        run_kernels(args, comms, world, result, save)
        if not args.e2e_tiles:
            args.e2e_tiles = result.get("best_tiles", "")
    if "e2e" in parts:
        run_e2e(args, world, result, save)
    save()
    log("\n" + markdown(result))
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
