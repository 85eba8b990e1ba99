"""Where a training run's GPU memory peaks, and what is alive then.

Records the CUDA caching allocator's history (torch.cuda.memory._record_memory_history) through a short
`holotrain train` run in this process, replays the allocations and frees, and prints the peak, the stack of the
allocation that reached it, and the live memory at that moment grouped by the line of code that allocated it
(compiled code is named by its generated file and line, with the line's text). Writes OUT/peak.txt, and
OUT/snapshot.pickle for https://pytorch.org/memory_viz when --keep-snapshot is given.

Usage (GPU machine, repo root):
  python3 bench/memory_peak.py OUT_DIR [--keep-snapshot] -- --config 1.4b --training.batch_size=16 --training.steps=3
"""

from __future__ import annotations

import argparse
import linecache
import os
import pickle
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _where(frames: list[dict]) -> str:
    """The innermost frame in holotrain or in generated (compiled) code, else the innermost Python frame."""
    chosen = None
    for f in frames:
        name = f.get("filename", "")
        if "holotrain/" in name or "torchinductor" in name:
            chosen = f
            break
    if chosen is None:
        chosen = next((f for f in frames if f.get("filename", "").endswith(".py")), frames[0] if frames else None)
    if chosen is None:
        return "(no stack)"
    text = linecache.getline(chosen["filename"], chosen["line"]).strip()[:90]
    return f"{os.path.basename(chosen['filename'])}:{chosen['line']} {chosen.get('name', '')} | {text}"


def peak_report(snapshot: dict, top: int = 25) -> str:
    """The replayed peak of allocated bytes, the stack that reached it, and the live bytes there by allocation site.
    Memory allocated before the recorded history began is not in the trace: it shows as a base under the peak."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    base = sum(b["size"] for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated")
    live: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
    sites: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    alive: dict[int, dict] = {}
    for e in events[:peak_at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    for e in alive.values():
        key = _where(e.get("frames", []))
        sites[key] += e["size"]
        counts[key] += 1
    lines = [f"{len(events)} events; traced peak {peak / 1e9:.2f} GB at event {peak_at} (live at the end of the "
             f"trace: {total / 1e9:.2f} GB; allocated now: {base / 1e9:.2f} GB)"]
    if peak_at >= 0:
        lines.append("stack of the allocation that reached the peak (innermost first):")
        for f in events[peak_at].get("frames", [])[:25]:
            if f.get("filename", "").endswith(".py"):
                lines.append(f"  {f['filename']}:{f['line']} {f.get('name', '')}")
    lines.append(f"live at the peak, by allocation site (top {top}):")
    for key, size in sorted(sites.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {size / 1e9:7.2f} GB  {counts[key]:5d} x  {key}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--keep-snapshot", action="store_true")
    parser.add_argument("--max-entries", type=int, default=2_000_000)
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    import torch

    from holotrain.cli import main as holotrain_main

    args.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    try:
        code = holotrain_main(["train", *train_args])
    finally:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    if args.keep_snapshot:
        with open(args.out / "snapshot.pickle", "wb") as f:
            pickle.dump(snapshot, f)
    report = peak_report(snapshot)
    (args.out / "peak.txt").write_text(report + "\n")
    print(report)
    print(f"max_memory_allocated: {torch.cuda.max_memory_allocated() / 1e9:.2f} GB; holotrain exit {code}")


if __name__ == "__main__":
    main()
