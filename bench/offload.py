"""memory.offload on one GPU: throughput against no offload and FSDP2 CPUOffloadPolicy, and the largest model that
trains under a GPU cap and on the whole machine.

  (a) --part a   1.4b preset, T=2048: no offload, holotrain offload (each --ratios), FSDP2 CPUOffloadPolicy,
                 at each --batch (sequences per step, no accumulation unless --micro is smaller).
  (b) --part b   GPU capped at --gpu-gib (torch.cuda.set_per_process_memory_fraction): each --sizes model with
                 offload_ratio 1, trying micro-batches from the plan's largest down; the largest that trains, its MFU.
  (c) --part c   the whole machine: each --sizes model at --c-batch sequences, with the offload_ratio the memory plan
                 chooses (the smallest that fits host and GPU, so the CPU does the least work), raised by 0.05 on a
                 GPU OOM, lowered on a host OOM.

Every trial runs in its own process (an OOM, or a host OOM kill, ends only that trial; a GPU cap holds per process)
and prints one JSON row: tokens/s, MFU, step time, peak GPU memory, host RSS and pinned bytes, phase times
(time.forward/backward/optimizer, time.offload_wait = exposed offload time) and the engine's per-step CPU step,
landing and transfer times. Rows are appended to --out as they finish, so a part can be run in several commands;
`--table` prints the markdown for bench/RESULTS.md from that file.

  python bench/offload.py --part a --out /tmp/offload.json
  python bench/offload.py --part b --out /tmp/offload.json
  python bench/offload.py --part c --out /tmp/offload.json
  python bench/offload.py --table /tmp/offload.json

Timing: --warmup steps, then --steps steps between two device synchronizations (the engine's CPU work of a step
runs into the next one, so a per-step event pair would not see it); random token batches drawn once; AdamW,
clipping at 1.0, bf16.
"""

from __future__ import annotations

import argparse
import datetime
import json
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


def _config(spec: dict):
    from holotrain.config import load_config, resolve

    dim, layers, heads, ffn = SHAPES[spec["shape"]]
    overrides = [
        f"--model.dim={dim}", f"--model.n_layers={layers}", f"--model.n_heads={heads}", f"--model.n_kv_heads={heads}",
        f"--model.ffn_dim={ffn}", "--model.vocab_size=32000", f"--data.seq_len={spec['seq']}",
        f"--training.batch_size={spec['batch']}", f"--training.micro_batch_size={spec['micro']}",
        f"--training.compile={str(spec['compile']).lower()}", "--training.grad_clip=1.0", "--training.lr=3e-4",
        f"--memory.activation_checkpointing={spec['ac']}", f"--memory.offload={str(spec['variant'] == 'offload').lower()}",
        f"--memory.offload_ratio={spec.get('ratio', 1.0)}", "--memory.check_fit=false",
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

    from holotrain.memory import apply_activation_checkpointing
    from holotrain.model import Llama
    from holotrain.train.trainer import model_args

    if not dist.is_initialized():
        backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:29577", rank=0, world_size=1, device_id=device_id)
    mesh = init_device_mesh(device.type, (1,))
    with torch.device("meta"):
        model = Llama(model_args(cfg))
    if cfg.memory.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.memory.activation_checkpointing)
    if cfg.training.compile:
        for block in model.layers.values():
            block.compile()
        model.loss = torch.compile(model.loss)
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
    t = cfg.training
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                                fused=True)
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)

    def step(fetch, accum):
        total = 0.0
        for m in range(accum):
            model.set_requires_gradient_sync(m == accum - 1)
            loss = model(*fetch(m)) / accum
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return model, step


