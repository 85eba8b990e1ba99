"""Summarizes bench/gpu/models.sh's eval part (cost): the training rate over the whole run with evaluation's
seconds counted (tokens / (training seconds + eval seconds) over every logged interval, compilation included on
both sides) and over the steps after the first 20 (the steady rate), for the run with evaluation against the run
without. Usage: python bench/eval_summary.py OUT_DIR"""

import json
import sys
from pathlib import Path


def rate(rows: list[dict], first_step: int) -> tuple[float, float, int]:
    """(tokens per second, eval seconds, evals) over the intervals after `first_step`, eval time counted."""
    tokens = seconds = eval_s = 0.0
    evals = 0
    for prev, x in zip([{"step": 0}] + rows, rows):
        if prev["step"] < first_step:
            continue
        n = (x["step"] - prev["step"]) * x["tokens"] / x["step"]
        tokens += n
        seconds += n / x["tokens_per_s"]
        if x.get("time.eval"):
            eval_s += x["time.eval"]
            evals += 1
    return (tokens / (seconds + eval_s) if seconds else float("nan")), eval_s, evals


def main(out: Path) -> None:
    runs = {}
    for name in ("eval", "noeval"):
        path = out / f"{name}.jsonl"
        if path.is_file():
            runs[name] = [json.loads(line) for line in path.read_text().splitlines() if '"tokens_per_s"' in line]
    for first in (0, 20):
        line = []
        for name, rows in runs.items():
            r, eval_s, evals = rate(rows, first)
            line.append(f"{name} {r:,.0f} tokens/s ({evals} evals, {eval_s:.1f} s)")
        if len(runs) == 2:
            a, b = rate(runs["eval"], first)[0], rate(runs["noeval"], first)[0]
            line.append(f"cost {1 - a / b:.2%} (target <= 2%)")
        print(f"steps {first + 1}+: " + "; ".join(line))
    for x in runs.get("eval", []):
        if x.get("time.eval"):
            print(f"  eval at step {x['step']}: {x['time.eval']:.2f} s, {x['eval.tokens']:,} target tokens, "
                  f"loss {x['eval.loss']:.4f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
