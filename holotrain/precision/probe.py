"""training.fp8 = "auto": FP8 where it pays on this GPU, decided from measurements at the job's own shapes.

For each distinct linear shape (tokens per micro-batch x in -> out) the three GEMMs of a training step (forward,
input gradient, weight gradient) are timed in bf16 and in FP8 (torch._scaled_mm, tensorwise scales). The FP8 side
is also charged for the casts of its operands: each of input, weight and output gradient is cast twice (once per
layout), each cast reading the bf16 tensor twice (scale, then cast) and writing one byte per element, at this
GPU's measured copy bandwidth. FP8 (tensorwise) is switched on when the layers it would convert take less time in
total by at least MIN_GAIN."""

from __future__ import annotations

import torch

from holotrain.hw.probe import cuda_event_median

MIN_GAIN = 1.05  # below this, the casts' rounding error is not worth buying
_CAST_BYTES = 2 * (2 + 2 + 1)  # per element of an operand: two casts, each reading bf16 twice and writing FP8 once


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read and write counted)."""
    a = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() / cuda_event_median(lambda: b.copy_(a), 20, warmup=3)


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn)


def gemm_times(tokens: int, k: int, n: int, device: torch.device) -> tuple[float, float]:
    """(bf16 seconds, FP8 seconds) of one layer's forward, input-gradient and weight-gradient GEMMs."""
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
    bf16 = cuda_event_median(lambda: (x @ w.t(), g @ w, g.t() @ x), 20, warmup=3)
    one = torch.ones((), device=device)
    # _scaled_mm(a, b): a row-major, b column-major (the transpose of a row-major tensor).
    fwd = (_fp8(x), _fp8(w).t())  # x @ w^T
    grad_in = (_fp8(g), _fp8(w.t().contiguous()).t())  # g @ w
    grad_w = (_fp8(g.t().contiguous()), _fp8(x.t().contiguous()).t())  # g^T @ x

    def fp8():
        for a, b in (fwd, grad_in, grad_w):
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return bf16, cuda_event_median(fp8, 20, warmup=3)


def predict(shapes: dict[tuple[int, int], int], tokens: int, device: torch.device) -> list[dict]:
    """For each (in, out) shape with its count of layers: measured bf16 and FP8 GEMM seconds per step, the casts'
    estimated seconds, and the predicted speed-up."""
    bandwidth = copy_bandwidth(device)
    rows = []
    for (k, n), count in sorted(shapes.items()):
        bf16, fp8 = gemm_times(tokens, k, n, device)
        casts = _CAST_BYTES * (tokens * k + n * k + tokens * n) / bandwidth
        rows.append({"in": k, "out": n, "layers": count, "bf16_s": bf16, "fp8_s": fp8, "cast_s": casts,
                     "gain": bf16 / (fp8 + casts)})
    torch.cuda.empty_cache()
    return rows


def choose(shapes: dict[tuple[int, int], int], tokens: int, device: torch.device) -> tuple[str, str]:
    """("tensorwise" or "none", the one-line reason)."""
    rows = predict(shapes, tokens, device)
    bf16 = sum(r["bf16_s"] * r["layers"] for r in rows)
    fp8 = sum((r["fp8_s"] + r["cast_s"]) * r["layers"] for r in rows)
    gain = bf16 / fp8 if fp8 > 0 else 0.0
    detail = ", ".join(f"{r['in']}->{r['out']} x{r['layers']}: {r['gain']:.2f}x" for r in rows)
    verdict = "tensorwise" if gain >= MIN_GAIN else "none"
    return verdict, (f"predicted {gain:.2f}x on the linear layers' GEMMs at {tokens} tokens per micro-batch "
                     f"({detail}; on at >= {MIN_GAIN}x)")