def run_trial(spec: dict) -> dict:
    import torch

    from holotrain.hw import peak_bf16_flops
    from holotrain.model import flops_per_token, num_params
    from holotrain.parallel import DistEnv
    from holotrain.profile import PhaseClock
    from holotrain.train.trainer import (
        TrainStep,
        build_model,
        build_optimizer,
        model_args,
    )

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
            return peer_step(fetch, accum)
    else:
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=device)
        model = build_model(cfg, env, dtype)
        opt = build_optimizer(model, cfg, env, dtype)
        engine = opt if spec["variant"] == "offload" else None
        train_step = TrainStep(model, opt, cfg, env, dtype, clock)

        def one_step(fetch):
            return train_step(fetch, accum, cfg.training.lr)[0]

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
    for _ in range(spec["warmup"]):
        loss = one_step(fetch)
    sync()
    row["warmup_s"] = time.perf_counter() - t0
    clock.collect(1)
    if engine is not None:
        engine.metrics(1)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(spec["steps"]):
        loss = one_step(fetch)
    sync()
    step_s = (time.perf_counter() - t0) / spec["steps"]
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
    brief = {k: row.get(k) for k in ("part", "variant", "shape", "batch", "micro", "ratio", "ac", "tokens_per_s", "mfu",
                                     "step_s", "peak_gpu_gb", "time.offload_wait", "offload.cpu_step_s", "error")}
    print(json.dumps(brief), flush=True)


