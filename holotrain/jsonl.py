"""Reading the run directory's JSONL files (metrics, telemetry, samples) as they may be left by a crash."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a JSONL file, in order; blank, truncated or malformed lines (a crash during a
    write) are skipped, not an error."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop the rows of a per-step JSONL file after `last_step` (a resumed run re-runs those steps), atomically."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
