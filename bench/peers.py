"""holotrain against its peers on one GPU, in one process, on the same tokens with the same optimizer.

Peers: Hugging Face Transformers LlamaForCausalLM (sdpa attention), and a plain PyTorch Llama written
below, run eager, under torch.compile, and under torch.compile with torchao's float8 training (compile-float8,
tensorwise, the head in bf16; against holotrain-fp8). All run bf16 autocast over fp32 weights, fused AdamW, gradient
clipping at 1.0, on the same pre-drawn random token batches. Per variant: warm-up steps, then CUDA-event
timed steps; the median step gives tokens/s and MFU (dense bf16 peak of the device, FLOPs counted by
holotrain.model.flops_per_token for every variant), with peak memory and, where NVML is present,
energy per 1k tokens and mean SM clock.

  python bench/peers.py --preset 1.4b --seq-len 2048 --batch 8 --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import load_config, resolve  # noqa: E402
from holotrain.hw import peak_bf16_flops  # noqa: E402
from holotrain.hw.probe import cuda_event_median  # noqa: E402
from holotrain.model.costs import flops_per_token  # noqa: E402
from holotrain.parallel import DistEnv  # noqa: E402
from holotrain.train.trainer import TrainStep, build_model, build_optimizer, model_args  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The plain PyTorch peer: the Llama a user would write in an afternoon, nothing more.


class PlainBlock(nn.Module):
    def __init__(self, d, h, ff, eps):
        super().__init__()
        self.h, self.eps = h, eps
        self.n1, self.n2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        a = F.rms_norm(x, (D,), self.n1, self.eps)
        q, k, v = (p(a).view(B, T, self.h, D // self.h).transpose(1, 2) for p in (self.q, self.k, self.v))

        def rope(t):
            t1, t2 = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-t2, t1], dim=-1) * sin

        y = F.scaled_dot_product_attention(rope(q).to(v.dtype), rope(k).to(v.dtype), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, D))
        m = F.rms_norm(x, (D,), self.n2, self.eps)
        return x + self.down(F.silu(self.gate(m)) * self.up(m))


class PlainLlama(nn.Module):
    def __init__(self, d, layers, h, ff, vocab, seq, theta=10000.0, eps=1e-5, checkpoint_blocks=False):
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks  # per-block activation checkpointing, as a user adds it first
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(PlainBlock(d, h, ff, eps) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.eps = eps
        hd = d // h
        freqs = torch.outer(torch.arange(seq).float(), 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            if self.checkpoint_blocks:
                h = torch.utils.checkpoint.checkpoint(b, h, self.cos, self.sin, use_reentrant=False)
            else:
                h = b(h, self.cos, self.sin)
        logits = self.head(F.rms_norm(h, (h.shape[-1],), self.norm, self.eps))
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1))


def peer_step(model, opt, loss_fn):
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)


# ---------------------------------------------------------------------------------------------
# Variants


def build_variant(name: str, a, device):
    """Returns (step(x, y) -> loss, objects to free)."""
    if name == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        from holotrain.model.hf import hf_config_dict

        cfg = LlamaConfig(**hf_config_dict(a))
        cfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(cfg).to(device)
        model.config.use_cache = False
        opt = adamw(model)
        return peer_step(model, opt, lambda m, x, y: m(input_ids=x, labels=x).loss), (model, opt)
    if name in ("eager", "compile", "compile-float8", "compile-ac"):
        # compile-ac: the compiled loop with every block checkpointed (torch.utils.checkpoint), for long sequences
        model = PlainLlama(a.dim, a.n_layers, a.n_heads, a.ffn_dim, a.vocab_size, a.max_seq_len,
                           checkpoint_blocks=name == "compile-ac").to(device)
        if name == "compile-float8":  # what a user adds to the plain loop: torchao float8, the head left in bf16
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                       module_filter_fn=lambda m, fqn: fqn != "head")
        opt = adamw(model)
        fwd = torch.compile(model) if name.startswith("compile") else model
        return peer_step(fwd, opt, lambda m, x, y: m(x, y)), (model, opt)
    if name.startswith("holotrain"):
        # holotrain as the trainer runs it: its model, its levers, its optimizer and its step.
        # "holotrain-a-b" switches levers off or picks kernels, to show what each one gives.
        switches = set(name.split("-")[1:])
        unknown = switches - {"eager", "noclipfold", "flash", "cudnn", "autotune", "fp8", "fp8head",
                              "delayed"}
        if unknown:
            raise SystemExit(f"unknown holotrain switches {sorted(unknown)}")
        overrides = [
            f"--model.preset={ARGS.preset}", f"--data.seq_len={ARGS.seq_len}", f"--training.batch_size={ARGS.batch}",
            f"--training.compile={'false' if switches & {'eager', 'autotune'} else 'true'}", "--training.grad_clip=1.0",
        ]
        for kernel in switches & {"flash", "cudnn"}:
            overrides.append(f"--training.attention={kernel}")
        if switches & {"fp8", "fp8head"}:  # "fp8-delayed": holotrain's delayed scaling in place of tensorwise
            overrides.append(f"--training.fp8={'delayed' if 'delayed' in switches else 'tensorwise'}")
        if "fp8head" in switches:  # the output head in FP8 too (training.fp8_skip empty)
            overrides.append("--training.fp8_skip=")
        cfg = load_config(None, overrides)
        resolve(cfg, tokenizer_vocab=a.vocab_size)
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=device)
        torch._dynamo.reset()
        model = build_model(cfg, env, torch.bfloat16)
        if "autotune" in switches:  # the trainer's regional compilation, with inductor's GEMM autotuning
            for block in model.layers.values():
                block.compile(mode="max-autotune-no-cudagraphs")
            model.loss = torch.compile(model.loss, mode="max-autotune-no-cudagraphs")
        opt = build_optimizer(model, cfg, env, torch.bfloat16)
        train_step = TrainStep(model, opt, cfg, env, torch.bfloat16)
        if "noclipfold" in switches:
            opt.fold_clip = False

        def step(x, y):
            return train_step(lambda m: (x, y), 1, 3e-4)[0]

        return step, (model, opt, train_step)
    raise SystemExit(f"unknown variant {name!r}")


class Energy:
    """NVML energy counter and SM clock, sampled around the timed steps (None without NVML)."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:
            self.nvml = None

    def joules(self):
        return None if self.nvml is None else self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0

    def sm_clock(self):
        return None if self.nvml is None else self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)


