"""Reading the run directory's JSONL files (metrics, telemetry, samples) as they may be left by a crash."""

from __future__ import annotations

import json
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
