"""The GEMM cores of the fused TP kernels alone on one GPU, no communication: cuBLAS (torch), our Triton GEMM
(overlap_kernels.triton_matmul) and the warp-specialized Gluon GEMM (gluon_gemm.ws_matmul), at the per-rank shapes
of bench/overlap.py's large case (TP=2, M=16384, K=8192, N=14336):
  ag: gathered [16384, 8192] @ w [7168, 8192].T      rs: [16384, 7168] @ w [8192, 7168].T
Each variant is first checked against cuBLAS (max relative error, fresh random inputs); then every variant is timed
once per round in its power steady state (--settle-s of back-to-back calls first, then >= --window-s timed; CUDA
events, median) over --rounds interleaved rounds in rotated order, with the SM clock sampled through NVML. Prints a table and writes --out (JSON).

  python bench/gemm_core.py --out OUT/gemm_core.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"ag": (16384, 8192, 7168), "rs": (16384, 7168, 8192)}  # M, K, N


def steady_ms(fn, settle_s: float, window_s: float) -> tuple[float, float]:
    """(median ms per call, mean SM MHz) after settle_s seconds of back-to-back calls (the H200's power limiter
    averages over tens to hundreds of ms), timed over at least window_s seconds."""
    from overlap import ClockSampler, median_call_ms  # bench/overlap.py

    fn()
    est = median_call_ms(fn, 3)
    for _ in range(int(settle_s * 1000 / est)):
        fn()
    with ClockSampler() as clock:
        ms = median_call_ms(fn, max(10, int(window_s * 1000 / est)))
    return ms, float(clock.summary().get("sm_mhz_mean", 0))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--settle-s", type=float, default=0.3, help="seconds each variant runs before it is timed")
    p.add_argument("--window-s", type=float, default=0.2, help="at least this many seconds timed per variant")
    p.add_argument("--ws", default="128x256x64-s3-g8,128x256x64-s3-g16",
                   help="comma list of tiles for the Gluon core (parallel.tp_tiles' form; BM 128, 8 warps)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from holotrain.parallel.gluon_gemm import ws_matmul
    from holotrain.parallel.overlap_kernels import triton_matmul
    from holotrain.parallel.tiles import Tiles, parse_tiles

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,)).item()))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": SHAPES,
              "check": {}, "per_round": []}
    variants = {}
    for direction, (M, K, N) in SHAPES.items():
        a = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(N, K, device="cuda", generator=gen) * K ** -0.5).to(torch.bfloat16)
        ref = (a @ w.t()).float()
        ops = {"cublas": lambda a=a, w=w: a @ w.t(), "triton": lambda a=a, w=w: triton_matmul(a, w, "nk", Tiles())}
        for text in args.ws.split(","):
            tiles = Tiles(**parse_tiles(text + "-c1"))  # -c1: the Gluon core's own checks on the tiles
            ops[f"gluon {text}"] = lambda a=a, w=w, t=tiles: ws_matmul(a, w, "nk", t)
        for name, fn in list(ops.items()):
            try:
                y = fn()
                torch.cuda.synchronize()
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            except Exception as e:  # a variant that does not compile or run is reported, not fatal
                err = f"{type(e).__name__}: {str(e)[:300]}"
                del ops[name]
            result["check"][f"{direction} {name}"] = err
            print(f"check {direction} {name}: max rel err {err}", flush=True)
            if isinstance(err, float) and not err < 2e-2:
                del ops[name]
        variants[direction] = ops
    for rnd in range(args.rounds):
        this = {}
        for direction, ops in variants.items():
            names = list(ops)
            names = names[rnd % len(names):] + names[:rnd % len(names)]  # rotated: no variant always follows another
            for name in names:
                ms, mhz = steady_ms(ops[name], args.settle_s, args.window_s)
                this[f"{direction} {name}"] = ms
                this[f"{direction} {name} MHz"] = mhz
        result["per_round"].append(this)
        print(f"round {rnd}: " + json.dumps({k: round(v, 3) for k, v in this.items()}), flush=True)
    keys = result["per_round"][0].keys()
    med = {k: statistics.median(r[k] for r in result["per_round"]) for k in keys}
    result["median"] = med
    lines = ["| direction | variant | ms (median of rounds) | vs cuBLAS | SM MHz | TFLOP/s |", "|---|---|---:|---:|---:|---:|"]
    for direction, (M, K, N) in SHAPES.items():
        base = med.get(f"{direction} cublas")
        for name in variants[direction]:
            ms = med[f"{direction} {name}"]
            lines.append(f"| {direction} {M}x{K}x{N} | {name} | {ms:.3f} | {base / ms:.3f}x | "
                         f"{med[f'{direction} {name} MHz']:.0f} | {2 * M * K * N / ms / 1e9:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
