"""Summarizes the output folder of bench/gpu/resilience.sh's part checkpoint: blocking per save, tokens/s with
background saves against none, and recovery after SIGKILL. Usage: python bench/checkpoint_summary.py OUT_DIR"""

import json
import re
import sys
from pathlib import Path


def rows(out: Path, name: str) -> list[dict]:
    p = out / f"{name}.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []


def training_rate(r: list[dict], first_step: int) -> float:
    """Tokens per second over the logged intervals after `first_step` (total tokens / total time; the first steps,
    compile among them, left out). An interval's time includes the blocking part of a save made in it."""
    tokens = seconds = 0.0
    for prev, x in zip(r, r[1:]):
        if prev["step"] >= first_step:
            n = (x["step"] - prev["step"]) * x["tokens"] / x["step"]
            tokens += n
            seconds += n / x["tokens_per_s"]
    return tokens / seconds if seconds else float("nan")


def run_line(name: str, r: list[dict], first_step: int, *keys: str) -> str:
    """One training run's summary line for the bench scripts: tokens/s after `first_step`, the last row's MFU and
    loss, the peak memory, and the last row's `keys`."""
    last = r[-1]
    extra = "".join(f"; {k} {last.get(k)}" for k in keys)
    return (f"{name}: {training_rate(r, first_step):,.0f} tokens/s over steps {first_step + 1}+; MFU (last row) "
            f"{last.get('mfu')}; peak memory {max(x.get('mem.peak_gb') or 0 for x in r):.1f} GB; loss at "
            f"{last['step']}: {last['loss']:.4f}{extra}")


def saves(r: list[dict]) -> list[tuple[int, float]]:
    """(step of the logged row, blocking seconds) for each row whose interval held a save (a save at step N,
    made after N's row, falls in the next one)."""
    out, prev = [], 0
    for x in r:
        if x.get("time.checkpoint"):
            out.append((x["step"], round(x["time.checkpoint"] * (x["step"] - prev), 3)))
        prev = x["step"]
    return out


def main(out: Path) -> None:
    base, every = rows(out, "nockpt"), rows(out, "every100")
    if base and every:
        a, b = training_rate(base, 20), training_rate(every, 20)
        print(f"tokens/s over steps 21-300: no checkpoints {a:,.0f}; checkpoint.every=100 {b:,.0f}; ratio {b / a:.3f}")
        print(f"every100: blocking per save (step, s) {saves(every)}; background writes (s) "
              f"{[x['checkpoint.write_s'] for x in every if x.get('checkpoint.write_s')]}")
    mem50 = rows(out, "mem50")
    if base and mem50:
        a, b = training_rate(base, 20), training_rate(mem50, 20)
        print(f"tokens/s over steps 21-300: no checkpoints {a:,.0f}; checkpoint.memory_every=50 {b:,.0f}; ratio "
              f"{b / a:.3f}; RAM snapshot blocking (step, s) {saves(mem50)}")
    before, after = rows(out, "memkill-before"), rows(out, "memkill")
    if before and after:
        print(f"memkill: RAM snapshot blocking (step, s) {saves(before)}")
        killed_after = before[-1]["step"]
        log = (out / "memkill-resume.log").read_text()
        m = re.search(r"resuming from (.*) \(step (\d+)\)", log)
        resumed = int(m.group(2)) if m else None
        new = [x for x in after if resumed is not None and x["step"] > resumed]
        start = float((out / "memkill.start").read_text())
        if new:
            print(f"memkill: killed after step {killed_after}; resumed from {m.group(1)} at step {resumed} "
                  f"({killed_after - resumed} steps lost); process start to step {new[0]['step']} logged: "
                  f"{new[0]['wall_time'] - start:.1f} s; goodput.recovery_s in the last row: "
                  f"{after[-1].get('goodput.recovery_s')}")
        else:
            print(f"memkill: no new step after the restart (resume line: {m.group(0) if m else None})")
    none = rows(out, "offnone")
    for name in ("offload", "offmem"):
        off = rows(out, name)
        if off:
            print(f"{name}: blocking per save (step, s) {saves(off)}; background writes (s) "
                  f"{[x['checkpoint.write_s'] for x in off if x.get('checkpoint.write_s')]}")
            if none:
                a, b = training_rate(none, 10), training_rate(off, 10)
                print(f"{name}: tokens/s over steps 11-60 {b:,.0f} against {a:,.0f} without checkpoints "
                      f"(ratio {b / a:.3f})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
