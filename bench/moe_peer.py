"""The peer of holotrain's mixture-of-experts run: Hugging Face Transformers' Qwen3MoeForCausalLM of the same shape,
depth and batch (built from the holotrain config through model/hf.py, random init), trained as a competent user runs
it: torch.compile on the model, sdpa attention, fused AdamW, gradient clipping at 1.0, gradient accumulation to the
same global batch, per-block activation checkpointing only where it does not fit otherwise, and the experts
implementation given (transformers 5's `experts_implementation`: "grouped_mm", the default, sorts the token copies
by expert and runs torch's grouped GEMM; "eager" loops over the experts; "batched_mm" gathers every copy's weights,
far beyond one GPU's memory at this shape).

Precision: "autocast" keeps fp32 weights (and AdamW state) under bf16 autocast, holotrain's numerics; "bf16" holds
the weights and AdamW state in bf16 (half the memory, and under torch.compile the only dtype transformers runs
grouped_mm in: with fp32 weights it falls back to a loop over the experts).

Random tokens of the batch's shape; warm-up steps (compilation), then the median of timed steps gives tokens/s, and
TFLOP/s and MFU by active parameters with holotrain.model.costs.flops_per_token of the same ModelArgs (the router,
the k routed experts, attention over the full square): both sides count the same FLOPs. Also the peak memory.

  python bench/moe_peer.py --config qwen3-30b-a3b --experts grouped_mm --precision bf16 --out peer.json
  python bench/moe_peer.py --tiny                 # a tiny shape on the CPU (a smoke test)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import batch_layout, load_config, resolve
from holotrain.hw import peak_bf16_flops
from holotrain.model import model_args
from holotrain.model.costs import flops_per_token, model_params
from holotrain.model.hf import hf_config_dict

TINY = ["--model.family=qwen3_moe", "--model.preset=tiny", "--data.seq_len=64", "--training.batch_size=4",
        "--training.micro_batch_size=2"]


def shape(args):
    """The holotrain config's ModelArgs, sequence length, global batch and micro-batch (the tokenizer's vocabulary
    as `holotrain train` would have it: 32000, or 512 for --tiny; the presets with their own keep theirs)."""
    overrides = list(TINY if args.tiny else [])
    if args.layers:
        overrides.append(f"--model.n_layers={args.layers}")
    if args.seq_len:
        overrides.append(f"--data.seq_len={args.seq_len}")
    if args.batch:
        overrides.append(f"--training.batch_size={args.batch}")
    cfg = resolve(load_config(None if args.tiny else args.config, overrides),
                  tokenizer_vocab=512 if args.tiny else 32000)
    micro, _ = batch_layout(cfg, 1)
    return model_args(cfg.model), cfg.data.seq_len, cfg.training.batch_size, micro


def build(a, impl: str, precision: str, checkpoint: bool, compile_model: bool, device):
    """(model, the forward to call, optimizer) of transformers' Qwen3-MoE of these ModelArgs."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**hf_config_dict(a))
    config._attn_implementation = "sdpa"
    config._experts_implementation = impl
    config.use_cache = False
    with torch.device(device):  # initialized where it trains: no host copy of the weights
        model = Qwen3MoeForCausalLM(config)
    got = getattr(model.config, "_experts_implementation", None)
    if got != impl:
        raise SystemExit(f"transformers chose experts implementation {got!r} for {impl!r}")
    if precision == "bf16":
        model.to(torch.bfloat16)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    return model, torch.compile(model) if compile_model else model, opt


def make_step(model, fwd, opt, precision: str, device):
    def step(micros):
        total = 0.0
        for x in micros:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "autocast"):
                loss = fwd(input_ids=x, labels=x).loss / len(micros)
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total  # the step's mean loss

    return step


def timed(step, batches, n: int, device) -> list[float]:
    """Seconds of n steps, each by CUDA events (by the wall clock on a CPU)."""
    times = []
    for i in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(batches[i % len(batches)])
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            step(batches[i % len(batches)])
            times.append(time.perf_counter() - t0)
    return times


def batched_mm_bytes(a, tokens: int) -> int:
    """What batched_mm gathers per MoE layer: every token copy's expert weights (gate, up, down), bf16."""
    return tokens * a.n_active_experts * 3 * a.dim * a.moe_ffn_dim * 2


