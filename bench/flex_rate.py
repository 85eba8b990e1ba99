"""The document-masked attention kernel's rate against the dense causal one, by sequence length and document length.
GPU only.

  python bench/flex_rate.py [--ts 8192,32768,131072] [--docs 512,2048,8192,lognormal] [--out FILE.json]

For each T: the dense causal SDPA kernel (what a row of one document takes) and the model's document-masked
flex_attention (model/llama.py: attention with doc_block_mask) on rows of documents of the given length (the last
one cut at T), or of log-normal lengths like the balance benchmark's (median 2,000 tokens, sigma 1.6). Forward and
backward, bf16, 16 heads of 128 (the 1.4b's), batch 1; the block mask's construction timed apart. The rate is
counted as the time model counts it (plan/attention.py): the causal triangle's FLOPs times the share of its
128 x 128 blocks the mask visits, over the seconds; "speed" is that rate over the dense kernel's at the same T. The
time model's FLEX_BLOCK_COST and FLEX_ROW_COST are fitted to these times."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.model import ModelArgs  # noqa: E402
from holotrain.model.parts import attention, doc_block_mask  # noqa: E402
from holotrain.model.costs import attention_flops_per_token  # noqa: E402
from holotrain.plan.attention import block_density  # noqa: E402

HEADS, HEAD_DIM = 16, 128


def doc_ids_for(T: int, kind: str, seed: int = 0) -> torch.Tensor:
    """[1, T] document ids of a row packed with documents of `kind` ("lognormal" or a length)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < T:
        if kind == "lognormal":
            n = int(torch.empty(1).log_normal_(mean=torch.log(torch.tensor(2000.0)).item(), std=1.6,
                                               generator=gen).item()) + 1
        else:
            n = int(kind)
        n = min(n, T - total)
        lengths.append(n)
        total += n
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def timed(fn, reps: int) -> float:
    """Median seconds of fn() over `reps` timed runs after two warm-up runs."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ts", default="8192,32768,131072")
    ap.add_argument("--docs", default="512,2048,8192,lognormal")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    print(f"{'T':>7} {'docs':>9} {'density':>8} {'mask ms':>8} {'attn ms':>9} {'TFLOP/s':>8} {'speed':>6}")
    for T in (int(t) for t in a.ts.split(",")):
        q, k, v = (torch.randn(1, HEADS, T, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        work = attention_flops_per_token(ModelArgs(dim=HEADS * HEAD_DIM, n_layers=1, n_heads=HEADS), T) * T
        dense_s = timed(lambda: attention(q, k, v).backward(grad), a.reps)
        dense = work / dense_s
        rows.append({"T": T, "docs": "one", "density": 1.0, "attention_s": dense_s, "flops_s": dense, "speed": 1.0})
        print(f"{T:>7} {'one':>9} {1.0:>8.3f} {'':>8} {dense_s * 1e3:>9.2f} {dense / 1e12:>8.0f} {1.0:>6.2f}")
        for kind in a.docs.split(","):
            doc_ids = doc_ids_for(T, kind).to(dev)
            density = float(block_density(doc_ids))
            mask_s = timed(lambda: doc_block_mask(doc_ids), a.reps)
            mask = doc_block_mask(doc_ids)
            attn_s = timed(lambda: attention(q, k, v, mask).backward(grad), a.reps)
            rate = work * density / attn_s
            rows.append({"T": T, "docs": kind, "density": density, "mask_s": mask_s, "attention_s": attn_s,
                         "flops_s": rate, "speed": rate / dense})
            print(f"{T:>7} {kind:>9} {density:>8.3f} {mask_s * 1e3:>8.2f} {attn_s * 1e3:>9.2f} {rate / 1e12:>8.0f} "
                  f"{rate / dense:>6.2f}")
        del q, k, v, grad
        torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                                     "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
