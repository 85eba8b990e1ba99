"""Packing documents into fixed-length samples (best fit) and balancing attention cost across ranks.

A sample holds `length` tokens (the model's inputs plus one for the shifted targets) made of document
pieces; documents are never merged across a piece boundary, and the model masks attention per piece.
A document longer than a sample is cut into sample-sized pieces. A chat document carries a mask of the tokens
trained on (its assistant turns); each piece keeps its slice of it, and a target is kept only where the token it
predicts is one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class Piece:
    tokens: np.ndarray  # uint32
    key: tuple  # (source, epoch, file, offset, start token within the document)
    mask: np.ndarray | None = None  # bool per token: trained on (chat documents); None: every token is


@dataclass(eq=False)
class Bin:
    pieces: list[Piece] = field(default_factory=list)
    used: int = 0

    def cost(self) -> int:
        """Attention work of this sample: sum of squared piece lengths (causal, masked per document)."""
        return sum(len(p.tokens) ** 2 for p in self.pieces)


class Packer:
    """Best-fit bin packing over a window of open samples; deterministic in the order of documents."""

    def __init__(self, length: int, max_open: int):
        self.length, self.max_open = length, max_open
        self.open: list[Bin] = []
        self.ready: list[Bin] = []
        self.pad_tokens = 0
        self.total_tokens = 0

    def add(self, tokens: np.ndarray, key: tuple, mask: np.ndarray | None = None) -> None:
        for start in range(0, len(tokens), self.length):
            stop = start + self.length
            self._place(Piece(tokens[start:stop], key[:4] + (start,), None if mask is None else mask[start:stop]))

    def _place(self, piece: Piece) -> None:
        n = len(piece.tokens)
        best, best_room = None, self.length + 1
        for b in self.open:
            room = self.length - b.used
            if n <= room < best_room:
                best, best_room = b, room
        if best is None:
            best = Bin()
            self.open.append(best)
        best.pieces.append(piece)
        best.used += n
        if best.used == self.length:
            self.open.remove(best)
            self.ready.append(best)
        elif len(self.open) > self.max_open:
            fullest = max(self.open, key=lambda b: b.used)  # close the fullest; the rest may still fill
            self.open.remove(fullest)
            self.ready.append(fullest)

    def has(self, n: int) -> bool:
        return len(self.ready) >= n

    def take(self, n: int) -> list[Bin]:
        out, self.ready = self.ready[:n], self.ready[n:]
        for b in out:
            self.pad_tokens += self.length - b.used
            self.total_tokens += self.length
        return out

    def state_dict(self) -> dict:
        """Plain lists (a checkpoint stores it as JSON): each piece is [key, tokens], or [key, tokens, mask runs]."""
        def enc(bins):
            return [[_encode_piece(p) for p in b.pieces] for b in bins]

        return {"open": enc(self.open), "ready": enc(self.ready), "pad": self.pad_tokens, "total": self.total_tokens}

    def load_state_dict(self, state: dict) -> None:
        def dec(bins):
            out = []
            for pieces in bins:
                b = Bin([_decode_piece(p) for p in pieces])
                b.used = sum(len(p.tokens) for p in b.pieces)
                out.append(b)
            return out

        self.open, self.ready = dec(state["open"]), dec(state["ready"])
        self.pad_tokens, self.total_tokens = int(state["pad"]), int(state["total"])


def _encode_piece(piece: Piece) -> list:
    out = [list(piece.key), piece.tokens.tolist()]
    if piece.mask is not None:
        out.append(mask_runs(piece.mask))
    return out


def _decode_piece(encoded) -> Piece:
    key, tokens = tuple(encoded[0]), np.asarray(encoded[1], dtype=np.uint32)
    mask = runs_mask(encoded[2], len(tokens)) if len(encoded) > 2 else None
    return Piece(tokens, key, mask)


def mask_runs(mask: np.ndarray) -> list[int]:
    """A bool mask as the [start, stop, start, stop, ...] of its runs of True: compact in a checkpoint's JSON."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return edges.tolist()


def runs_mask(runs: list[int], n: int) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    for start, stop in zip(runs[::2], runs[1::2]):
        mask[start:stop] = True
    return mask


def sample_arrays(bins: list[Bin], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """inputs [n, length-1], targets [n, length-1] (-100 where nothing is to be predicted) and doc_ids
    [n, length-1] (piece index within the row; padding is one more piece)."""
    n = len(bins)
    tokens = np.full((n, length), pad_id, dtype=np.int64)
    docs = np.empty((n, length), dtype=np.int64)
    # Which tokens are trained on: only chat pieces restrict it, so text-only samples do without the array.
    trained = np.ones((n, length), dtype=bool) if any(p.mask is not None for b in bins for p in b.pieces) else None
    for r, b in enumerate(bins):
        pos = 0
        for d, p in enumerate(b.pieces):
            tokens[r, pos : pos + len(p.tokens)] = p.tokens
            docs[r, pos : pos + len(p.tokens)] = d
            if p.mask is not None:
                trained[r, pos : pos + len(p.tokens)] = p.mask
            pos += len(p.tokens)
        docs[r, pos:] = len(b.pieces)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].copy()
    # A position predicts the next token only inside its own document piece (and never padding), and only a token
    # that is trained on.
    same_doc = docs[:, :-1] == docs[:, 1:]
    is_pad = docs[:, 1:] == np.array([len(b.pieces) for b in bins])[:, None]
    targets[~same_doc | is_pad] = -100
    if trained is not None:
        targets[~trained[:, 1:]] = -100
    return np.ascontiguousarray(inputs), targets, np.ascontiguousarray(docs[:, :-1])


def balance(costs: list[int], ranks: int) -> list[list[int]]:
    """Split sample indices into `ranks` equal-count groups with near-equal total cost.

    Longest-processing-time first under a cardinality limit, then swaps between the most loaded rank and
    any other while a swap lowers the pair's maximum.
    """
    n = len(costs)
    per = n // ranks
    order = sorted(range(n), key=lambda i: (-costs[i], i))
    groups: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in order:
        r = min((r for r in range(ranks) if len(groups[r]) < per), key=lambda r: (load[r], r))
        groups[r].append(i)
        load[r] += costs[i]
    improved = True
    while improved:
        improved = False
        hi = max(range(ranks), key=lambda r: load[r])
        for lo in sorted(range(ranks), key=lambda r: load[r]):
            if lo == hi:
                continue
            # The swap that brings this pair closest to even, if it lowers the pair's maximum.
            best, best_peak = None, load[hi]
            for a in groups[hi]:
                for b in groups[lo]:
                    delta = costs[a] - costs[b]
                    peak = max(load[hi] - delta, load[lo] + delta)
                    if delta > 0 and peak < best_peak:
                        best, best_peak = (a, b, delta), peak
            if best is not None:
                a, b, delta = best
                groups[hi][groups[hi].index(a)] = b
                groups[lo][groups[lo].index(b)] = a
                load[hi] -= delta
                load[lo] += delta
                improved = True
                break
    return [sorted(g) for g in groups]
