"""Summarizes the output folder of bench/gpu/models.sh's families part: tokens/s and MFU per family (the median
of the rows after step 30), the Qwen3 shape's MFU against the 1.4b's, and the planner's first prediction against
the planned run. Usage: python bench/families_summary.py OUT_DIR"""

import json
import statistics
import sys
from pathlib import Path


def steady(path: Path) -> dict | None:
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if '"tokens_per_s"' in line]
    rows = [r for r in rows if r.get("step", 0) > 30 and r.get("tokens_per_s")]
    if not rows:
        return None
    mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "mfu": statistics.median(mfu) if mfu else None, "rows": len(rows),
            "peak_gb": max(r.get("mem.peak_gb") or 0 for r in rows)}


def main(out: Path) -> None:
    runs = {name: steady(out / f"{name}.jsonl") for name in
            ("llama-1.4b", "qwen3-1.7b", "plan-1.4b", "plan-qwen3", "plan-1.4b-8k")}
    for name, s in runs.items():
        if s:
            print(f"{name}: {s['tokens_per_s']:,.0f} tokens/s, MFU {s['mfu']:.3f}, peak {s['peak_gb']:.1f} GB "
                  f"({s['rows']} rows after step 30)")
    a, b = runs["llama-1.4b"], runs["qwen3-1.7b"]
    if a and b and a["mfu"] and b["mfu"]:
        print(f"qwen3-1.7b MFU / 1.4b MFU: {b['mfu'] / a['mfu']:.3f} (target >= 0.95)")
    for name in ("plan-1.4b", "plan-qwen3", "plan-1.4b-8k"):
        plan_path = out / f"{name}-plan.json"
        if not plan_path.is_file() or not runs[name]:
            continue
        plan = json.loads(plan_path.read_text())
        chosen = next(c for c in plan["candidates"] if c["chosen"])
        predicted, measured = plan["planned"]["predicted_tokens_per_s"], runs[name]["tokens_per_s"]
        print(f"{name}: chosen {chosen['label']}: predicted {predicted:,.0f} tokens/s before any trial, measured "
              f"{measured:,.0f}: {predicted / measured - 1:+.1%} (target within 7%); GPU "
              f"{chosen['predicted']['gpu_gb']:.1f} GB predicted, {runs[name]['peak_gb']:.1f} measured")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