def run_variant(name, a, batches, energy):
    device = batches[0][0].device
    torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    step, keep = build_variant(name, a, device)
    for i in range(ARGS.warmup):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t_build
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(ARGS.steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(ARGS.steps)]
    e0, clocks = energy.joules(), []
    wall0 = time.perf_counter()
    for i in range(ARGS.steps):
        starts[i].record()
        loss = step(*batches[i % len(batches)])
        ends[i].record()
        if i % 4 == 0:
            clocks.append(energy.sm_clock())
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall0
    e1 = energy.joules()
    times = [s.elapsed_time(e) / 1000 for s, e in zip(starts, ends)]
    step_s = statistics.median(times)
    tokens = ARGS.batch * ARGS.seq_len
    fpt = flops_per_token(a, ARGS.seq_len)
    peak = peak_bf16_flops(device)
    row = {
        "variant": name,
        "tokens_per_s": tokens / step_s,
        "step_ms": step_s * 1000,
        "step_ms_spread": (min(times) * 1000, max(times) * 1000),
        "tflops": fpt * tokens / step_s / 1e12,
        "mfu": fpt * tokens / step_s / peak if peak else None,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
        "loss": float(loss.detach()),
        "warmup_s": warm_s,
        "j_per_1k_tokens": (e1 - e0) / (tokens * ARGS.steps) * 1000 if e0 is not None else None,
        "mean_sm_mhz": statistics.mean(clocks) if clocks and clocks[0] is not None else None,
        "wall_tokens_per_s": tokens * ARGS.steps / wall,
    }
    if ARGS.profile and name in ARGS.profile.split(","):
        row["profile"] = profile_steps(step, batches)
    del step, keep
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return row


