"""The memory plan and the time model against the long-context runs of bench/gpu/memory.sh (part long_context),
whose metrics.jsonl files are kept in bench/data/long-context/. CPU only.

  python bench/long_context_model.py

Predicted peak GPU memory (the plan's, for the checkpointing the run chose) against the run's max_memory_allocated,
and predicted step time against each logged interval's that did not compile.

The time model's attention work depends on the documents. Each run's rows record them per interval: the share of
micro-batches with a document boundary (data.doc_masked_share, counted since the start) and the masked ones' share of
the causal triangle's 128 x 128 blocks that flex_attention visits (attention_block_density); they go to the time
model as Calibration.masked_share and attention_density, interval by interval. The machine: the recorded H200 probe
(bench/data/plan-h200/machine.json) with the dense causal attention rate bench/flex_rate.py measured at T = 32768
in the same session as the runs (bench/data/long-context/flex_rate.json). Nothing is fitted to the runs."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.config import batch_layout  # noqa: E402
from holotrain.model import build  # noqa: E402
from holotrain.plan.cost import Calibration, Machine, predict, with_settings  # noqa: E402
from holotrain.plan.planner import job_config  # noqa: E402
from holotrain.train.resolve import model_args  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
# run file, shipped config, preset, seq_len, batch, the memory settings the run chose ("long-32768": long
# documents, every row one document's piece; the others: the embedded corpus)
FULL = "memory.activation_checkpointing"
RUNS = [
    ("hl-8192", "1.4b", "1.4b", 8192, 1, {FULL: "none"}),
    ("long-32768", "1.4b", "1.4b", 32768, 1, {FULL: "none"}),
    ("hl-32768", "1.4b", "1.4b", 32768, 1, {FULL: "none"}),
    ("hl-131072", "1.4b", "1.4b", 131072, 1, {FULL: "selective"}),
    ("hl-262144", "1.4b", "1.4b", 262144, 1, {FULL: "full"}),
    ("7b-32768", "1.4b", "7b", 32768, 1, {FULL: "full", "memory.activation_checkpointing_blocks": 24}),
    ("7b-2048", "1.4b", "7b", 2048, 16, {FULL: "full", "memory.activation_checkpointing_blocks": 24}),
]


def overrides(preset: str, seq: int, batch: int) -> list[str]:
    """The run's command line (bench/gpu/memory.sh (part long_context)), less what the time model does not read."""
    return [f"--model.preset={preset}", f"--data.seq_len={seq}", f"--training.batch_size={batch}"]


def intervals(rows: list[dict]) -> list[tuple[dict, Calibration]]:
    """The timed intervals with their documents as the time model takes them: the interval's share of micro-batches
    with a boundary (from the cumulative data.doc_masked_share; the micro-batches per step cancel) and the masked
    ones' block density. Intervals that compiled are left out: the first, and the first to take the other kernel
    (dense or masked attention) after it (host.compile_s > 0)."""
    out = []
    for before, row in zip(rows, rows[1:]):
        if row.get("host.compile_s"):
            continue
        masked = ((row["data.doc_masked_share"] or 0) * row["step"]
                  - (before["data.doc_masked_share"] or 0) * before["step"]) / (row["step"] - before["step"])
        density = row.get("attention_block_density")
        out.append((row, Calibration(masked_share=min(1.0, max(0.0, masked)) if density is not None else 0.0,
                                     attention_density=density if density is not None else 1.0)))
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    machine = Machine(**json.loads((DATA / "plan-h200/machine.json").read_text()))
    flex = json.loads((DATA / "long-context/flex_rate.json").read_text())
    machine.attention_flops = next(r["flops_s"] for r in flex["rows"] if r["T"] == 32768 and r["docs"] == "one")
    print(f"machine: {machine.name}, GEMMs {machine.gemm_flops * 1e-12:.0f} TFLOP/s, dense causal attention "
          f"{machine.attention_flops * 1e-12:.0f} TFLOP/s")
    print(f"{'run':12} {'AC':14} {'peak plan':>9} {'measured':>9} {'err':>6}  {'masked':>6} {'density':>7}  "
          f"{'step plan':>9} {'measured':>8} {'err':>6}  {'worst interval':>14}")
    hosts = []
    for name, config, preset, seq, batch, settings in RUNS:
        path = DATA / "long-context" / f"{name}.jsonl"
        if not path.exists():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        cfg = with_settings(job_config(config, overrides(preset, seq, batch)), settings)
        ac, blocks = cfg.memory.activation_checkpointing, cfg.memory.activation_checkpointing_blocks
        with torch.device("meta"):
            model = build(model_args(cfg))
        timed = intervals(rows)
        micro, accum = batch_layout(cfg, 1)
        predicted = [predict(model, cfg, machine, docs, micro, accum) for _, docs in timed]
        plan_s = statistics.mean(p.step_s for p in predicted)
        step_s = statistics.mean(r["step_s"] for r, _ in timed)
        worst = max((p.step_s / r["step_s"] - 1 for p, (r, _) in zip(predicted, timed)), key=abs)
        peak = max(r["mem.peak_gb"] for r in rows) * 1e9
        gpu = predicted[0].gpu_bytes
        masked = statistics.mean(d.masked_share for _, d in timed)
        density = [d.attention_density for _, d in timed if d.masked_share]
        label = f"{ac}" + (f" {blocks}/{cfg.model.n_layers}" if blocks else "")
        label += f" seg{cfg.memory.activation_checkpointing_segment}" if cfg.memory.activation_checkpointing_segment > 1 else ""
        label += f" host{cfg.memory.activation_offload_blocks}" if cfg.memory.activation_offload_blocks else ""
        rss = max((r.get("mem.host_rss_gb") or 0 for r in rows), default=0)
        if rss:
            hosts.append((name, predicted[0].host_bytes, rss * 1e9))
        print(f"{name:12} {label:14} {gpu / 1e9:>9.1f} {peak / 1e9:>9.1f} {gpu / peak - 1:>+6.1%}  {masked:>6.2f} "
              f"{statistics.mean(density) if density else 1.0:>7.3f}  {plan_s:>9.2f} {step_s:>8.2f} "
              f"{plan_s / step_s - 1:>+6.1%}  {worst:>+14.1%}", flush=True)
    for name, plan, rss in hosts:
        print(f"host {name:12} plan {plan / 1e9:>6.1f} GB, the process's largest RSS {rss / 1e9:>6.1f} GB "
              f"({plan / rss - 1:+.1%})")
    print("masked: the timed intervals' share of micro-batches with a document boundary; density: the masked ones' "
          "share of the causal triangle's blocks; step: the mean over the timed intervals, each predicted with its "
          "own documents")


if __name__ == "__main__":
    main()