def plan_micro(shape: str, args, ratio: float, gpu_bytes: float | None, ac: str, batch: int) -> list[int]:
    """Micro-batches (largest first, dividing the batch) that the memory plan expects to fit."""
    import torch

    from holotrain.memory.plan import plan_memory
    from holotrain.model import Llama
    from holotrain.train.trainer import model_args

    out = []
    for micro in (16, 8, 4, 2, 1):
        if micro > batch or batch % micro:
            continue
        spec = {"shape": shape, "seq": args.seq_len, "batch": batch, "micro": micro, "compile": not args.eager,
                "ac": ac, "variant": "offload", "ratio": ratio, "device": args.device}
        cfg = _config(spec)
        with torch.device("meta"):
            model = Llama(model_args(cfg))
        plan = plan_memory(model, cfg, 1, _device(args.device), micro, batch // micro, gpu_capacity=gpu_bytes)
        if plan.gpu_fits and plan.host_fits:
            out.append(micro)
    return out or [1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["a", "b", "c"])
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
    p.add_argument("--variants", default="plain,offload,fsdp2-cpu", help="(a)")
    p.add_argument("--sizes", default="", help="(b)/(c): shapes, smallest first (default 3b,7b,8b,10b / 13b,14b,16b)")
    p.add_argument("--gpu-gib", type=float, default=24.0, help="(b): GPU cap")
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
        raise SystemExit("choose --part a|b|c, or --table FILE")
    import torch

    out = Path(args.out)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
            "device": _device_name(args.device), "host_cores": os.cpu_count()}
    common = {"device": args.device, "seq": args.seq_len, "compile": not args.eager, "steps": args.steps,
              "warmup": args.warmup}

    if args.part == "a":
        for batch in [int(b) for b in args.batch.split(",")]:
            micro = args.micro or batch
            for variant in args.variants.split(","):
                ratios = [float(r) for r in args.ratios.split(",")] if variant == "offload" else [None]
                for ratio in ratios:
                    spec = {**common, "part": "a", "variant": variant, "shape": args.shape, "batch": batch,
                            "micro": micro, "ac": "none", **({"ratio": ratio} if ratio is not None else {})}
                    record(spawn(spec, args.timeout), out, meta)

    elif args.part == "b":
        sizes = (args.sizes or "3b,7b,8b,10b").split(",")
        gpu_bytes = args.gpu_gib * 2**30 * 0.95
        for shape in sizes:
            trained = False
            micros = [args.micro] if args.micro else plan_micro(shape, args, 1.0, gpu_bytes, args.ac, args.big_batch)
            for micro in micros:
                spec = {**common, "part": "b", "variant": "offload", "shape": shape, "batch": args.big_batch,
                        "micro": micro, "ratio": 1.0, "ac": args.ac, "gpu_gib": args.gpu_gib}
                row = spawn(spec, args.timeout)
                record(row, out, meta)
                if "error" not in row:
                    trained = True
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
            micro, ratios = batch, []
            for micro in [m for m in (16, 8, 4, 2, 1) if m <= batch and batch % m == 0]:
                if args.micro and micro != args.micro:
                    continue
                ratios = fitting_ratios(shape, args, batch, micro)
                if ratios:
                    break
            if not ratios:
                print(f"(c): the memory plan finds no offload_ratio for {shape}; trying 0.5", flush=True)
                ratios = [0.5]
            r = min(ratios)
            tried, trained = set(), False
            while r not in tried and 0 <= r <= 1 and len(tried) < 4:
                tried.add(r)
                spec = {**common, "part": "c", "variant": "offload", "shape": shape, "batch": batch, "micro": micro,
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


def fitting_ratios(shape: str, args, batch: int, micro: int) -> list[float]:
    """The offload ratios (in steps of 0.01) for which the memory plan fits this machine."""
    import torch

    from holotrain.memory.plan import plan_memory
    from holotrain.model import Llama
    from holotrain.train.trainer import model_args

    spec = {"shape": shape, "seq": args.seq_len, "batch": batch, "micro": micro, "compile": True, "ac": args.ac,
            "variant": "offload", "device": args.device}
    cfg = _config(spec)
    with torch.device("meta"):
        model = Llama(model_args(cfg))
    out = []
    for i in range(101):
        plan = plan_memory(model, cfg, 1, _device(args.device), micro, batch // micro, ratio=i / 100,
                           gpu_capacity=gpu_free_bytes(args))
        if plan.gpu_fits and plan.host_fits:
            out.append(i / 100)
    return out


# ---------------------------------------------------------------------------------------------
# Tables


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def tables(data: dict) -> str:
    """The RESULTS.md section of a results file: one row per trial, then the (a) ratios."""
    meta, runs = data.get("meta", {}), data["runs"]
    lines = [f"## memory.offload on one GPU ({meta.get('date')})", "",
             f"- Device: {meta.get('device')}, torch {meta.get('torch')}, {meta.get('host_cores')} host cores.",
             f"- Command: `{meta.get('command')}` (then the other parts into the same file; `--table`).",
             ("- Exposed = time.offload_wait (GPU stalled on the CPU engine); CPU step, landing: the worker's time per "
              "step; D2H, H2D: GPU time of the copies (on side streams, overlapped unless exposed says otherwise)."), ""]
    head = ("| part | variant | model | params | batch (micro) | ratio | AC | tokens/s | MFU % | step ms | peak GPU GB | "
            "host RSS GB | pinned GB | exposed ms | CPU step ms | landing ms | D2H ms | H2D ms |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r.get('part')} | {r['variant']} | {r['shape']} | - | {r['batch']} ({r['micro']}) | "
                         f"{r.get('ratio', '-')} | {r.get('ac')} | failed: {r['error'][:100]} |" + " |" * 10)
            continue

        def ms(key, r=r):
            return _f(r[key] * 1000 if r.get(key) is not None else None, ".0f")

        lines.append(
            f"| {r['part']} | {r['variant']} | {r['shape']} | {r['n_params'] / 1e9:.2f}B | {r['batch']} ({r['micro']}) | "
            f"{r.get('ratio', '-')} | {r['ac']} | {r['tokens_per_s']:,.0f} | {_f(r['mfu'] and r['mfu'] * 100, '.1f')} | "
            f"{r['step_s'] * 1000:.0f} | {_f(r['peak_gpu_gb'], '.1f')} | {r['host_rss_gb']:.1f} | {r['pinned_gb']:.1f} | "
            f"{ms('time.offload_wait')} | {ms('offload.cpu_step_s')} | {ms('offload.land_s')} | {ms('offload.d2h_s')} | "
            f"{ms('offload.h2d_s')} |")
    plain = {r["batch"]: r["tokens_per_s"] for r in runs if r.get("part") == "a" and r["variant"] == "plain"
             and "error" not in r}
    ratios = [f"- (a) {r['variant']}{' ratio ' + str(r['ratio']) if 'ratio' in r else ''}, B={r['batch']}: "
              f"{r['tokens_per_s'] / plain[r['batch']]:.2f}x of no offload"
              for r in runs if r.get("part") == "a" and r["variant"] != "plain" and "error" not in r and r["batch"] in plain]
    return "\n".join(lines + ([""] + ratios if ratios else []))


if __name__ == "__main__":
    main()
