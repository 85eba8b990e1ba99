"""What the delayed FP8 recipe's casts cost on the GPU, kernel by kernel, at the 1.4b's activation shapes: one
tensor cast to FP8 by a scale known in advance, its maximum recorded, and the FP8 transpose that the weight
gradient's GEMM takes (torch._scaled_mm: row-major first operand, column-major second).

  python bench/fp8_cast.py [--tokens 16384] [--widths 2048,5632,11264]

Ways, each compiled by inductor and checked against the first:
  fused      cast, maximum and transpose in one compiled function: what precision/delayed.py's blocks get
  split      cast and maximum compiled, then the transpose of the FP8 result compiled on its own (one byte read
             a value more, but a kernel that may tile the transposed store)
  eager-t    cast and maximum compiled, the transpose by ATen's copy
  tiled      one compiled function as "fused", but the transpose is precision/transpose.py's op (opaque to
             inductor, a tiled Triton kernel): what the model's blocks run
  dynamic    the maximum first, then cast and transpose: tensorwise scaling's two passes (torchao's)
Then the transposes alone, of the cast result: inductor's (t-inductor) and the op's (t-tiled).
Each row gives the median time and the bytes it must move at least (the 16-bit read, two one-byte writes) over
that time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.hw.probe import cuda_event_median  # noqa: E402
from holotrain.precision.delayed import E4M3, X, cast, scale_from, to_fp8  # noqa: E402
from holotrain.precision.transpose import fp8_transpose  # noqa: E402


def cast_and_max(x, state):
    """The model's own cast (precision/delayed.py), by the scale in `state`, raising its running maximum."""
    return cast(x, X, *state, first=False)


def fused(x, state):
    x8, inv = cast_and_max(x, state)
    return x8, x8.t().contiguous(), inv


def dynamic(x, state):
    scale = scale_from(x.abs().amax().float(), E4M3)
    x8 = to_fp8(x, scale, E4M3)
    return x8, x8.t().contiguous(), scale.reciprocal()


_transpose = torch.compile(lambda x8: x8.t().contiguous())


def tiled(x, state):
    x8, inv = cast_and_max(x, state)
    return x8, fp8_transpose(x8), inv


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--widths", default="2048,5632,11264")
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp8_cast.py needs a CUDA device")
    c_fused, c_dynamic = torch.compile(fused), torch.compile(dynamic)
    c_cast, c_tiled = torch.compile(cast_and_max), torch.compile(tiled)
    ways = {
        "fused": c_fused,
        "split": lambda x, h: (lambda x8, inv: (x8, _transpose(x8), inv))(*c_cast(x, h)),
        "eager-t": lambda x, h: (lambda x8, inv: (x8, x8.t().contiguous(), inv))(*c_cast(x, h)),
        "tiled": c_tiled,
        "dynamic": c_dynamic,
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.tokens} tokens")
    print(f"{'width':>6} {'way':>8} {'us':>8} {'GB/s':>7} {'vs fused':>8}")
    for width in (int(w) for w in a.widths.split(",")):
        x = torch.randn(a.tokens, width, device="cuda", dtype=torch.bfloat16)
        scale = scale_from(x.abs().amax().float(), E4M3).repeat(3)  # as `dynamic` computes it: the same bits
        inv = scale[0].reciprocal()
        state = (torch.zeros(3, device="cuda"), scale, inv, inv, inv)  # running maxima, scales, reciprocals
        want = [t.float() if t.dtype == E4M3 else t for t in c_fused(x, state)]
        nbytes = x.numel() * (2 + 1 + 1)
        base = None
        for name, fn in ways.items():
            got = [t.float() if t.dtype == E4M3 else t for t in fn(x, state)]
            if not all(torch.equal(u, v) for u, v in zip(want, got)):
                print(f"{width:>6} {name:>8} disagrees with fused")
                continue
            s = cuda_event_median(lambda fn=fn: fn(x, state), a.reps, warmup=3)
            base = base or s
            print(f"{width:>6} {name:>8} {s * 1e6:8.1f} {nbytes / s / 1e9:7.0f} {base / s:8.2f}x")
        x8 = want[0].to(E4M3)  # the transposes alone: a byte read and a byte written a value
        for name, fn in (("t-inductor", _transpose), ("t-tiled", fp8_transpose)):
            assert torch.equal(fn(x8).float(), x8.t().float())
            s = cuda_event_median(lambda fn=fn: fn(x8), a.reps, warmup=3)
            print(f"{width:>6} {name:>8} {s * 1e6:8.1f} {x8.numel() * 2 / s / 1e9:7.0f}")
        from holotrain.precision.transpose_kernel import _transpose_any

        print(f"{width:>6} t-tiled chose {_transpose_any.best_config}")


if __name__ == "__main__":
    main()
