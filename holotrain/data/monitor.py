"""Skipped records, made visible: the trainer's view of what the loaders could not use (a line that is not JSON, a
record without its text field, a conversation the template refuses).

At each logged step the trainer passes the plane's per-source counts (plane.Constructor.stats()["sources"]) to a
SkipMonitor. A source with new skips since the last logged step gets one warning line on the main rank; a source
that skips more than data.max_skip_fraction of what it reads stops the run with one ConfigError line, on every rank
alike (every rank sees the same counts at the same step).
"""

from __future__ import annotations

from holotrain.errors import ConfigError

# How small counts are judged. The loaders count a whole chunk of records at once (data.chunk_mb of input, often
# thousands of records), so a source's share is always that of whole chunks. It is judged once the source has read
# MIN_JUDGED records, or once it has been read through (a small source: then the share is exact). Before that, a few
# bad lines at the top of a file are only warned about: they would be a large share of a small count.
MIN_JUDGED = 1000


def skip_line(name: str, records: int, skipped: int, first: str | None) -> str:
    """`data source 'sft': 12 of 480 records skipped so far (first: /x/sft.jsonl:17: not valid JSON)`."""
    return f"data source {name!r}: {skipped} of {records} records skipped so far (first: {first})"


class SkipMonitor:
    def __init__(self, max_fraction: float, is_main: bool):
        self.max_fraction = max_fraction
        self.is_main = is_main  # prints its warnings (every rank raises alike)
        self._warned: dict[str, int] = {}  # source -> skips counted at its last warning

    def check(self, sources: dict[str, dict]) -> None:
        """`sources`: per source name, {"records", "skipped", "first", "passes"} so far. Prints a warning per source
        with new skips (main rank); raises ConfigError for a source over data.max_skip_fraction."""
        for name, s in sources.items():
            records, skipped = s["records"], s["skipped"]
            judged = records >= MIN_JUDGED or s.get("passes", 0) >= 1
            if judged and skipped > self.max_fraction * records:
                raise ConfigError(f"{skip_line(name, records, skipped, s['first'])}: more than "
                                  f"data.max_skip_fraction = {self.max_fraction:g}; fix or remove the file, or raise "
                                  "data.max_skip_fraction")
            if skipped > self._warned.get(name, 0):
                self._warned[name] = skipped
                if self.is_main:
                    print(f"holotrain: warning: {skip_line(name, records, skipped, s['first'])}", flush=True)
