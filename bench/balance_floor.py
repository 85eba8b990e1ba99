"""How even a one-step-late router bias can make the experts' load at a job's batch size: `holotrain train` run in
this process with the sigmoid router's forward watched. In every EVERY-th training forward of each MoE block, the
scores are split into the batch's first and second halves of sequences; a bias is solved (model.moe.balancing_bias)
on each half from the block's current bias, and the max/mean expert load is counted on the second half with

  now    the bias the block routed with (what the run got)
  self   the bias solved on that same half (a bias that knows the tokens it routes: about 1)
  cross  the bias solved on the first half (the same weights, other documents: the floor of any bias set from an
         earlier batch, before the weights move)

Usage: python bench/balance_floor.py [--every 10] [--after 100] [--out FILE.jsonl] -- TRAIN ARGS...
(e.g. `-- --config moe-balance --model.router_bias_update=solve --training.compile=false`; eager, since the printing
breaks a compiled block's graph). Prints each layer's median of the three after step AFTER (the forward count, not
the step, when the job accumulates micro-batches)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from holotrain import cli
from holotrain.model import moe


def max_over_mean(scores: torch.Tensor, bias: torch.Tensor, k: int, n_experts: int) -> float:
    chosen = (scores + bias).topk(k, dim=-1).indices.flatten()
    load = torch.bincount(chosen, minlength=n_experts).float()
    return (load.max() / load.mean()).item()


def watch(every: int, rows: list[dict]) -> None:
    """MoE.record wrapped: the three figures of every `every`-th training forward of each block into `rows`."""
    record, forwards, layer_of = moe.MoE.record, {}, {}

    def watched(self, logits, scores, counts, weights):
        if torch.is_grad_enabled() and self.expert_bias is not None:
            n = forwards[id(self)] = forwards.get(id(self), 0) + 1
            layer = layer_of.setdefault(id(self), len(layer_of))
            if (n - 1) % every == 0:
                with torch.no_grad():
                    s, bias, k, E = scores.detach().float(), self.expert_bias, self.top_k, self.n_experts
                    first, second = s[:s.shape[0] // 2], s[s.shape[0] // 2:]
                    row = {"forward": n, "layer": layer,
                           "now": max_over_mean(second, bias, k, E),
                           "self": max_over_mean(second, moe.balancing_bias(second, bias, k), k, E),
                           "cross": max_over_mean(second, moe.balancing_bias(first, bias, k), k, E)}
                rows.append(row)
                print("balance_floor: " + json.dumps(row), flush=True)
        return record(self, logits, scores, counts, weights)

    moe.MoE.record = watched


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--after", type=int, default=100)
    p.add_argument("--out", default="")
    a = p.parse_args(argv[:split])
    rows: list[dict] = []
    watch(a.every, rows)
    rc = cli.main(["train", *argv[split + 1:]])
    late = [r for r in rows if r["forward"] > a.after]
    for layer in sorted({r["layer"] for r in late}):
        mine = [r for r in late if r["layer"] == layer]
        print(f"balance_floor: layer {layer} after forward {a.after} ({len(mine)} forwards), median max/mean: "
              + ", ".join(f"{key} {statistics.median(r[key] for r in mine):.2f}" for key in ("now", "self", "cross")))
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rc


if __name__ == "__main__":
    sys.exit(main())
