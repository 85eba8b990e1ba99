"""Reading the run directory's JSONL files (metrics, telemetry, samples) as they may be left by a crash."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _row(line: str) -> dict | None:
    """The JSON object on one line, or None for a blank, truncated or malformed line (a crash during a write)."""
    line = line.strip()
    if not line:
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a JSONL file, in order; blank, truncated or malformed lines are skipped, not an error."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return [row for row in map(_row, f) if row is not None]


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop the rows of a per-step JSONL file after `last_step` (a resumed run re-runs those steps), and a row a crash
    left half written, atomically: the resumed run appends to whole lines."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        kept = [line.strip() for line in f if (row := _row(line)) is not None and row.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