def run(a, seq_len: int, batch: int, micro: int, impl: str, precision: str, ac: str, args, device) -> dict:
    """One configuration: the first (micro-batch, checkpointing) that fits, timed. ac "auto": no checkpointing at
    each micro-batch of --micro in turn, then per-block checkpointing at the first."""
    row = {"experts": impl, "precision": precision, "layers": a.n_layers, "seq_len": seq_len, "batch": batch,
           "compile": not args.no_compile, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    if impl == "batched_mm" and device.type == "cuda":
        need = batched_mm_bytes(a, micro * seq_len)
        if need > torch.cuda.get_device_properties(device).total_memory:
            return {**row, "error": f"skipped: batched_mm gathers {need / 1e9:.0f} GB of weights per layer"}
    micros = [int(m) for m in args.micro.split(",")] if args.micro else [micro]
    attempts = [(m, False) for m in micros] if ac != "block" else []
    if ac != "none":
        attempts.append((micros[0], True))
    gen = torch.Generator(device=device).manual_seed(0)
    for m, checkpoint in attempts:
        if batch % m:
            continue
        batches = [[torch.randint(0, a.vocab_size, (m, seq_len), device=device, generator=gen)
                    for _ in range(batch // m)] for _ in range(2)]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model = fwd = opt = step = None
        try:
            model, fwd, opt = build(a, impl, precision, checkpoint, not args.no_compile, device)
            step = make_step(model, fwd, opt, precision, device)
            for i in range(args.warmup):
                loss = step(batches[i % 2])
            warm_s = time.perf_counter() - t0
            times = timed(step, batches, args.steps, device)
            if args.trace:  # one more step under torch.profiler, for bench/trace_families.py
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    step(batches[0])
                    torch.cuda.synchronize(device) if device.type == "cuda" else None
                prof.export_chrome_trace(args.trace)
            loss = float(loss)
            oom = False
        except torch.OutOfMemoryError:
            oom = True  # freed below, once the exception (and the frames it holds) is gone
        peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
        model = fwd = opt = step = None
        cleanup()
        if oom:
            print(f"moe_peer: {impl} {precision}: out of memory at micro-batch {m}"
                  f"{' with checkpointing' if checkpoint else ''}", flush=True)
            continue
        step_s = statistics.median(times)
        tokens = batch * seq_len
        fpt = flops_per_token(a, seq_len)
        peak_flops = peak_bf16_flops(device)
        return {**row, "micro": m, "accum": batch // m, "checkpointing": "block" if checkpoint else "none",
                "tokens_per_s": tokens / step_s, "step_s": step_s, "step_s_range": [min(times), max(times)],
                "tflops": fpt * tokens / step_s / 1e12,
                "mfu": fpt * tokens / step_s / peak_flops if peak_flops else None,
                "flops_per_token": fpt, "active_params": model_params(a, active=True), "params": model_params(a),
                "peak_mem_gb": peak, "warmup_s": warm_s, "loss": loss}
    return {**row, "error": "out of memory in every setting tried"}


def cleanup():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="qwen3-30b-a3b", help="the holotrain config whose shape and batch to take")
    p.add_argument("--layers", type=int, default=0, help="model.n_layers (0: the config's)")
    p.add_argument("--seq-len", type=int, default=0, help="data.seq_len (0: the config's)")
    p.add_argument("--batch", type=int, default=0, help="global batch in sequences (0: the config's)")
    p.add_argument("--micro", default="", help="micro-batches to try in turn, e.g. 4,2 (default: the config's)")
    p.add_argument("--experts", default="grouped_mm", help="experts implementations, comma-separated, run in turn")
    p.add_argument("--precision", default="", choices=["", "autocast", "bf16", "fp32"],
                   help="autocast (fp32 weights, bf16 autocast; the default on CUDA), bf16 weights, or fp32")
    p.add_argument("--ac", default="auto", choices=["auto", "none", "block"],
                   help="per-block activation checkpointing: auto (only when nothing fits without), none, block")
    p.add_argument("--no-compile", action="store_true", help="eager (the default with --tiny)")
    p.add_argument("--compile", action="store_true", help="torch.compile with --tiny too")
    p.add_argument("--steps", type=int, default=0, help="timed steps (default 6; 2 with --tiny)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps first (default 2: compilation; 1 with --tiny)")
    p.add_argument("--tiny", action="store_true", help="qwen3_moe's tiny preset, T=64, B=4 on the CPU")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    p.add_argument("--trace", default="", help="a torch.profiler chrome trace of one step after the timed ones here "
                                             "(JSON; the last experts implementation's)")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("bench/moe_peer.py at a full shape needs a CUDA device (--tiny runs on the CPU)")
    if args.tiny and not args.compile:
        args.no_compile = True
    args.steps = args.steps or (2 if args.tiny else 6)
    args.warmup = args.warmup or (1 if args.tiny else 2)
    precision = args.precision or ("autocast" if device.type == "cuda" else "fp32")
    a, seq_len, batch, micro = shape(args)
    import transformers

    try:  # the experts implementations this transformers registers ("eager" is the model's own loop)
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        known = ", ".join(["eager", *sorted(ALL_EXPERTS_FUNCTIONS.keys())])
    except ImportError:
        known = "unknown"
    print(f"moe_peer: transformers {transformers.__version__} (experts implementations: {known}), torch "
          f"{torch.__version__}; {a.n_layers} layers, {model_params(a) / 1e9:.2f} B parameters "
          f"({model_params(a, active=True) / 1e9:.2f} B active), T={seq_len}, B={batch}", flush=True)
    rows = []
    for impl in args.experts.split(","):
        row = run(a, seq_len, batch, micro, impl, precision, args.ac, args, device)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if "error" in row:
            print(f"moe_peer: {impl} {precision}: {row['error']}", flush=True)
        else:
            mfu = f", MFU {row['mfu']:.3f}" if row["mfu"] else ""
            mem = f", peak {row['peak_mem_gb']:.1f} GB" if row["peak_mem_gb"] else ""
            print(f"moe_peer: {impl} {precision}: {row['tokens_per_s']:,.0f} tokens/s, {row['tflops']:.1f} TFLOP/s "
                  f"(active){mfu}{mem}, micro {row['micro']}x{row['accum']}, checkpointing {row['checkpointing']}",
                  flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"transformers": transformers.__version__,
                                                  "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
