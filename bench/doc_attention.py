"""Attention within documents of packed rows, forward and backward, at the 1.4b's shape on one GPU: the kernels the
model can take for a micro-batch that holds document boundaries, timed on document ids the data plane produced (or
on synthetic ones), each checked against flex attention's output and gradients.

  python bench/doc_attention.py [--doc-ids FILE.npy] [--batch 8 --seq-len 2048 --heads 16 --head-dim 128]

Kernels: cuDNN's causal kernel without a mask (the speed of an unmasked micro-batch; wrong across documents),
flex attention with a document BlockMask (default and tuned kernel options, Hopper's TMA loads, max-autotune),
cuDNN's causal kernel with an additive bias that blocks attention across documents, and a split by rows: the rows
that hold one document through cuDNN's causal kernel, the rest through flex. The split times rows already ordered
one-document rows first (an order the host can give a micro-batch before it is copied to the GPU; the mean loss does
not depend on it), with the masked group exactly as large as the rows with a boundary, or rounded up to a power of
two (at most log2(B) + 1 shapes to compile; a one-document row under the document mask is still exact).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.hw.probe import cuda_event_median  # noqa: E402


def synthetic_doc_ids(n: int, B: int, T: int, single_row_share: float, gen: np.random.Generator) -> np.ndarray:
    """Rows that hold one document piece with probability single_row_share, else 2-16 pieces cut at random places."""
    out = np.zeros((n, B, T), dtype=np.int64)
    for i in range(n):
        doc = 0
        for r in range(B):
            pieces = 1 if gen.random() < single_row_share else int(gen.integers(2, 17))
            cuts = np.sort(gen.choice(np.arange(1, T), pieces - 1, replace=False))
            ids = np.zeros(T, dtype=np.int64)
            for c in cuts:
                ids[c:] += 1
            out[i, r] = ids + doc
            doc += pieces
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--doc-ids", help=".npy of document ids [n, B, T] (default: synthetic, 71%% single-document rows)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batches", type=int, default=8, help="micro-batches of document ids to time")
    p.add_argument("--only", nargs="*", help="time only the kernels whose names hold one of these words")
    a = p.parse_args()
    dev = torch.device("cuda")
    # One compiled flex kernel per micro-batch shape the split makes (the default limit is 8 per function).
    torch._dynamo.config.cache_size_limit = 64
    B, T, H, D = a.batch, a.seq_len, a.heads, a.head_dim
    ids = np.load(a.doc_ids) if a.doc_ids else synthetic_doc_ids(a.batches, B, T, 0.71, np.random.default_rng(0))
    ids = torch.from_numpy(ids[: a.batches, :B, :T]).to(dev)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}, "
          f"B={B} T={T} H={H} D={D}, {ids.shape[0]} micro-batches, rows with a boundary "
          f"{(ids[..., 1:] != ids[..., :-1]).any(-1).float().mean().item():.2f}")
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)

    def block_mask(d):
        def same_doc_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (d[b, q_idx] == d[b, kv_idx])
        return create_block_mask(same_doc_causal, d.shape[0], None, T, T, device=dev)

    def bias_of(d):
        """Additive bias [B, 1, T, T]: 0 within a document, -inf across (the kernel's causal mask does the rest)."""
        same = d[:, None, :, None] == d[:, None, None, :]
        return torch.zeros(same.shape, dtype=q.dtype, device=dev).masked_fill_(~same, float("-inf"))

    masks = [block_mask(d) for d in ids]
    biases = [bias_of(d) for d in ids]
    flex_default = torch.compile(flex_attention, dynamic=False)
    flex_tuned = torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")

    def cudnn_causal(i):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def cudnn_bias(i):
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, biases[i].expand(B, H, T, T), True, 0.0,
                                                                  True, False)[0]

    @torch.compile(dynamic=False, fullgraph=True)
    def cudnn_bias_compiled_fn(q, k, v, bias):
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q * 1.0, k, v, bias.expand(B, H, T, T), True, 0.0,
                                                                  True, False)[0]

    def flex(fn, options=None):
        return lambda i: fn(q, k, v, block_mask=masks[i], kernel_options=options)

    kernels = {"cuDNN causal, no mask (wrong across documents)": cudnn_causal,
               "flex, document mask": flex(flex_default),
               "cuDNN causal + document bias": cudnn_bias,
               "cuDNN causal + document bias, compiled": lambda i: cudnn_bias_compiled_fn(q, k, v, biases[i])}
    for name, opts in [("flex, 128x64 w8 s2 fwd", {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}),
                       ("flex, bwd 64x128/128x64 w8", {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128,
                                                       "BLOCK_N2": 64, "num_warps": 8}),
                       ("flex, bwd 32x128/128x32 w4 s3", {"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128,
                                                          "BLOCK_N2": 32, "num_warps": 4, "num_stages": 3}),
                       ("flex, TMA loads", {"USE_TMA": True})]:
        kernels[name] = flex(flex_default, opts)
    kernels["flex, max-autotune"] = flex(flex_tuned)

    # Documents as sequences of their own: FlashAttention's variable-length kernel on [B*T, H, D] tensors (the layout
    # the model's projections give before their transpose), cut at every document and row boundary. max_q = T for
    # every micro-batch (blocks past a sequence's end exit early), so one compiled shape serves all.
    def flash_causal(i):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    kernels["flash (FA2) causal, no mask (wrong across documents)"] = flash_causal
    try:
        from torch.nn.attention.varlen import varlen_attn
        causal = ({"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters
                  else {"window_size": (-1, 0)})
        cu = []
        for d in ids:
            starts = torch.ones(B, T, dtype=torch.bool, device=dev)
            starts[:, 1:] = d[:, 1:] != d[:, :-1]
            cu.append(torch.cat([starts.flatten().nonzero().flatten(),
                                 torch.tensor([B * T], device=dev)]).to(torch.int32))
        print(f"varlen: sequences per micro-batch {[len(c) - 1 for c in cu]}")

        def varlen(i):
            thd = [t.transpose(1, 2).reshape(B * T, H, D) for t in (q, k, v)]
            y = varlen_attn(*thd, cu[i], cu[i], T, T, **causal)
            return y.view(B, T, H, D).transpose(1, 2)
        kernels["varlen (FA2), documents as sequences (+ layout copies)"] = varlen
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        gt = g.transpose(1, 2).contiguous().view(B * T, H, D)
        varlen_only_ms = 1e3 * statistics.mean(cuda_event_median(
            lambda i=i: varlen_attn(qt.view(B * T, H, D), kt.view(B * T, H, D), vt.view(B * T, H, D), cu[i], cu[i],
                                    T, T, **causal).backward(gt), 10, warmup=3) for i in range(len(cu)))
        print(f"{'varlen (FA2), [B*T, H, D] inputs, no layout copies':52s} {varlen_only_ms:7.3f} ms fwd+bwd")
    except (ImportError, RuntimeError) as e:
        print(f"varlen attention unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}")

    # The split: per micro-batch, its rows in one-document-first order, and how many lead without a mask.
    boundary = (ids[..., 1:] != ids[..., :-1]).any(-1)  # [n, B]
    order = [torch.sort(b.int(), stable=True).indices for b in boundary]
    ordered = [d[o] for d, o in zip(ids, order)]
    ordered_masks = [block_mask(d) for d in ordered]

    def split(power_of_two: bool):
        plain = []
        for b in boundary:
            masked = int(b.sum())
            if power_of_two and masked:
                masked = min(B, 1 << (masked - 1).bit_length())
            plain.append(B - masked)
        group_masks = [block_mask(d[p:]) if p < B else None for d, p in zip(ordered, plain)]

        def f(i):
            p = plain[i]
            if p == 0:
                return flex_default(q, k, v, block_mask=ordered_masks[i])
            if p == B:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.cat([F.scaled_dot_product_attention(q[:p], k[:p], v[:p], is_causal=True),
                              flex_default(q[p:], k[p:], v[p:], block_mask=group_masks[i])])
        return f, plain

    split_exact, plain_exact = split(False)
    split_pow2, plain_pow2 = split(True)
    print(f"split: one-document rows per micro-batch {plain_exact}; unmasked with the masked group rounded up to a "
          f"power of two {plain_pow2}")
    kernels["split by rows (masked group exact)"] = split_exact
    kernels["split by rows (masked group to a power of two)"] = split_pow2
    # The split's reference: flex with the document mask of the rows in their new order.
    split_refs = {name for name in kernels if name.startswith("split")}

    if a.only:
        kernels = {n: f for n, f in kernels.items() if n == "flex, document mask" or any(w in n for w in a.only)}

    def fwd_bwd(f, i):
        for t in (q, k, v):
            t.grad = None
        y = f(i)
        y.backward(g)
        return y

    def run(f, i):
        y = fwd_bwd(f, i)
        return y.detach(), [t.grad.clone() for t in (q, k, v)]

    refs = [run(kernels["flex, document mask"], i) for i in range(len(masks))]
    ordered_refs = [run(lambda j: flex_default(q, k, v, block_mask=ordered_masks[j]), i) for i in range(len(masks))]
    for name, f in kernels.items():
        ref = ordered_refs if name in split_refs else refs
        try:
            t0 = time.perf_counter()
            got = run(f, 0)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            y_err = max((run(f, i)[0].float() - ref[i][0].float()).abs().max().item() for i in range(len(masks)))
            y, grads = run(f, len(masks) - 1)
            g_err = max((a_.float() - b_.float()).abs().max().item() / b_.float().abs().max().item()
                        for a_, b_ in zip(grads, ref[-1][1]))
            ms = 1e3 * statistics.mean(cuda_event_median(lambda i=i: fwd_bwd(f, i), 10, warmup=3)
                                        for i in range(len(masks)))
            del got
            print(f"{name:52s} {ms:7.3f} ms fwd+bwd   output max |diff| vs flex {y_err:.4f}, gradient max rel "
                  f"{g_err:.4f}, first call {first_s:.1f} s")
        except Exception as e:  # a kernel or option this build does not support: say so and go on
            print(f"{name:52s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
