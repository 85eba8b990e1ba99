"""The planner across many nodes, on paper (holotrain/plan/cluster.py): Decoder 3 8B and 70B at a sequence of 8192 on
8, 64 and 512 H200s (nodes of 8, NVLink within, a 400 Gb/s NIC per GPU across), and beside each case the published
configurations and throughput of torchtitan and Megatron for the same model sizes. Also the bubble model's check:
the schedule simulator against the closed forms (holotrain/plan/pipeline.py).

Nothing here runs on a GPU: every figure of holotrain's is the cost model's prediction from the H200's measured rates
(bench/data/plan-h200/machine.json, copied into holotrain/configs/clusters/*.toml). The published figures are quoted
from the files named beside them; MFU is recomputed from their tokens/s with holotrain's FLOP count (6N + 12 L d T,
as torchtitan counts) against the 989 TFLOP/s bf16 dense peak that H100 SXM and H200 share.

  python bench/cluster_plan.py                # markdown tables on stdout
  python bench/cluster_plan.py --json OUT     # and every case's top candidates as JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from holotrain.model import Decoder, ModelArgs
from holotrain.model.costs import flops_per_token
from holotrain.plan.cluster import ZERO_BUBBLE, Layout, evaluate, load_cluster, plan_cluster
from holotrain.plan.pipeline import SCHEDULES, bubble_share_formula, pipeline_step

CLUSTERS = Path(__file__).resolve().parents[1] / "holotrain" / "configs" / "clusters"
SEQ = 8192
PEAK = 989e12
MODELS = {
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256),
}
# (model, GPUs, sequences per step). 8B: torchtitan's 8B runs' 2 sequences per GPU; 70B: torchtitan's 70B run's
# global batch of 512 sequences (4.2M tokens) at every scale. 128 and 256 GPUs are torchtitan's own scales.
CASES = [("8B", 8, 16), ("8B", 64, 128), ("8B", 512, 1024), ("8B", 128, 256),
         ("70B", 8, 512), ("70B", 64, 512), ("70B", 512, 512), ("70B", 256, 512)]

TT = "pytorch/torchtitan@b5bcd76"
TT_BENCH = f"{TT} benchmarks/llama3_h100_202412_torchtitan.md"
TT_ASYNC = f"{TT} benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TT_H200 = f"{TT} benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
MB = "NVIDIA-NeMo/Megatron-Bridge@067f987 docs/performance-summary-archive.md, 25.11 container, DGX-H100"
MLM = "NVIDIA/Megatron-LM@d98e8a6 README.md and images/model_table.png (Megatron-Core r0.8.0, H100)"
# (model, GPUs, system, what, tokens/s per GPU or None, reported MFU or TFLOP/s, precision, the layout in this model
# (or None), source). tokens/s are per GPU as published.
PUBLISHED = [
    ("8B", 8, "torchtitan", "FSDP 8, local batch 2, selective op AC, compile", 6667, "33-39% (text)", "bf16",
     Layout(8, 1, 1, 1, "none", 1, 2, 1, "pointwise"), f"{TT_BENCH} Table 1"),
    ("8B", 8, "torchtitan", "the same + Float8", 8532, "n/a", "fp8", None, f"{TT_BENCH} Table 1"),
    ("8B", 8, "Megatron-Bridge", "FSDP 8, GBS 128, MBS 1, GA 16", 14451, "744 TFLOP/s", "fp8 (current scaling)",
     Layout(8, 1, 1, 1, "none", 1, 1, 16, "none"), f"{MB}"),
    ("8B", 64, "torchtitan", "FSDP 8 x TP 8 (async TP), per-op SAC, local batch 12", 4809.4, "n/a", "bf16",
     None, f"{TT_ASYNC} (8b table)"),
    ("8B", 64, "torchtitan on H200", "FSDP 64, local batch 2, compile + Float8 (8 nodes)", 10753, "n/a", "fp8",
     None, f"{TT_H200}"),
    ("8B", 128, "torchtitan", "FSDP 128, local batch 2, selective op AC, compile", 6514, "n/a", "bf16",
     Layout(128, 1, 1, 1, "none", 1, 2, 1, "pointwise"), f"{TT_BENCH} Table 3"),
    ("8B", 96, "Megatron-LM", "GPT 7.1B (MHA, seq 4096): TP 2 x DP 48, batch 192", None, "47% (465.9 TFLOP/s)",
     "not stated", None, MLM),
    ("70B", 256, "torchtitan", "FSDP 32 x TP 8 (async TP), full AC, local batch 16, compile", 652.4, "n/a", "bf16",
     Layout(32, 8, 1, 1, "none", 1, 16, 1, "full"), f"{TT_ASYNC} (70b table)"),
    ("70B", 256, "torchtitan", "the same + Float8 (2D + AsyncTP)", 876, "n/a", "fp8", None, f"{TT_BENCH} Table 4"),
    ("70B", 64, "Megatron-Bridge", "TP 4 x PP 8 (VP 5), GBS 128, MBS 1, GA 64", 1602, "719 TFLOP/s",
     "fp8 (current scaling)", Layout(2, 4, 1, 8, "interleaved", 5, 1, 64, "none"), f"{MB}"),
    ("70B", 768, "Megatron-LM", "GPT 70B (MHA, 84 layers, seq 4096): TP 8 x PP 2 x DP 48, batch 384", None,
     "42% (419.7 TFLOP/s)", "not stated", None, MLM),
]


def bubble_check() -> list[str]:
    """The simulator's bubble share against the closed form, F = B = W, equal stages."""
    rows = ["| schedule | p | m | simulated bubble | closed form | peak micro-batches in flight (first rank) |",
            "|---|---:|---:|---:|---:|---:|"]
    for sched, v in [(s, None) for s in SCHEDULES] + [("zb1p", 1)]:
        for p, m in ((4, 8), (4, 16), (8, 16), (8, 64)):
            step = pipeline_step(sched, p, m, 1.0, 1.0, 1.0, virtual=v)
            formula = bubble_share_formula(sched, p, m, virtual=v)
            name = sched + (" (one stage a rank: ZB-H1)" if v == 1 else "")
            rows.append(f"| {name} | {p} | {m} | {step.bubble_share:.4f} | "
                        f"{'-' if formula is None else f'{formula:.4f}'} | {step.peak_micro_batches[0]:g} |")
    return rows


