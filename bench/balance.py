"""Attention-cost balance across data-parallel ranks at long context: a CPU simulation with the real packer and
step formation (holotrain/data/packing.py).

  python bench/balance.py --windows 4,8         # the table of bench/RESULTS.md
  python bench/balance.py --steps 50 --quick   # fewer cases

Document lengths are drawn from a log-normal distribution (median ~2,000 tokens, sigma 1.6: half the documents
are under 2k tokens, 0.45% pass 131,072, and documents past 16,384 tokens hold 61% of the tokens), in the order
a mixture would read them, and packed best-fit into samples of seq_len + 1 tokens as the data plane packs them.
Each step, every rank gets `rows` samples per micro-batch. A rank's attention work in a micro-batch is counted
as causal attention within each piece of document and within the padding (the document mask gives padding its
own segment): sum over segments of n(n+1)/2 query-key pairs. Ranks meet at every layer of every micro-batch
(FSDP gathers each block's weights), so a micro-batch takes as long as its slowest rank, and a step the sum of its
micro-batches'. Reported per step: max over mean of the ranks' work in the step; "per micro-batch": the same over
micro-batches, and the step's time over a perfectly even one's (the sum over micro-batches of the slowest rank's
work, over the sum of the means).

  (a) in order, equal count: what data.balance = false does
  (b) each step's samples split over the ranks with equal count by cost (LPT and swaps): the previous balancing
  (c) cost-aware step formation: each micro-batch chosen from a window of data.balance_window steps of samples
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.data.packing import Packer, StepFormer, balance

MEDIAN_TOKENS, SIGMA = 2000.0, 1.6


def work(b, length: int) -> int:
    """Causal query-key pairs of one sample: every document piece, and the padding, attends within itself."""
    segments = [len(p.tokens) for p in b.pieces] + [length - b.used]
    return sum(n * (n + 1) // 2 for n in segments)


def documents(seed: int, median: float = MEDIAN_TOKENS, sigma: float = SIGMA):
    """Endless document lengths, log-normal."""
    rng = np.random.default_rng(seed)
    while True:
        yield int(rng.lognormal(np.log(median), sigma)) + 1


class Source:
    def __init__(self, seed: int, max_len: int):
        self.lengths = documents(seed)
        self.ones = np.ones(max_len, dtype=np.uint32)
        self.count = 0

    def feed(self, packer: Packer) -> None:
        n = next(self.lengths)
        if n > len(self.ones):
            self.ones = np.ones(2 * n, dtype=np.uint32)
        packer.add(self.ones[:n], (0, 0, 0, self.count))
        self.count += 1


def simulate(scheme: str, seq_len: int, ranks: int, rows: int, accum: int, steps: int, window: int = 4,
             seed: int = 0) -> dict:
    """Per step: the ranks' work (per micro-batch). Returns the ratios and the samples' lateness."""
    length = seq_len + 1
    per_round, per_step = ranks * rows, ranks * rows * accum
    packer = Packer(length, max_open=max(8, 2 * per_step))  # as the plane's Constructor
    source = Source(seed, 4 * length)
    former = StepFormer(packer, ranks, rows, accum, window) if scheme == "c" else None
    step_ratios, round_ratios, slow, late, tokens, t0 = [], [], [], 0, 0, time.perf_counter()
    for _ in range(steps):
        rounds = []  # per micro-batch, per rank: work
        if former is None:
            while not packer.has(per_step):
                source.feed(packer)
            bins = packer.take(per_step)
            works = [work(b, length) for b in bins]
            if scheme == "a":
                groups = [list(range(r * rows * accum, (r + 1) * rows * accum)) for r in range(ranks)]
            else:
                groups = balance([b.attention_cost(length) for b in bins], ranks)
            for m in range(accum):
                rounds.append([sum(works[i] for i in g[m * rows : (m + 1) * rows]) for g in groups])
        else:
            while former.wants():
                source.feed(packer)
            handed = packer.handed // per_round
            for m, (per_rank, _) in enumerate(former.next_step()):
                late = max(late, max(handed + m - b.order // per_round for g in per_rank for b in g))
                rounds.append([sum(work(b, length) for b in g) for g in per_rank])
        loads = np.array(rounds, dtype=np.float64)  # [accum, ranks]
        step = loads.sum(axis=0)
        step_ratios.append(step.max() / step.mean())
        round_ratios.extend((loads.max(axis=1) / loads.mean(axis=1)).tolist())
        slow.append(loads.max(axis=1).sum() / loads.mean(axis=1).sum())
        tokens += per_step * seq_len
    seconds = time.perf_counter() - t0
    step_ratios, round_ratios, slow = map(np.array, (step_ratios, round_ratios, slow))
    return {
        "scheme": scheme, "seq_len": seq_len, "ranks": ranks, "rows": rows, "accum": accum, "steps": steps,
        "window": window if scheme == "c" else 0,
        "step_median": float(np.median(step_ratios)), "step_worst": float(step_ratios.max()),
        "micro_median": float(np.median(round_ratios)), "micro_worst": float(round_ratios.max()),
        "micro_within_5pct": float((round_ratios <= 1.05).mean()),
        "time_over_even": float(slow.mean()),
        "padding": packer.pad_tokens / max(1, packer.total_tokens),
        "late_steps": late / accum if scheme == "c" else 0.0,
        "ms_per_step": 1000 * seconds / steps,
    }


CASES = [  # seq_len, rows per micro-batch, micro-batches per step
    (131072, 1, 1), (131072, 4, 1), (131072, 1, 4), (32768, 1, 1), (32768, 4, 1),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--windows", default="4")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import torch

    rows_out = []
    print(f"{'seq_len':>7} {'rows':>4} {'accum':>5} {'scheme':>6} {'win':>3} | {'step med':>8} {'worst':>6} | "
          f"{'micro med':>9} {'worst':>6} {'<=1.05':>6} | {'t/even':>6} {'pad':>6} {'late':>4} {'ms/step':>7}")
    for seq_len, rows, accum in (CASES[:2] if args.quick else CASES):
        runs = [("a", 0), ("b", 0)] + [("c", int(w)) for w in args.windows.split(",")]
        for scheme, window in runs:
            r = simulate(scheme, seq_len, args.ranks, rows, accum, args.steps, window or 4)
            rows_out.append(r)
            print(f"{seq_len:>7} {rows:>4} {accum:>5} {scheme:>6} {r['window']:>3} | {r['step_median']:8.3f} "
                  f"{r['step_worst']:6.3f} | {r['micro_median']:9.3f} {r['micro_worst']:6.3f} "
                  f"{r['micro_within_5pct']:6.0%} | "
                  f"{r['time_over_even']:6.3f} {r['padding']:6.3f} {r['late_steps']:4.1f} {r['ms_per_step']:7.1f}",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__, "command": "python " + " ".join(sys.argv), "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
