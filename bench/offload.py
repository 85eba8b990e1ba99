"""memory.offload on one GPU: throughput against no offload and FSDP2 CPUOffloadPolicy, and the largest model that
trains under a GPU cap and on the whole machine; and the CPU step's pieces on the host alone.

  (a) --part a   1.4b preset, T=2048: no offload, holotrain offload (each --ratios, each --clips), FSDP2
                 CPUOffloadPolicy, at each --batch (sequences per step, no accumulation unless --micro is smaller).
  (b) --part b   GPU capped at --gpu-gib (torch.cuda.set_per_process_memory_fraction): each --sizes model with
                 offload_ratio 1 at --big-batch sequences, the plan's largest micro-batch first (or, if the batch fits
                 only with an accumulator the host cannot hold, smaller batches without accumulation); the largest
                 model that trains, its MFU.
  (c) --part c   the whole machine: each --sizes model at --c-batch sequences, with the offload_ratio the memory plan
                 chooses (the smallest that fits host and GPU, so the CPU does the least work), raised by 0.05 on a
                 GPU OOM, lowered on a host OOM.
  (cpu) --part cpu  no GPU needed: the engine's host-side loops (landing, accumulation, AdamW update) on torch ops
                 and compiled (one-pass loops on native threads, memory.offload_kernel), in G params/s and ms per
                 1.36B parameters, with host memcpy and torch's fused AdamW as ceilings, a thread sweep and the
                 update under a Python-busy thread (the GIL).

Every trial runs in its own process (an OOM, or a host OOM kill, ends only that trial; a GPU cap holds per process)
and prints one JSON row: tokens/s, MFU, step time, peak GPU memory, host RSS and pinned bytes, phase times
(time.forward/backward/optimizer, time.*offload_wait = exposed offload time), the engine's per-step CPU step,
landing, copy-wait and transfer times and speculated share, the gradient norms against the clip threshold, and
what the host did in the timed steps (busy cores, page faults, involuntary context switches, cgroup throttling).
Rows are appended to --out as they finish, so a part can be run in several commands; `--table` prints the
markdown for bench/RESULTS.md from that file.

  python bench/offload.py --part a --clips 0,1.0 --out /tmp/offload.json
  python bench/offload.py --part b --out /tmp/offload.json
  python bench/offload.py --part c --out /tmp/offload.json
  python bench/offload.py --part cpu --out /tmp/offload.json
  python bench/offload.py --table /tmp/offload.json

Timing: --warmup steps, then --steps steps between two device synchronizations (the engine's CPU work of a step
runs into the next one, so a per-step event pair would not see it); random token batches drawn once; AdamW, bf16,
clipping at --clips (default 1.0). Random tokens keep the gradient norm above 1.0 for the few steps a trial runs,
so at 1.0 every step clips, and after a clipped step the engine cannot speculate: its CPU step waits for the norm
(after backward) and overlaps only the next forward. That is offload's worst case; clipping off (0) shows a run
whose norms stay under the threshold, as they mostly do once training settles. The rows say which (clip, clipped
share, speculated share).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Llama shapes: (dim, n_layers, n_heads, ffn_dim); vocabulary 32000. Sizes between the classic ones repeat a
# classic block shape with more layers.
SHAPES = {
    "tiny": (64, 2, 4, 176),  # CPU smoke test of this script
    "1.4b": (2048, 24, 16, 5632),
    "3b": (3200, 26, 32, 8640),
    "7b": (4096, 32, 32, 11008),
    "8b": (4096, 40, 32, 11008),
    "10b": (4096, 48, 32, 11008),
    "13b": (5120, 40, 40, 13824),
    "14b": (5120, 44, 40, 13824),
    "16b": (5120, 48, 40, 13824),
    "18b": (5120, 56, 40, 13824),
}


# ---------------------------------------------------------------------------------------------
# One trial (in its own process)

OFFLOADS = ("offload", "offload-delayed")  # variants that run the offload engine (the second with the delayed update)


def _config(spec: dict):
    from holotrain.config import load_config, resolve

    dim, layers, heads, ffn = SHAPES[spec["shape"]]
    overrides = [
        f"--model.dim={dim}", f"--model.n_layers={layers}", f"--model.n_heads={heads}", f"--model.n_kv_heads={heads}",
        f"--model.ffn_dim={ffn}", "--model.vocab_size=32000", f"--data.seq_len={spec['seq']}",
        f"--training.batch_size={spec['batch']}", f"--training.micro_batch_size={spec['micro']}",
        f"--training.compile={str(spec['compile']).lower()}", f"--training.grad_clip={spec.get('clip', 1.0)}",
        "--training.lr=3e-4",
        f"--memory.activation_checkpointing={spec['ac']}",
        f"--memory.offload={str(spec['variant'] in OFFLOADS).lower()}",
        f"--memory.offload_delayed_update={str(spec['variant'] == 'offload-delayed').lower()}",
        f"--memory.offload_ratio={spec.get('ratio', 1.0)}", "--memory.check_fit=false",
        *([f"--memory.offload_gil_switch_ms={spec['gil_ms']}"] if spec.get("gil_ms") is not None else []),
        *([f"--memory.offload_threads={spec['offload_threads']}"] if spec.get("offload_threads") else []),
        f"--job.device={spec['device']}",
    ]
    return resolve(load_config(None, overrides), tokenizer_vocab=32000)


def _device(name: str):
    """An indexed device ("cuda" -> cuda:<current>): the trainer's DistEnv devices carry their index too."""
    import torch

    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _pinned_bytes(engine) -> int:
    if engine is None or not engine.cuda:
        return 0
    return sum(b.staging.numel() * b.staging.element_size() for b in engine.buckets) + sum(
        u.data.numel() * u.data.element_size() for u in engine._uploads)


