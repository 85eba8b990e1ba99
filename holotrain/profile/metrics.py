"""Metrics sinks: RUN_DIR/metrics.jsonl (one JSON object per logged step), TensorBoard, terminal."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from holotrain.jsonl import truncate_jsonl


def _fmt(row: dict) -> str:
    parts = [f"step {row['step']}", f"loss {row['loss']:.4f}"]
    if row.get("eval.loss") is not None:
        parts.append(f"eval {row['eval.loss']:.4f}")
    parts.append(f"lr {row['lr']:.2e}")
    parts.append(f"{row['tokens_per_s']:,.0f} tok/s")
    if row.get("mfu") is not None:
        parts.append(f"mfu {row['mfu'] * 100:.1f}%")
    if row.get("mem.peak_gb") is not None:
        parts.append(f"mem {row['mem.peak_gb']:.1f} GB")
    if row.get("moe.max_load") is not None:
        parts.append(f"moe max/mean {row['moe.max_load']:.2f}")
    return "  ".join(parts)


def layer_scalars(row: dict) -> dict[str, float]:
    """A mixture-of-experts row's per-layer lists (moe.load_max_over_mean, moe.<figure>_by_layer, of the blocks in
    moe.layers) as one scalar per block, under TensorBoard's names: moe/load_max_over_mean/layer_3."""
    layers = row.get("moe.layers") or []
    out = {}
    for key, values in row.items():
        if key.startswith("moe.") and key not in ("moe.layers", "moe.tokens_per_expert") and isinstance(values, list):
            name = key.removesuffix("_by_layer").replace(".", "/")
            out.update({f"{name}/layer_{layer}": v for layer, v in zip(layers, values)
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)})
    return out


class MetricsLogger:
    """Only rank 0 constructs one; other ranks log nothing."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, tensorboard: bool, progress: bool,
                 sinks: tuple = ()):
        self.sinks = sinks  # more sinks of the rows (wandb_sink.WandbSink): log(row), close()
        self.path = run_dir / "metrics.jsonl"
        truncate_jsonl(self.path, start_step)
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=start_step + 1)
        self.console = Console(stderr=False)
        self.progress = None
        if progress and sys.stdout.isatty():
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                TimeRemainingColumn(), console=self.console,
            )
            self.task = self.progress.add_task("", total=total_steps, completed=start_step)
            self.progress.start()

    def log(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(key.replace(".", "/"), value, row["step"])
            for key, value in layer_scalars(clean).items():  # moe.*: one scalar per MoE block
                self.tb.add_scalar(key, value, row["step"])
            for sample in clean.get("eval.samples") or ():  # TensorBoard's text tab, one entry per prompt
                self.tb.add_text(f"eval/samples/{sample['prompt'][:40]}", sample["text"], row["step"])
        for sink in self.sinks:
            sink.log(clean)
        if self.progress is not None:
            self.progress.update(self.task, completed=row["step"], description=_fmt(row))
        else:
            self.console.print(_fmt(row), highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()
        try:
            for sink in self.sinks:
                sink.close()
        finally:
            self.file.close()