def profile_steps(step, batches, n=3):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)


def attention_micro(a, device):
    """fwd+bwd of causal SDPA at the benchmark's shape, per kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, T, D = ARGS.batch, a.n_heads, ARGS.seq_len, a.head_dim
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16)
    out = {}
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        try:
            with sdpa_kernel([backend]):
                def f():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
                ms = cuda_event_median(f, 20, warmup=5) * 1e3
            flops = 4 * B * H * T * T * D * 3.5 / 2  # fwd 2 matmuls + bwd 5, causal half
            out[name] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as e:  # a backend that refuses the shape
            out[name] = {"error": str(e).splitlines()[0][:120]}
    return out


def model_and_batches(preset: str, seq_len: int, batch: int, device, count: int = 4):
    """The preset's model args (32k vocabulary) and `count` random (inputs, targets) batches drawn once, seeded."""
    cfg = resolve(load_config(None, [f"--model.preset={preset}", f"--data.seq_len={seq_len}"]), tokenizer_vocab=32000)
    a = model_args(cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    batches = []
    for _ in range(count):
        x = torch.randint(0, a.vocab_size, (batch, seq_len + 1), device=device, generator=gen)
        batches.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return a, batches


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1.4b")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--variants", default="hf,eager,compile,holotrain")
    p.add_argument("--profile", default="", help="comma list of variants to profile 3 steps of")
    p.add_argument("--attention-micro", action="store_true")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    ARGS = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/peers.py needs a CUDA device")
    device = torch.device("cuda")
    a, batches = model_and_batches(ARGS.preset, ARGS.seq_len, ARGS.batch, device)
    energy = Energy()
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "python " + " ".join(sys.argv),
        "shape": {"preset": ARGS.preset, "seq_len": ARGS.seq_len, "batch": ARGS.batch},
        "rows": [],
    }
    if ARGS.attention_micro:
        result["attention_micro"] = attention_micro(a, device)
        print(json.dumps(result["attention_micro"]), flush=True)
    for name in ARGS.variants.split(","):
        row = run_variant(name, a, batches, energy)
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        if "profile" in row:
            print(row["profile"], flush=True)
        if ARGS.out:
            Path(ARGS.out).write_text(json.dumps(result, indent=1))
    print_table(result)


def print_table(result):
    rows = {r["variant"]: r for r in result["rows"]}
    print(f"\n{result['device']}, torch {result['torch']}, {result['shape']}")
    print(f"{'variant':18} {'tokens/s':>10} {'MFU':>6} {'step ms':>8} {'peak GB':>8} {'J/1k tok':>8} {'SM MHz':>7} "
          f"{'vs hf':>6} {'vs compile':>10}")
    for name, r in rows.items():
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] else "-"
        vs_hf = r["tokens_per_s"] / rows["hf"]["tokens_per_s"] if "hf" in rows else float("nan")
        vs_c = r["tokens_per_s"] / rows["compile"]["tokens_per_s"] if "compile" in rows else float("nan")
        j = f"{r['j_per_1k_tokens']:.1f}" if r["j_per_1k_tokens"] else "-"
        mhz = f"{r['mean_sm_mhz']:.0f}" if r["mean_sm_mhz"] else "-"
        print(f"{name:18} {r['tokens_per_s']:>10,.0f} {mfu:>6} {r['step_ms']:>8.1f} {r['peak_mem_gb']:>8.1f} {j:>8} "
              f"{mhz:>7} {vs_hf:>6.2f} {vs_c:>10.2f}")


if __name__ == "__main__":
    main()