def _host_rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_throttled_s() -> float | None:
    """Seconds this container's CPU quota held it back so far (cgroup v2 throttled_usec, v1 throttled_time)."""
    text = _read("/sys/fs/cgroup/cpu.stat")
    if text:
        for line in text.splitlines():
            if line.startswith("throttled_usec"):
                return int(line.split()[1]) / 1e6
    text = _read("/sys/fs/cgroup/cpu,cpuacct/cpu.stat") or _read("/sys/fs/cgroup/cpu/cpu.stat")
    if text:
        for line in text.splitlines():
            if line.startswith("throttled_time"):
                return int(line.split()[1]) / 1e9
    return None


def _host_counters() -> dict:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu": r.ru_utime + r.ru_stime, "minflt": r.ru_minflt, "majflt": r.ru_majflt, "nivcsw": r.ru_nivcsw,
            "throttled": _cgroup_throttled_s()}


def _host_deltas(a: dict, b: dict, wall: float, steps: int) -> dict:
    """What the host did during the timed steps: busy cores on average (CPU seconds of all this process's threads
    per second), page faults and involuntary context switches (oversubscribed cores) per step, quota throttling."""
    out = {"host_busy_cores": (b["cpu"] - a["cpu"]) / wall, "minflt_per_step": (b["minflt"] - a["minflt"]) / steps,
           "majflt_per_step": (b["majflt"] - a["majflt"]) / steps, "nivcsw_per_step": (b["nivcsw"] - a["nivcsw"]) / steps}
    if a["throttled"] is not None and b["throttled"] is not None:
        out["cgroup_throttled_s_per_step"] = (b["throttled"] - a["throttled"]) / steps
    return out


def host_info() -> dict:
    """The host as the CPU step sees it: cores this process may use, CPU model, the container's CPU quota, NUMA
    nodes, transparent huge pages, load."""
    model = None
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    nodes = _read("/sys/devices/system/node/online")
    return {
        "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": model, "cgroup_cpu_max": _read("/sys/fs/cgroup/cpu.max") or _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
        "numa_nodes": nodes, "thp": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "loadavg": _read("/proc/loadavg"),
    }


