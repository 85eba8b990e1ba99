"""Causal attention over one long sequence, forward and backward, by kernel: what each achieves at 32k-1M tokens.

  python bench/long_attention.py [--shape 1.4b|8b] [--ts 32768,131072,524288,1048576] [--kernels ...]
                                 [--reps 3] [--budget 60] [--out FILE.json]
  python bench/long_attention.py --device cpu --ts 128,256 --reps 1   (a smoke run)

Kernels (GPU): SDPA's flash kernel (what the plain torch.compile + SDPA loop runs), SDPA's cuDNN kernel, SDPA's
memory-efficient kernel, flex_attention with a causal block mask (compiled; "flex-tma" with its Hopper TMA loads
where this torch offers them). On the CPU: SDPA's math and flash kernels (flex_attention has no backward there).
GQA as the model runs it (enable_gqa); bf16 on a GPU, fp32 on the CPU; batch 1.

Each row: the median seconds of a forward and of a forward + backward (CUDA events after two warm-ups), and the
TFLOP/s by the causal count: forward 4 * H * head_dim * T^2 / 2, backward 2.5 forwards (FlashAttention's convention,
counting its recomputation). Every kernel is checked against the first kernel listed at the smallest T (the output
and the three gradients, max absolute difference); a kernel this torch or this GPU cannot run says why and is
skipped. A kernel whose forward + backward passed --budget seconds is not tried at longer sequences."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.hw.probe import cuda_event_median, median_time  # noqa: E402

SHAPES = {"1.4b": (16, 16, 128), "8b": (32, 8, 128)}  # query heads, kv heads, head_dim
SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def kernel(name: str, T: int, device: torch.device):
    """fn(q, k, v) -> out for the kernel `name` at length T ([1, H, T, D] tensors)."""
    if name in SDPA:
        def run(q, k, v):
            with sdpa_kernel(SDPA[name]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return run
    if name.startswith("flex"):
        # Compiled on a GPU, as the model's own (model/parts.py): eager it materializes the dense [T, T] mask (128 GiB
        # at T = 131072).
        make = torch.compile(create_block_mask, dynamic=False) if device.type == "cuda" else create_block_mask
        mask = make(causal, None, None, T, T, device=device)
        options = {"USE_TMA": True} if name == "flex-tma" else None
        fn = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
        return lambda q, k, v: fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options)
    raise ValueError(f"unknown kernel {name!r} (known: {', '.join([*SDPA, 'flex', 'flex-tma'])})")


def median_s(fn, reps: int, cuda: bool) -> float:
    """Median seconds of fn() after two warm-ups: CUDA events on a GPU, the wall clock on the CPU."""
    return cuda_event_median(fn, reps) if cuda else median_time(fn, reps, warmup=2)


def inputs(T: int, heads: int, kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(T)
    q, k, v = (torch.randn(1, h, T, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    return q, k, v, torch.randn(1, heads, T, head_dim, device=device, dtype=dtype, generator=gen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.4b")
    ap.add_argument("--ts", default="32768,131072,524288")
    ap.add_argument("--kernels", default="")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of one forward + backward past which a kernel "
                    "is not tried at longer sequences")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    names = a.kernels.split(",") if a.kernels else (
        ["flash", "cudnn", "efficient", "flex", "flex-tma"] if cuda else ["math", "flash"])
    heads, kv_heads, head_dim = SHAPES[a.shape]
    ts = sorted(int(t) for t in a.ts.split(","))
    rows, skipped, reference = [], {}, None
    for T in ts:
        fwd_flops = 4 * heads * head_dim * T * T / 2
        for name in names:
            if name in skipped:
                continue
            q, k, v, dout = inputs(T, heads, kv_heads, head_dim, device, dtype)
            row = {"kernel": name, "T": T, "shape": a.shape, "heads": heads, "kv_heads": kv_heads,
                   "head_dim": head_dim, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                   "torch": torch.__version__}
            try:
                fn = kernel(name, T, device)

                def both():
                    out = fn(q, k, v)
                    return out, torch.autograd.grad(out, (q, k, v), dout)

                if T == ts[0]:  # correctness against the first kernel, at the smallest length
                    out, grads = both()
                    got = [out.detach().float(), *(g.float() for g in grads)]
                    if reference is None:
                        reference = got
                    row["max_abs_diff"] = max((x - y).abs().max().item() for x, y in zip(got, reference))
                with torch.no_grad():
                    row["fwd_s"] = median_s(lambda: fn(q, k, v), a.reps, cuda)
                row["fwd_bwd_s"] = median_s(both, a.reps, cuda)
            except Exception as e:  # a kernel this torch or GPU cannot run at this shape: say why, go on
                skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                print(f"long_attention: {name} at T={T}: {skipped[name]}", flush=True)
                continue
            finally:
                del q, k, v, dout
                if cuda:
                    torch.cuda.empty_cache()
            row["fwd_tflops"] = fwd_flops / row["fwd_s"] / 1e12
            row["train_tflops"] = 3.5 * fwd_flops / row["fwd_bwd_s"] / 1e12
            rows.append(row)
            diff = f", max abs diff {row['max_abs_diff']:.2e}" if "max_abs_diff" in row else ""
            print(f"long_attention: {name:9s} T={T:>8d}  forward {row['fwd_s'] * 1e3:9.1f} ms "
                  f"{row['fwd_tflops']:6.1f} TFLOP/s  forward+backward {row['fwd_bwd_s'] * 1e3:9.1f} ms "
                  f"{row['train_tflops']:6.1f} TFLOP/s{diff}", flush=True)
            if row["fwd_bwd_s"] > a.budget:
                skipped[name] = f"forward + backward took {row['fwd_bwd_s']:.1f} s at T={T} (--budget {a.budget:g})"
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=1))


if __name__ == "__main__":
    main()
