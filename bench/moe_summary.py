"""Summarizes the output folder of bench/gpu/models.sh's moe part. Usage: python bench/moe_summary.py OUT_DIR

train + peer: holotrain's tokens/s, TFLOP/s and MFU by active parameters (the median of the logged rows after the
first, which holds compilation) with the levers the planner chose, each transformers peer's (bench/moe_peer.py,
per experts implementation and precision), and holotrain over the fastest peer (targets: >= 1.5x, >= 300 TFLOP/s).
balance: for the auxiliary-loss-free runs (a bias solved within each forward on the softmax router, "batch", the
config as shipped, or on the sigmoid, "sigbatch"; the sigmoid router's bias solved after each step, "solve", or moved
by the sign rule, "sigmoid"; the shipped bias weighting the chosen experts by the biased logits, "batchw"), the
shipped bias with the router z-loss ("batchz") or the balance loss ("batchaux") beside it, the router with no balancing
("none") and the auxiliary-loss run, the largest max/mean expert load over the layers and the logged rows after step
100 (target <= 1.25), and each run's final loss (the mean of the last 50 steps' rows) over the auxiliary-loss
run's (target within 1%)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

BALANCE_AFTER = 100
LAST_STEPS = 50
# bench/gpu/models.sh's balance runs; "aux" is the reference, "none" (no balancing) shows what balance costs.
BALANCE_RUNS = ("batch", "batchw", "batchz", "batchaux", "sigbatch", "solve", "sigmoid", "none", "aux")


def rows_of(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{") and '"step"' in line]


def median_of(rows: list[dict], key: str):
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def train_figures(out: Path) -> dict | None:
    rows = [r for r in rows_of(out / "moe-train.jsonl") if r.get("tokens_per_s")]
    steady = rows[1:] or rows
    if not steady:
        return None
    figures = {key: median_of(steady, key) for key in
               ("tokens_per_s", "tflops", "mfu", "attention_block_density", "attention_flops_share")}
    figures["peak_gb"] = max((r.get("mem.peak_gb") or 0 for r in steady), default=0)
    figures["rows"] = len(steady)
    plan = out / "moe-train-plan.json"
    if plan.is_file():
        chosen = [c for c in json.loads(plan.read_text()).get("candidates", []) if c.get("chosen")]
        figures["plan"] = chosen[0]["label"] if chosen else None
    return figures


def peer_figures(out: Path) -> list[dict]:
    peers = []
    for log in sorted(out.glob("peer-*.log")):
        result = log.with_suffix(".json")
        rows = json.loads(result.read_text())["rows"] if result.is_file() else []
        peers += rows or [{"experts": log.stem[len("peer-"):], "precision": "", "error": "no result (see the log)"}]
    return peers


def load_ratios(row: dict) -> list[float]:
    """Every layer's max/mean expert load in a metrics row: the values of the keys naming max_over_mean (a number or
    a list per layer), else per-layer loads (a moe.* key holding a list of lists of counts) divided out here."""
    ratios = []
    for key, value in row.items():
        if "max_over_mean" in key:
            ratios += [float(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, (int, float))]
    if ratios:
        return ratios
    for key, value in row.items():
        if key.startswith("moe.") and isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            for layer in value:
                mean = sum(layer) / len(layer) if layer else 0
                if mean > 0:
                    ratios.append(max(layer) / mean)
    return ratios


def balance_figures(path: Path) -> dict | None:
    rows = rows_of(path)
    if not rows:
        return None
    last = max(r["step"] for r in rows)
    late = [load_ratios(r) for r in rows if r["step"] > BALANCE_AFTER]
    late = [x for x in late if x]
    losses = [r["loss"] for r in rows if r["step"] > last - LAST_STEPS and isinstance(r.get("loss"), (int, float))]
    speeds = [r["tokens_per_s"] for r in rows if r["step"] > BALANCE_AFTER and r.get("tokens_per_s")]
    return {"steps": last, "tokens_per_s": statistics.median(speeds) if speeds else None, "max_ratio": max(max(x) for x in late) if late else None,
            "median_ratio": statistics.median(max(x) for x in late) if late else None,
            "final_loss": statistics.mean(losses) if losses else None,
            "top_gate": median_of([r for r in rows if r["step"] > BALANCE_AFTER], "moe.top_gate"),
            "moe_keys": sorted({k for r in rows for k in r if k.startswith("moe.")})}


def main(out: Path) -> None:
    train, peers = train_figures(out), peer_figures(out)
    if train:
        mfu = f", MFU {train['mfu']:.3f}" if train["mfu"] else ""
        density = train["attention_block_density"]
        print(f"holotrain: {train['tokens_per_s']:,.0f} tokens/s, {train['tflops']:.1f} TFLOP/s (active){mfu}, peak "
              f"{train['peak_gb']:.1f} GB ({train['rows']} rows; plan: {train.get('plan') or 'none'}; attention "
              f"{(train['attention_flops_share'] or 0):.1%} of the FLOPs"
              + (f", document-mask block density {density:.2f}" if density else "") + ")")
        print(f"holotrain TFLOP/s by active parameters: {train['tflops']:.1f} (target >= 300)")
    best = None
    for peer in peers:
        name = f"{peer['experts']} {peer.get('precision', '')}".strip()
        if "error" in peer:
            print(f"peer {name}: {peer['error']}")
            continue
        mfu = f", MFU {peer['mfu']:.3f}" if peer.get("mfu") else ""
        print(f"peer {name}: {peer['tokens_per_s']:,.0f} tokens/s, {peer['tflops']:.1f} TFLOP/s (active){mfu}, peak "
              f"{peer['peak_mem_gb'] or 0:.1f} GB, micro {peer['micro']}x{peer['accum']}, checkpointing "
              f"{peer['checkpointing']}" + (f"; holotrain {train['tokens_per_s'] / peer['tokens_per_s']:.2f}x"
                                            if train else ""))
        if best is None or peer["tokens_per_s"] > best["tokens_per_s"]:
            best = {**peer, "name": name}
    if train and best:
        print(f"holotrain / fastest peer ({best['name']}): {train['tokens_per_s'] / best['tokens_per_s']:.2f}x "
              "tokens/s (target >= 1.5x; the peer on random tokens over the full causal square)")
    # A run named KIND.N is another run of KIND's settings (models.sh: BALANCE="aux aux.2"); each kind's loss is the
    # mean over its runs.
    runs = {p.stem[len("balance-"):]: balance_figures(p) for p in sorted(out.glob("balance-*.jsonl"))
            if p.stem[len("balance-"):].split(".")[0] in BALANCE_RUNS}
    for name, b in runs.items():
        if not b:
            continue
        if b["max_ratio"] is None:
            print(f"balance {name}: no per-layer load in the rows after step {BALANCE_AFTER} (moe.* keys: "
                  f"{', '.join(b['moe_keys']) or 'none'})")
        else:
            print(f"balance {name}: max/mean expert load after step {BALANCE_AFTER}: worst {b['max_ratio']:.3f}, "
                  f"median row's worst layer {b['median_ratio']:.3f} (target <= 1.25)")
        if b["final_loss"] is not None:
            print(f"balance {name}: loss over the last {LAST_STEPS} of {b['steps']} steps {b['final_loss']:.4f}")
        if b["top_gate"] is not None:
            print(f"balance {name}: a token's largest weight over its k weights' sum {b['top_gate']:.3f} (median "
                  f"after step {BALANCE_AFTER}; 1/k when they count alike)")
        if b["tokens_per_s"]:
            print(f"balance {name}: {b['tokens_per_s']:,.0f} tokens/s (the median of the rows after step "
                  f"{BALANCE_AFTER})")
    losses = {kind: [b["final_loss"] for name, b in runs.items()
                     if name.split(".")[0] == kind and b and b["final_loss"] is not None] for kind in BALANCE_RUNS}
    if losses["aux"]:
        aux = statistics.mean(losses["aux"])
        for kind in BALANCE_RUNS:
            if kind != "aux" and losses[kind]:
                ratio = statistics.mean(losses[kind]) / aux
                print(f"balance: {kind} loss / auxiliary-loss run's: {ratio:.4f} ({ratio - 1:+.2%}; target within 1%; "
                      f"means over {len(losses[kind])} and {len(losses['aux'])} runs)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