def _fsdp2_cpu_offload_step(cfg, device):
    """The peer: holotrain's model under FSDP2 with CPUOffloadPolicy on a one-GPU mesh (per-block fully_shard, bf16
    parameters, fp32 reduction), torch's AdamW over the CPU parameters, clip_grad_norm_."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

    from holotrain.memory import build as build_memory
    from holotrain.model import build
    from holotrain.optim import AdamWHyper, fused_adamw, param_groups
    from holotrain.parallel import DistEnv
    from holotrain.train import model_args

    if not dist.is_initialized():
        backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:29577", rank=0, world_size=1, device_id=device_id)
    mesh = init_device_mesh(device.type, (1,))
    with torch.device("meta"):
        model = build(model_args(cfg))
    build_memory(cfg.memory, DistEnv(rank=0, world_size=1, local_rank=0, device=device)).apply(model)
    if cfg.training.compile:
        model.compile_regions()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # (pinning needs CUDA: the CPU smoke test)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    for module in model.modules():  # rope tables are buffers, not FSDP-managed parameters
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(device)
    lr, hyper = cfg.training.lr, AdamWHyper.from_section(cfg.training)
    try:
        opt = fused_adamw(model.parameters(), lr, hyper)
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(param_groups(model.parameters(), hyper.weight_decay), lr=lr, betas=hyper.betas,
                                eps=hyper.eps)

    def step(fetch, accum):
        total = 0.0
        for m in range(accum):
            model.set_requires_gradient_sync(m == accum - 1)
            loss = model(*fetch(m)) / accum
            loss.backward()
            total = total + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hyper.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total, norm

    return model, step


def run_trial(spec: dict) -> dict:
    import torch

    from holotrain.hw import peak_bf16_flops
    from holotrain.memory import build_optimizer
    from holotrain.model.costs import flops_per_token
    from holotrain.model import num_params
    from holotrain.optim import AdamWHyper
    from holotrain.parallel import DistEnv
    from holotrain.profile import PhaseClock
    from holotrain.train import model_args
    from holotrain.train.trainer import TrainStep, build_model

    device = _device(spec["device"])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        if spec.get("gpu_gib"):
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(spec["gpu_gib"] * 2**30 / total, device)
    cfg = _config(spec)
    dtype = torch.bfloat16 if cuda else torch.float32
    micro, accum = spec["micro"], spec["batch"] // spec["micro"]
    row = {**spec, "accum": accum}
    t0 = time.perf_counter()
    engine = None
    clock = PhaseClock(device)
    if spec["variant"] == "fsdp2-cpu":
        model, peer_step = _fsdp2_cpu_offload_step(cfg, device)

        def one_step(fetch):
            return peer_step(fetch, accum)  # (loss, grad norm)
    else:
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=device)
        model = build_model(cfg, env, dtype)
        opt = build_optimizer(model, cfg.memory, AdamWHyper.from_section(cfg.training), cfg.training.lr, env, dtype)
        engine = opt if spec["variant"] in OFFLOADS else None
        train_step = TrainStep(model, opt, cfg, env, dtype, clock)

        def one_step(fetch):
            return train_step(fetch, accum, cfg.training.lr)  # (loss, grad norm), device tensors

    row["n_params"] = num_params(model)
    row["build_s"] = time.perf_counter() - t0
    gen = torch.Generator(device=device).manual_seed(0)
    batches = []
    for _ in range(max(2, accum)):
        x = torch.randint(0, 32000, (micro, spec["seq"] + 1), device=device, generator=gen)
        batches.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))

    def fetch(m):
        return batches[m % len(batches)]

    def sync():
        if engine is not None:
            engine.synchronize()
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    warm_norms = []
    for _ in range(spec["warmup"]):
        loss, norm = one_step(fetch)
        warm_norms.append(norm)
    sync()
    row["warmup_s"] = time.perf_counter() - t0
    clock.collect(1)
    if engine is not None:
        engine.metrics(1)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    host0 = _host_counters()
    t0 = time.perf_counter()
    norms = []  # device tensors, read after the final synchronization (reading each would add a sync per step)
    for _ in range(spec["steps"]):
        loss, norm = one_step(fetch)
        norms.append(norm)
    sync()
    wall = time.perf_counter() - t0
    step_s = wall / spec["steps"]
    row.update(_host_deltas(host0, _host_counters(), wall, spec["steps"]))
    clip = spec.get("clip", 1.0)
    values = [float(n.full_tensor() if hasattr(n, "full_tensor") else n) for n in norms]  # FSDP2: a DTensor
    row.update({
        "clip": clip, "grad_norm_mean": sum(values) / len(values), "grad_norm_max": max(values),
        "grad_norm_warmup": [round(float(n.full_tensor() if hasattr(n, "full_tensor") else n), 3) for n in warm_norms],
        # Steps whose norm exceeded the threshold: with offload each one is followed by a step that cannot
        # speculate (its CPU step waits for the norm, after backward).
        "clipped": sum(v > clip for v in values) / len(values) if clip > 0 else 0.0,
    })
    if engine is not None:
        row.update({"kernel": engine.kernel, "threads": engine.threads})
    tokens = spec["batch"] * spec["seq"]
    flops = flops_per_token(model_args(cfg), spec["seq"]) * tokens / step_s
    peak = peak_bf16_flops(device) if cuda else None
    row.update({
        "loss": float(loss), "step_s": step_s, "tokens_per_s": tokens / step_s, "tflops": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "peak_gpu_gb": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
        "host_rss_gb": _host_rss_gb(), "pinned_gb": _pinned_bytes(engine) / 1e9,
        **clock.collect(spec["steps"]),
        **(engine.metrics(spec["steps"]) if engine is not None else {}),
    })
    if engine is not None:
        engine.close()
    return row


# ---------------------------------------------------------------------------------------------
# Orchestration


def spawn(spec: dict, timeout: float) -> dict:
    """Runs one trial in a fresh process; an OOM or a kill becomes an `error` row."""
    cmd = [sys.executable, __file__, "--trial", json.dumps(spec)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timeout after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    kind = "host OOM kill" if proc.returncode == -9 else ("GPU OOM" if "OutOfMemoryError" in proc.stderr
                                                           or "out of memory" in proc.stderr else "error")
    return {**spec, "error": f"{kind} (rc {proc.returncode}, {time.time() - t0:.0f} s): " + " | ".join(tail)[-600:]}


def record(row: dict, out: Path, meta: dict) -> None:
    data = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    data.setdefault("meta", meta)
    data["runs"].append(row)
    out.write_text(json.dumps(data, indent=1))
    brief = {k: row.get(k) for k in ("part", "variant", "shape", "batch", "micro", "ratio", "ac", "clip", "clipped",
                                     "grad_norm_mean", "tokens_per_s", "mfu", "step_s", "peak_gpu_gb", "time.offload_wait",
                                     "offload.cpu_step_s", "offload.adamw_s", "offload.land_s", "offload.copy_wait_s",
                                     "offload.speculated", "offload.release_wait_s", "threads", "kernel",
                                     "host_busy_cores", "nivcsw_per_step", "cgroup_throttled_s_per_step",
                                     "case", "gparams_per_s", "error")
             if row.get(k) is not None}
    print(json.dumps(brief), flush=True)


def plan_micro(shape: str, args, ratio: float, gpu_bytes: float | None, ac: str, batch: int) -> list[tuple[int, int]]:
    """(batch, micro) pairs that the memory plan expects to fit, best first: the largest micro-batch dividing the
    batch; if none fits (accumulation costs the host an fp32 accumulator, 4 more bytes per parameter: a 7B then
    needs ~122 GB), smaller batches without accumulation. Never an unplanned micro-batch of 1 (16 micro-batches of
    a 7B per step need more host RAM than the plan allows, and run past a trial's time)."""
    import torch

    from holotrain.memory.plan import plan_memory
    from holotrain.model import build
    from holotrain.train import model_args

    def fits(b, micro):
        spec = {"shape": shape, "seq": args.seq_len, "batch": b, "micro": micro, "compile": not args.eager,
                "ac": ac, "variant": "offload", "ratio": ratio, "device": args.device}
        cfg = _config(spec)
        with torch.device("meta"):
            model = build(model_args(cfg))
        plan = plan_memory(model, cfg, 1, _device(args.device), micro, b // micro, gpu_capacity=gpu_bytes)
        return plan.gpu_fits and plan.host_fits

    out = [(batch, m) for m in (16, 8, 4, 2, 1) if m <= batch and batch % m == 0 and fits(batch, m)]
    out += [(m, m) for m in (16, 8, 4, 2, 1) if m < batch and fits(m, m)]
    return out[:2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["a", "b", "c", "cpu"])
    p.add_argument("--trial", help=argparse.SUPPRESS)
    p.add_argument("--table", help="print the RESULTS.md tables of this JSON file")
    p.add_argument("--write", action="store_true", help="with --table: also append them to bench/RESULTS.md")
    p.add_argument("--out", default="bench/offload.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", default="8,16", help="(a): sequences per step, comma list")
    p.add_argument("--micro", type=int, default=0,
                   help="micro-batch: (a) 0 = the batch (no accumulation); (b)/(c) 0 = chosen with the memory plan")
    p.add_argument("--ratios", default="1.0,0.6", help="(a): holotrain offload ratios")
    p.add_argument("--clips", default="1.0",
                   help="training.grad_clip values (0 = off): (a) one offload trial each (the other variants and (b)/(c) "
                        "take the first). Random tokens keep the norm above 1.0 for these few steps, so 1.0 clips every "
                        "step and the engine never speculates; 0 shows the steady state of a run whose norms stay "
                        "under the threshold")
    p.add_argument("--cpu-params", type=float, default=128e6, help="(cpu): parameters per measurement")
    p.add_argument("--cpu-threads", default="", help="(cpu): thread counts to sweep (default: 1, 2, 4, 8, ... up to "
                                                      "the engine's default)")
    p.add_argument("--cpu-reps", type=int, default=3, help="(cpu): timed repetitions (the best counts)")
    p.add_argument("--variants", default="plain,offload,fsdp2-cpu",
                   help="(a); also offload-delayed (memory.offload_delayed_update)")
    p.add_argument("--offload-threads", default="",
                   help="(b): memory.offload_threads values to try, comma list (default: the config's)")
    p.add_argument("--gil-switch-ms", default="",
                   help="(a)/(b): memory.offload_gil_switch_ms values to try, comma list (default: the config's)")
    p.add_argument("--sizes", default="", help="(b)/(c): shapes, smallest first (default 3b,7b,8b,10b / 13b,14b,16b)")
    p.add_argument("--gpu-gib", type=float, default=24.0, help="(b): GPU cap")
    p.add_argument("--delayed", action="store_true", help="(b)/(c): with memory.offload_delayed_update")
    p.add_argument("--ac", default="full", help="(b)/(c): activation checkpointing policy")
    p.add_argument("--big-batch", type=int, default=16, help="(b): sequences per step")
    p.add_argument("--c-batch", type=int, default=4, help="(c): sequences per step")
    p.add_argument("--shape", default="1.4b", help="(a): model shape")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--eager", action="store_true", help="no torch.compile")
    p.add_argument("--timeout", type=float, default=570, help="seconds per trial (one trial per process)")
    args = p.parse_args()

    if args.trial:
        print("RESULT " + json.dumps(run_trial(json.loads(args.trial))), flush=True)
        return
    if args.table:
        text = tables(json.loads(Path(args.table).read_text()))
        print(text)
        if args.write:
            results = Path(__file__).resolve().parent / "RESULTS.md"
            with open(results, "a") as f:
                f.write("\n" + text + "\n")
        return
    if not args.part:
        raise SystemExit("choose --part a|b|c|cpu, or --table FILE")
    import torch

    out = Path(args.out)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
            "device": _device_name(args.device), "host_cores": os.cpu_count(), "host": host_info()}
    print("host: " + json.dumps(meta["host"]), flush=True)
    if args.part == "cpu":
        cpu_part(args, out, meta)
        return
    common = {"device": args.device, "seq": args.seq_len, "compile": not args.eager, "steps": args.steps,
              "warmup": args.warmup}
    clips = [float(c) for c in args.clips.split(",")]
    common_b = {**common, "clip": clips[0]}
    gils = [float(g) for g in args.gil_switch_ms.split(",")] if args.gil_switch_ms else [None]
    thread_counts = [int(t) for t in args.offload_threads.split(",")] if args.offload_threads else [None]
    offload_variant = "offload-delayed" if args.delayed else "offload"

    if args.part == "a":
        for batch in [int(b) for b in args.batch.split(",")]:
            micro = args.micro or batch
            for variant in args.variants.split(","):
                ratios = [float(r) for r in args.ratios.split(",")] if variant in OFFLOADS else [None]
                for ratio in ratios:
                    for clip in (clips if variant in OFFLOADS else clips[:1]):
                        for gil in (gils if variant in OFFLOADS else [None]):
                            spec = {**common, "part": "a", "variant": variant, "shape": args.shape, "batch": batch,
                                    "micro": micro, "ac": "none", "clip": clip, "gil_ms": gil,
                                    **({"ratio": ratio} if ratio is not None else {})}
                            record(spawn(spec, args.timeout), out, meta)

    elif args.part == "b":
        sizes = (args.sizes or "3b,7b,8b,10b").split(",")
        gpu_bytes = args.gpu_gib * 2**30 * 0.95
        for shape in sizes:
            trained = False
            layouts = ([(args.big_batch, args.micro)] if args.micro else
                       plan_micro(shape, args, 1.0, gpu_bytes, args.ac, args.big_batch))
            if args.delayed:  # one micro-batch per step on one process
                layouts = [(batch, micro) for batch, micro in layouts if batch == micro]
            if not layouts:
                print(f"(b): the memory plan fits no micro-batch of {shape} under {args.gpu_gib:g} GiB; stopping", flush=True)
                break
            for batch, micro in layouts:
                for gil, threads in [(g, t) for g in gils for t in thread_counts]:
                    spec = {**common_b, "part": "b", "variant": offload_variant, "shape": shape, "batch": batch,
                            "micro": micro, "ratio": 1.0, "ac": args.ac, "gpu_gib": args.gpu_gib, "gil_ms": gil,
                            "offload_threads": threads}
                    row = spawn(spec, args.timeout)
                    record(row, out, meta)
                    trained = trained or "error" not in row
                if trained:
                    break
            if not trained:
                print(f"(b): {shape} does not train under {args.gpu_gib:g} GiB; stopping", flush=True)
                break

    else:
        sizes = (args.sizes or "13b,14b,16b").split(",")
        batch = args.c_batch
        for shape in sizes:
            # No accumulation if the plan allows (an fp32 accumulator would cost the host 4 more bytes per
            # parameter); the smallest ratio that fits, so the CPU does the least work.
            micro, r = batch, None
            for micro in [m for m in (16, 8, 4, 2, 1) if m <= batch and batch % m == 0]:
                if args.micro and micro != args.micro:
                    continue
                r = auto_ratio(shape, args, batch, micro)
                if r is not None:
                    break
            if r is None:
                print(f"(c): the memory plan finds no offload_ratio for {shape}; trying 0.5", flush=True)
                r = 0.5
            tried, trained = set(), False
            while r not in tried and 0 <= r <= 1 and len(tried) < 4:
                tried.add(r)
                spec = {**common_b, "part": "c", "variant": offload_variant, "shape": shape, "batch": batch, "micro": micro,
                        "ratio": r, "ac": args.ac}
                row = spawn(spec, args.timeout)
                record(row, out, meta)
                if "error" not in row:
                    trained = True
                    break
                # A GPU OOM wants more on the CPU; a host OOM (kill) wants less.
                r = round(r + 0.05, 2) if "GPU OOM" in row["error"] else round(r - 0.05, 2)
            if not trained:
                print(f"(c): {shape} does not train on this machine; stopping", flush=True)
                break


def cpu_part(args, out: Path, meta: dict) -> None:
    """(cpu) The CPU step's pieces on this host, no GPU needed: G params/s and ms per 1.36B parameters (the 1.4b
    model), each timed in a thread other than the main one, as the engine's worker runs them, the best of
    --cpu-reps. "before" is the plain torch-op baseline (per-chunk vector_norm at landing, three passes per update
    chunk on the worker's intra-op pool), "after" what the engine runs (the norm comes from the GPU with one landing
    per step; the compiled one-pass loops on native threads). Also: a thread sweep, host memcpy and torch's fused AdamW
    on fp32 gradients (what `holotrain hw probe` measures, on a few parameters that may sit in cache), and the
    update while another thread runs Python (the GIL: a compiled model's launching thread)."""
    import threading

    import torch

    from holotrain.memory import offload as off
    from holotrain.memory.offload.host import host_empty, pinned_empty, unregister

    n = int(args.cpu_params) // 64 * 64
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    default = max(1, cores - 1)  # the engine's default memory.offload_threads on one GPU
    sweep = ([int(t) for t in args.cpu_threads.split(",")] if args.cpu_threads else
             sorted({t for t in (1, 2, 4, 8, 12, default) if t <= default}))
    top = max(sweep)  # the thread count of the single-configuration cases (the engine's default unless swept)
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    m, v, acc = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    g16 = torch.randn(n, generator=gen).mul_(1e-3).to(torch.bfloat16)
    up = torch.zeros(n, dtype=torch.bfloat16)
    scratch = torch.empty(min(off.CHUNK, n))
    t0 = time.perf_counter()
    kernels = off.cpu_kernels("auto")
    compile_s = time.perf_counter() - t0
    print(f"(cpu): {n / 1e6:.0f}M parameters per measurement, {cores} cores, engine default {default} threads, "
          f"single-configuration cases on {top}, "
          f"compiled loops: {'yes' if kernels else 'NO (torch ops)'} ({compile_s:.1f} s)", flush=True)
    hp = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-8, "t": 10}

    def timed(fn, torch_threads: int, busy: bool = False, switch_ms: float | None = None) -> float:
        box = {}
        stop = threading.Event()
        interval = sys.getswitchinterval()
        if switch_ms is not None:
            sys.setswitchinterval(switch_ms / 1000)

        def python_busy():
            while not stop.is_set():
                sum(range(1000))

        def body():
            torch.set_num_threads(torch_threads)  # this thread's intra-op pool, as the engine's worker sets it
            fn()
            best = math.inf
            for _ in range(args.cpu_reps):
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            box["s"] = best

        other = threading.Thread(target=python_busy, daemon=True) if busy else None
        if other:
            other.start()
        th = threading.Thread(target=body)
        th.start()
        th.join()
        stop.set()
        if other:
            other.join()
        sys.setswitchinterval(interval)
        return box["s"]

    def emit(case: str, threads: int, seconds: float, **extra):
        row = {"part": "cpu", "case": case, "threads": threads, "params": n, "s": seconds,
               "gparams_per_s": n / seconds / 1e9, "ms_per_1.36b": 1.36e9 / (n / seconds) * 1e3, **extra}
        record(row, out, meta)

    # Before: the engine's landing (one landing per step) and its three-pass torch-op update.
    def land_before():
        sq = 0.0
        for lo in range(0, n, off.CHUNK):
            sq += torch.linalg.vector_norm(g16[lo:lo + off.CHUNK], dtype=torch.float32).item() ** 2

    def accumulate_before():  # the last micro-batch: a whole-bucket mixed-dtype add (an fp32 temporary), then norms
        acc.add_(g16)
        sq = 0.0
        for lo in range(0, n, off.CHUNK):
            sq += torch.linalg.vector_norm(acc[lo:lo + off.CHUNK], dtype=torch.float32).item() ** 2

    def update_torch():
        off.adamw_flat(master, m, v, g16, up, **hp, kernels=None, scratch=scratch)

    # The engine's masters and moments on 2 MiB pages (advised before first touch), against the 4 KiB-page buffers.
    huge = [host_empty(n, torch.float32) for _ in range(3)]
    huge[0].copy_(master)
    huge[1].zero_()
    huge[2].zero_()
    def python_thread_slices(threads: int):
        """The update on a pool of Python threads instead of the extension's native ones: two slices per thread,
        every slice a single-threaded call that needs the GIL back when it returns (a Python-busy training thread
        holds it for up to the 5 ms switch interval each time)."""
        fn = kernels.module.adamw
        b1, b2, t = hp["betas"][0], hp["betas"][1], hp["t"]
        consts = (1 - hp["lr"] * hp["weight_decay"], 1 - b1, b2, 1 - b2, hp["lr"] / (1 - b1 ** t),
                  math.sqrt(1 - b2 ** t), hp["eps"], 1.0)
        count = 2 * threads
        bounds = [n * k // count // 64 * 64 for k in range(count)] + [n]
        order = iter(range(count))

        def drain():
            for k in order:
                lo, hi = bounds[k], bounds[k + 1]
                fn(master[lo:hi], m[lo:hi], v[lo:hi], g16[lo:hi], up[lo:hi], *consts, 1)

        helpers = [threading.Thread(target=drain) for _ in range(threads - 1)]
        for h in helpers:
            h.start()
        drain()
        for h in helpers:
            h.join()

    def buckets_with_upload_calls(threads: int):
        """The worker's pattern per bucket: the native update (GIL released), then the Python and torch calls that
        queue the bucket's upload, each a point where it must take the GIL back from the training thread."""
        for lo in range(0, n, n // 16 // 64 * 64):
            hi = min(n, lo + n // 16 // 64 * 64)
            off.adamw_flat(master[lo:hi], m[lo:hi], v[lo:hi], g16[lo:hi], up[lo:hi], **hp, kernels=kernels,
                           threads=threads)
            for _ in range(12):
                up[lo:lo + 1].zero_()

    emit("memcpy fp32 (GB/s = 8 bytes/param x this)", top, timed(lambda: acc.copy_(master), top))
    emit("torch fused AdamW, fp32 grads (hw probe)", top,
         timed(lambda: torch._fused_adamw_([master], [acc], [m], [v], [], [torch.tensor(10.0)], lr=1e-4, beta1=0.9,
                                           beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
                                           grad_scale=None, found_inf=None), top))
    emit("land before: vector_norm(bf16->fp32) per chunk", top, timed(land_before, top))
    emit("accumulate+norm before: add_(bf16) + vector_norm", top, timed(accumulate_before, top))
    emit("update before: torch ops, 3 passes per chunk", top, timed(update_torch, top))
    emit("update before, a Python-busy thread", top, timed(update_torch, top, busy=True))
    if kernels is None:
        return
    for threads in sweep:
        emit("update after: compiled, one pass", threads,
             timed(lambda k=threads: off.adamw_flat(master, m, v, g16, up, **hp, kernels=kernels, threads=k), 1))
        if threads == top:
            emit("update after, a Python-busy thread", threads,
                 timed(lambda k=threads: off.adamw_flat(master, m, v, g16, up, **hp, kernels=kernels, threads=k), 1,
                       busy=True))
            emit("update on Python threads, one native call per slice, a Python-busy thread",
                 threads, timed(lambda k=threads: python_thread_slices(k), 1, busy=True))
            for gil_ms in (5.0, 0.25):  # Python's default switch interval, and memory.offload_gil_switch_ms's
                emit(f"update in 16 buckets, each with the upload's 12 torch calls, a Python-busy thread, GIL switch "
                     f"{gil_ms:g} ms", threads, timed(lambda k=threads: buckets_with_upload_calls(k), 1, busy=True,
                                                      switch_ms=gil_ms))
            emit("update after, masters and moments on huge pages", threads,
                 timed(lambda k=threads: off.adamw_flat(*huge, g16, up, **hp, kernels=kernels, threads=k), 1))
            emit("accumulate+norm after: compiled, one pass", threads,
                 timed(lambda k=threads: off.accumulate_flat(acc, g16, False, kernels=kernels, threads=k), 1))
            if torch.cuda.is_available():  # the engine's staging and upload buffers are page-locked host memory
                g_locked, up_locked = pinned_empty(n, torch.bfloat16), pinned_empty(n, torch.bfloat16)
                g_locked.copy_(g16)
                up_locked.zero_()
                emit("update after, gradient + upload page-locked", threads,
                     timed(lambda k=threads, g=g_locked, o=up_locked: off.adamw_flat(master, m, v, g, o, **hp,
                                                                                      kernels=kernels, threads=k), 1))
                for t in (g_locked, up_locked):
                    unregister(t)


def _device_name(device: str) -> str:
    """The GPU's name without creating a CUDA context in this process (NVML), else the device type."""
    if device != "cuda":
        return device
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else name
    except Exception:  # noqa: BLE001
        return "cuda"


def gpu_free_bytes(args) -> float | None:
    """Free GPU memory as a trial will find it, read through NVML so that this process creates no CUDA context
    (which would hold memory the trials need); the trial's own context (about 1 GB) is taken off."""
    if args.device != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
        free = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free
    except Exception:  # noqa: BLE001 - no NVML: ask CUDA (this process then holds a context)
        import torch

        free = torch.cuda.mem_get_info()[0]
    return (free - 2**30) * 0.95


def auto_ratio(shape: str, args, batch: int, micro: int) -> float | None:
    """What memory.offload_ratio = "auto" picks on this machine (the smallest ratio the memory plan fits), or None."""
    import torch

    from holotrain.config import ConfigError
    from holotrain.memory.plan import choose_offload_ratio
    from holotrain.model import build
    from holotrain.train import model_args

    spec = {"shape": shape, "seq": args.seq_len, "batch": batch, "micro": micro, "compile": True, "ac": args.ac,
            "variant": "offload", "device": args.device}
    cfg = _config(spec)
    with torch.device("meta"):
        model = build(model_args(cfg))
    try:
        return choose_offload_ratio(model, cfg, 1, _device(args.device), micro, batch // micro,
                                    gpu_capacity=gpu_free_bytes(args))
    except ConfigError:
        return None


# ---------------------------------------------------------------------------------------------
# Tables


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def _exposed(r: dict) -> float | None:
    """time.offload_wait in all its places: since the phase clock names nested phases after their parent, the
    forward's gates are time.forward.offload_wait, and the wait after backward is time.offload_wait."""
    keys = [k for k in r if k.startswith("time.") and k.endswith("offload_wait")]
    return sum(r[k] for k in keys) if keys else None


def tables(data: dict) -> str:
    """The RESULTS.md section of a results file: one row per trial, then the (a) ratios, then the (cpu) table."""
    meta, runs = data.get("meta", {}), data["runs"]
    host = meta.get("host") or {}
    lines = [f"## memory.offload on one GPU ({meta.get('date')})", "",
             f"- Device: {meta.get('device')}, torch {meta.get('torch')}, {meta.get('host_cores')} host cores"
             + (f" ({host.get('cpu_model')}, CPU quota {host.get('cgroup_cpu_max')}, NUMA nodes {host.get('numa_nodes')})"
                if host else "") + ".",
             f"- Command: `{meta.get('command')}` (then the other parts into the same file; `--table`).",
             ("- Exposed = time.offload_wait (GPU stalled on the CPU engine); CPU step, landing: the worker's busy time "
              "per step (copy wait: blocked on copies, i.e. on the GPU); D2H, H2D: GPU time of the copies (on side "
              "streams, overlapped unless exposed says otherwise). Clip: training.grad_clip (0 = off) and the share of "
              "timed steps whose norm exceeded it (random tokens: above 1.0 for these few steps, so every step clips "
              "and none can speculate); spec: share of steps that speculated. Busy cores: the process's CPU seconds "
              "per second."), ""]
    head = ("| part | variant | model | params | batch (micro) | ratio | AC | clip (clipped %) | tokens/s | MFU % | "
            "step ms | peak GPU GB | host RSS GB | pinned GB | exposed ms | CPU step ms | AdamW ms | landing ms | "
            "copy wait ms | D2H ms | H2D ms | spec % | CPU loops | busy cores |")
    trials = [r for r in runs if r.get("part") != "cpu"]
    if trials:
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in trials:
        if r.get("gil_ms") is not None:  # a memory.offload_gil_switch_ms sweep: the value beside the variant
            r = {**r, "variant": f"{r['variant']} (GIL {r['gil_ms']:g} ms)"}
        if r.get("offload_threads"):  # a memory.offload_threads sweep
            r = {**r, "variant": f"{r['variant']} ({r['offload_threads']} threads)"}
        clip = r.get("clip", 1.0)
        clip_s = f"{clip:g} ({_f(r.get('clipped') and r['clipped'] * 100, '.0f')})" if "clipped" in r else f"{clip:g}"
        if "error" in r:
            lines.append(f"| {r.get('part')} | {r['variant']} | {r['shape']} | - | {r['batch']} ({r['micro']}) | "
                         f"{r.get('ratio', '-')} | {r.get('ac')} | {clip_s} | failed: {r['error'][:100]} |" + " |" * 15)
            continue

        def ms(key, r=r):
            return _f(r[key] * 1000 if r.get(key) is not None else None, ".0f")

        exposed = _exposed(r)
        spec = r.get("offload.speculated")
        lines.append(
            f"| {r['part']} | {r['variant']} | {r['shape']} | {r['n_params'] / 1e9:.2f}B | {r['batch']} ({r['micro']}) | "
            f"{r.get('ratio', '-')} | {r['ac']} | {clip_s} | {r['tokens_per_s']:,.0f} | "
            f"{_f(r['mfu'] and r['mfu'] * 100, '.1f')} | {r['step_s'] * 1000:.0f} | {_f(r['peak_gpu_gb'], '.1f')} | "
            f"{r['host_rss_gb']:.1f} | {r['pinned_gb']:.1f} | {_f(exposed and exposed * 1000, '.0f')} | "
            f"{ms('offload.cpu_step_s')} | {ms('offload.adamw_s')} | {ms('offload.land_s')} | "
            f"{ms('offload.copy_wait_s')} | {ms('offload.d2h_s')} | "
            f"{ms('offload.h2d_s')} | {_f(spec if spec is None else spec * 100, '.0f')} | {r.get('kernel', '-')} | "
            f"{_f(r.get('host_busy_cores'), '.1f')} |")
    plain = {r["batch"]: r["tokens_per_s"] for r in trials if r.get("part") == "a" and r["variant"] == "plain"
             and "error" not in r}
    ratios = [f"- (a) {r['variant']}{' ratio ' + str(r['ratio']) if 'ratio' in r else ''}, clip {r.get('clip', 1.0):g}, "
              f"B={r['batch']}: {r['tokens_per_s'] / plain[r['batch']]:.2f}x of no offload"
              for r in trials if r.get("part") == "a" and r["variant"] != "plain" and "error" not in r
              and r["batch"] in plain]
    lines += [""] + ratios if ratios else []
    cpu = [r for r in runs if r.get("part") == "cpu"]
    if cpu:
        lines += ["", (f"(cpu) The CPU step's pieces on this host ({cpu[0]['params'] / 1e6:.0f}M parameters per "
                       "measurement, best of the repetitions, in a non-main thread as the engine's worker):"), "",
                  "| case | threads | G params/s | ms per 1.36B params |", "|---|---|---|---|"]
        for r in cpu:
            lines.append(f"| {r['case']} | {r['threads']} | {r['gparams_per_s']:.2f} | {r['ms_per_1.36b']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
