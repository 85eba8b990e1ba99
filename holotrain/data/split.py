"""The held-out share of a training source (validation): whole documents, chosen by a hash of the source's name, the
file's name and the document's place in it. A pure function of where a document is, so the carve-out is the same in
every loader, after a resume, after a loader is replaced, and on every rank; training never reads a held-out
document and evaluation reads only those."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path


def held_out(source: str, path: str | Path, offset: int, share: float) -> bool:
    if share <= 0:
        return False
    return zlib.crc32(f"{source}\0{Path(path).name}\0{offset}".encode()) / 2**32 < share


@dataclass(frozen=True)
class Split:
    """One side of a source's carve-out: `held` keeps the held-out documents (evaluation), else the others."""

    source: str
    share: float
    held: bool = False

    @property
    def everything(self) -> bool:
        return not self.held and self.share <= 0

    def keeps(self, path: str | Path, offset: int) -> bool:
        return held_out(self.source, path, offset, self.share) == self.held