def _family(c) -> str:
    return "no pp" if c.layout.pp == 1 else c.layout.schedule


def _split(c) -> str:
    ph = c.phases
    comm = ph.get("tp", 0) + ph.get("cp", 0) + ph.get("fsdp", 0) + ph.get("pp_p2p", 0)
    return (f"{ph['compute']:.2f} / {comm:.2f} ({ph.get('tp', 0):.2f} tp, {ph.get('cp', 0):.2f} cp, "
            f"{ph.get('fsdp', 0):.2f} fsdp, {ph.get('pp_p2p', 0):.3f} p2p) / {ph.get('bubble', 0):.2f}")


def run_case(model: str, gpus: int, seqs: int):
    cluster = load_cluster(CLUSTERS / "h200-8.toml").with_nodes(gpus // 8)
    t0 = time.perf_counter()
    plan = plan_cluster(MODELS[model], cluster, SEQ, seqs * SEQ, include_rejected=True)
    took = time.perf_counter() - t0
    return cluster, plan, took


def _row(rank, c) -> str:
    every = (f"{c.checkpoint_interval_steps} steps ({c.checkpoint_interval_s / 60:.0f} min)"
             if c.checkpoint_interval_steps else "-")
    return (f"| {rank} | {c.layout.label} | {c.step_s:.2f} | {c.tokens_per_s_per_gpu:,.0f} | {c.mfu:.1%} | "
            f"{_split(c)} | {c.bubble_share:.1%} | {c.memory_bytes / 1e9:.0f} | {every} | {c.goodput_loss:.2%} |")


def case_table(model: str, gpus: int, seqs: int, plan: list, took: float, cluster) -> list[str]:
    fits = [c for c in plan if c.fits]
    rows = [(f"**Llama 3 {model} on {gpus} H200s**, {seqs} x {SEQ} tokens a step ({seqs * SEQ / 1e6:.2f}M): "
             f"{len(plan)} layouts, {len(fits)} fit, planned in {took:.1f} s.")]
    if not fits:
        best = plan[0]
        rows.append(f"Nothing fits. The least memory: {best.layout.label} {best.why_not} ("
                    + ", ".join(f"{v / 1e9:.0f} GB {k}" for k, v in best.memory.items() if v >= 0.5e9) + ").")
        return rows
    rows += ["", ("| rank | layout | step s | tokens/s/GPU | MFU | compute / comm / bubble s | idle, all ranks | "
                  "GB/GPU | ckpt every | goodput loss |"), "|---:|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    shown, seen = [], set()
    for c in fits[:3]:
        shown.append((len(shown) + 1, c))
        seen.add(_family(c))
    for c in fits[3:]:  # the best of each other family
        if _family(c) not in seen:
            seen.add(_family(c))
            shown.append((fits.index(c) + 1, c))
    for rank, c in shown:
        rows.append(_row(rank, c))
    # The best zero-bubble layout again as if its blocks compiled (torch cannot): what the eager blocks cost it.
    zb = next((c for c in fits if c.layout.schedule in ZERO_BUBBLE), None)
    if zb is not None:
        what_if = evaluate(MODELS[model], cluster, SEQ, dataclasses.replace(zb.layout, what_if_compiled=True))
        if what_if.fits:
            rank = 1 + sum(c.step_s < what_if.step_s for c in fits)
            rows.append(_row(f"({rank})", what_if))
    return rows


def published_table(cluster_for) -> list[str]:
    """Each published run beside this model's prediction for its layout on the H200 cluster, in bf16."""
    rows = [("| model | GPUs | system | configuration | precision | tokens/s/GPU | MFU (6N + 12LdT, 989 TF) | "
             "reported | this model, same layout on H200 (bf16) | source |"),
            "|---|---:|---|---|---|---:|---:|---|---|---|"]
    for model, gpus, system, what, tps, reported, precision, layout, source in PUBLISHED:
        f = flops_per_token(MODELS[model], SEQ)
        mfu = "-"
        if tps is not None:
            mfu = f"{tps * f / PEAK:.1%}" + ("" if precision == "bf16" else " (not an MFU: FP8)")
        ours = "-"
        if layout is not None:
            c = evaluate(MODELS[model], cluster_for(layout.gpus), SEQ, layout)
            ours = f"{c.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {c.mfu:.1%}" if c.fits else f"{c.why_not}"
            if not c.fits:  # the same layout with every block recomputed
                full = evaluate(MODELS[model], cluster_for(layout.gpus), SEQ, dataclasses.replace(layout, ac="full"))
                ours += (f"; with ac full {full.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {full.mfu:.1%}" if full.fits
                         else "; with ac full too")
        rows.append(f"| {model} | {gpus} | {system} | {what} | {precision} | "
                    f"{'-' if tps is None else f'{tps:,.0f}'} | {mfu} | {reported} | {ours} | {source} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write every case's top candidates here")
    args = ap.parse_args()
    base = load_cluster(CLUSTERS / "h200-8.toml")
    print(f"torch {torch.__version__}; cluster: {base.gpus_per_node} x {base.machine.name} a node, intra-node "
          f"collectives at {base.intra_node_busbw / 1e9:.0f} GB/s, {base.inter_node_bytes_s * 8 / 1e9:.0f} Gb/s a GPU "
          f"across at {base.inter_node_efficiency:.0%}, node MTBF {base.node_mtbf_hours:.0f} h, restart "
          f"{base.restart_s:.0f} s\n")
    print("### The bubble model: simulator against closed form (F = B = W, equal stages)\n")
    print("\n".join(bubble_check()) + "\n")
    out = {}
    for model, gpus, seqs in CASES:
        cluster, plan, took = run_case(model, gpus, seqs)
        print("\n".join(case_table(model, gpus, seqs, plan, took, cluster)) + "\n")
        out[f"{model}-{gpus}"] = [
            {"layout": c.layout.label, "fits": c.fits, "why_not": c.why_not, "step_s": c.step_s if c.fits else None,
             "phases": c.phases, "mfu": c.mfu if c.fits else None, "memory_gb": c.memory_bytes / 1e9,
             "bubble_share": c.bubble_share, "simulated": c.simulated,
             "checkpoint_interval_steps": c.checkpoint_interval_steps, "goodput_loss": c.goodput_loss}
            for c in plan[:20]]
    print("### Published configurations beside the model\n")
    print("\n".join(published_table(lambda n: base.with_nodes(max(1, n // base.gpus_per_node)))))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
