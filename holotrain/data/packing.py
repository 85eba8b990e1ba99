"""Packing documents into fixed-length samples (best fit) and balancing attention cost across ranks.

A sample holds `length` tokens (the model's inputs plus one for the shifted targets) made of document
pieces; documents are never merged across a piece boundary, and the model masks attention per piece.
A document longer than a sample is cut into sample-sized pieces. A chat document carries a mask of the tokens
trained on (its assistant turns); each piece keeps its slice of it, and a target is kept only where the token it
predicts is one of them.
"""

from __future__ import annotations

import bisect
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
    order: int = 0  # how many samples the packer closed before this one: its place in the in-order sequence

    def cost(self) -> int:
        """Attention work of this sample: sum of squared piece lengths (causal, masked per document)."""
        return sum(len(p.tokens) ** 2 for p in self.pieces)

    def attention_cost(self, length: int) -> int:
        """cost() plus the padding's: the document mask gives padding a segment of its own, and it is computed."""
        return self.cost() + (length - self.used) ** 2


class Packer:
    """Best-fit bin packing over a window of open samples; deterministic in the order of documents."""

    def __init__(self, length: int, max_open: int):
        self.length, self.max_open = length, max_open
        self.open: list[Bin] = []
        self.ready: list[Bin] = []
        self.pad_tokens = 0
        self.total_tokens = 0
        self.closed = 0  # samples closed so far (each one's Bin.order)

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
            self._close(best)
        elif len(self.open) > self.max_open:
            self._close(max(self.open, key=lambda b: b.used))  # close the fullest; the rest may still fill

    def _close(self, b: Bin) -> None:
        self.open.remove(b)
        b.order = self.closed
        self.closed += 1
        self.ready.append(b)

    def has(self, n: int) -> bool:
        return len(self.ready) >= n

    def take(self, n: int) -> list[Bin]:
        return self.take_at(list(range(min(n, len(self.ready)))))

    def take_at(self, indices: list[int]) -> list[Bin]:
        """The ready samples at these positions, in that order; the others stay ready, in their order."""
        out = [self.ready[i] for i in indices]
        chosen = set(indices)
        self.ready = [b for i, b in enumerate(self.ready) if i not in chosen]
        for b in out:
            self.pad_tokens += self.length - b.used
            self.total_tokens += self.length
        return out

    def state_dict(self) -> dict:
        """Plain lists (a checkpoint stores it as JSON): each piece is [key, tokens], or [key, tokens, mask runs]."""
        def enc(bins):
            return [[_encode_piece(p) for p in b.pieces] for b in bins]

        return {"open": enc(self.open), "ready": enc(self.ready), "pad": self.pad_tokens, "total": self.total_tokens,
                "closed": self.closed, "ready_order": [b.order for b in self.ready]}

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
        # A state written before samples were numbered: the ready ones come next, in their order.
        self.closed = int(state.get("closed", self.handed + len(self.ready)))
        for b, order in zip(self.ready, state.get("ready_order", range(self.handed, self.closed))):
            b.order = int(order)

    @property
    def handed(self) -> int:
        """Samples taken so far: in order, the next one to go is the one with Bin.order == handed."""
        return self.total_tokens // self.length


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


# ----------------------------------------------------------------------------------------------
# Cost-aware step formation: each micro-batch's samples chosen from a window of ready ones


class StepFormer:
    """Hands out each step's samples, `rows` per rank in each of `accum` micro-batches over `ranks` data-parallel
    ranks, so that in every micro-batch the ranks' attention costs are near their mean.

    Ranks meet at every layer of every micro-batch (FSDP gathers each block's weights), so each micro-batch is
    balanced on its own. The step's own samples, next in order, are tried first: split over micro-batches and ranks,
    they leave what the step trains on as it is whatever the number of ranks, and they are kept if every micro-batch
    comes within KEEP_ORDER of even. Otherwise each micro-batch is chosen from a window of `window` steps of ready
    samples: a long document's sample costs up to seq_len^2, a sample of short documents a few percent of that, and
    with one sample per rank no split of one step's samples evens that out (WLB-LLM defers its outlier documents
    likewise). No sample trains more than `window` steps after the step it would train in, in order: one that late
    is taken first. The window is the packer's ready list, so the packer's state carries it.
    """

    KEEP_ORDER = 1.02

    def __init__(self, packer: Packer, ranks: int, rows: int, accum: int, window: int):
        self.packer, self.ranks, self.rows, self.accum, self.window = packer, ranks, rows, accum, window
        self.per_round = ranks * rows

    def wants(self) -> bool:
        """Whether the window needs more documents packed before the next step is formed."""
        return len(self.packer.ready) < self.window * self.accum * self.per_round

    def next_step(self) -> list[tuple[list[list[Bin]], list[int]]]:
        """Per micro-batch of the next step: each rank's samples, and each rank's attention cost."""
        p = self.packer
        in_order = sorted(range(len(p.ready)), key=lambda i: p.ready[i].order)[: self.accum * self.per_round]
        kept = self._split_evenly(in_order)
        if kept is not None:
            return kept
        out = []
        for _ in range(self.accum):
            groups = self._choose(list(range(len(p.ready))))
            bins = iter(p.take_at([i for g in groups for i in g]))
            ranks = [[next(bins) for _ in g] for g in groups]
            out.append((ranks, exchange_pieces(ranks, p.length)))
        return out

    def _choose(self, candidates: list[int]) -> list[list[int]]:
        """choose_round over these ready samples (positions in packer.ready): per rank, positions in packer.ready."""
        p = self.packer
        now = p.handed // self.per_round
        bins = [p.ready[i] for i in candidates]
        lag = [now - b.order // self.per_round for b in bins]  # micro-batches late, against in order
        groups = choose_round([b.attention_cost(p.length) for b in bins], lag,
                              [d >= self.window * self.accum for d in lag], self.ranks, self.rows)
        return [[candidates[j] for j in g] for g in groups]

    def _split_evenly(self, step_set: list[int]) -> list | None:
        """The step's own samples split into micro-batches, each evened on copies of its samples (exchange_pieces
        moves documents between them); None, the packer untouched, if a micro-batch stays uneven."""
        p, left, rounds = self.packer, list(step_set), []
        for _ in range(self.accum):
            groups = self._choose(left)
            chosen = {i for g in groups for i in g}
            left = [i for i in left if i not in chosen]
            ranks = [[Bin(list(p.ready[i].pieces), p.ready[i].used, p.ready[i].order) for i in g] for g in groups]
            loads = exchange_pieces(ranks, p.length)
            if max(loads) * self.ranks > self.KEEP_ORDER * sum(loads):
                return None
            rounds.append((groups, ranks, loads))
        p.take_at([i for groups, _, _ in rounds for g in groups for i in g])
        return [(ranks, loads) for _, ranks, loads in rounds]


def choose_round(costs: list[int], lag: list[int], due: list[bool], ranks: int, rows: int) -> list[list[int]]:
    """Which `ranks * rows` of these samples make the next micro-batch, `rows` per rank, so that the ranks' summed
    costs are near equal. `lag`: how late each sample is against in order (larger: older); `due`: it must go now.
    Three starts, each improved by local search (swaps with the samples left out and between ranks): the oldest
    samples; the ones nearest in cost to the oldest; the run of samples nearest each other in cost that holds the
    due ones (one sample per rank needs similar samples together). The best wins, the oldest on a tie. Returns
    sample indices per rank, each sorted."""
    k = ranks * rows
    n = len(costs)
    if n < k:
        raise ValueError(f"{n} ready samples, {k} needed")
    c = np.asarray(costs, dtype=np.float64)
    age = np.asarray(lag, dtype=np.int64)
    by_age = sorted(range(n), key=lambda i: (-lag[i], i))
    must = [i for i in by_age if due[i]][:k]
    rest = [i for i in by_age if not due[i]]
    oldest = must + rest[: k - len(must)]
    anchor = np.log1p(c[must]).mean() if must else np.log1p(c[by_age[0]])
    near = sorted(rest, key=lambda i: (abs(np.log1p(c[i]) - anchor), -lag[i], i))
    fixed = np.zeros(n, dtype=bool)
    fixed[must] = True
    best, best_ratio = None, None
    for start in (oldest, must + near[: k - len(must)], _tightest_run(c, must, k)):
        groups = [[start[j] for j in g] for g in balance([costs[i] for i in start], ranks)]
        groups = _improve(groups, c, age, fixed, ranks)
        loads = np.array([c[g].sum() for g in groups])
        ratio = loads.max() / loads.mean() if loads.sum() else 1.0
        if best is None or ratio < best_ratio * (1 - 1e-9):
            best, best_ratio = groups, ratio
    return [sorted(g) for g in best]


def _tightest_run(c: np.ndarray, must: list[int], k: int) -> list[int]:
    """The k samples, consecutive in cost order, with the least max/mean among the runs that hold every due one;
    where none does, the due ones and the cheapest others."""
    by_cost = sorted(range(len(c)), key=lambda i: (c[i], i))
    place = {i: j for j, i in enumerate(by_cost)}
    first = max((place[i] for i in must), default=len(c) - 1) - k + 1
    last = min((place[i] for i in must), default=0)
    best, best_ratio = None, None
    for s in range(max(0, first), min(last, len(c) - k) + 1):
        run = by_cost[s : s + k]
        ratio = c[run[-1]] / max(c[run].mean(), 1.0)
        if best is None or ratio < best_ratio:
            best, best_ratio = run, ratio
    if best is None:
        due = set(must)
        best = must + [i for i in by_cost if i not in due][: k - len(must)]
    return best


# A micro-batch within this of even is left as it is: the samples stay closer to in order.
_EVEN_ENOUGH = 1.005


def _improve(groups: list[list[int]], c: np.ndarray, age: np.ndarray, fixed: np.ndarray, ranks: int) -> list[list[int]]:
    """Local search on max/mean of the ranks' loads: a sample of the most or least loaded rank swapped for one left
    out, or two samples swapped between the most loaded rank and a light one. Each move lowers max/mean, so it
    ends; ties go to the oldest sample left out."""
    taken = np.zeros(len(c), dtype=bool)
    for g in groups:
        taken[g] = True
    loads = np.array([c[g].sum() for g in groups])
    for _ in range(8 * int(taken.sum()) + 16):
        total = loads.sum()
        if not total or loads.max() * ranks <= _EVEN_ENOUGH * total:
            break
        best, best_ratio = None, loads.max() * ranks / total * (1 - 1e-9)
        free = np.flatnonzero(~taken)
        order = np.argsort(loads, kind="stable")
        hi, lo = int(order[-1]), int(order[0])
        if len(free):
            for r in (hi, lo):
                other_max = np.delete(loads, r).max(initial=0.0)
                for x in groups[r]:
                    if fixed[x]:
                        continue
                    trial = np.maximum(other_max, loads[r] - c[x] + c[free]) * ranks / (total - c[x] + c[free])
                    m = trial.min()
                    if m < best_ratio:
                        pick = free[trial <= m * (1 + 1e-12)]
                        y = int(pick[np.lexsort((pick, -age[pick]))[0]])
                        best, best_ratio = ("out", r, x, y), m
        if len(groups[hi]) > 1:
            a = np.array(groups[hi])
            for q in order[: min(ranks - 1, 8)]:  # the least loaded ranks
                q = int(q)
                if q == hi:
                    continue
                b = np.array(groups[q])
                d = c[a][:, None] - c[b][None, :]
                rest_max = np.delete(loads, [hi, q]).max(initial=0.0)
                trial = np.maximum(rest_max, np.maximum(loads[hi] - d, loads[q] + d)) * ranks / total
                m = trial.min()
                if m < best_ratio:
                    i, j = np.unravel_index(int(np.argmin(trial)), trial.shape)
                    best, best_ratio = ("ranks", hi, int(a[i]), q, int(b[j])), m
        if best is None:
            break
        if best[0] == "out":
            _, r, x, y = best
            groups[r][groups[r].index(x)] = y
            taken[x], taken[y] = False, True
            loads[r] += c[y] - c[x]
        else:
            _, r, x, q, y = best
            groups[r][groups[r].index(x)] = y
            groups[q][groups[q].index(y)] = x
            loads[r] += c[y] - c[x]
            loads[q] += c[x] - c[y]
    return groups


def exchange_pieces(ranks: list[list[Bin]], length: int, tries: int = 6) -> list[int]:
    """Evens a micro-batch's ranks further by moving documents between its samples, where choosing whole samples
    cannot (one sample per rank): a piece of the most loaded rank's sample for shorter pieces of the same total
    length from a lighter rank's sample (each side fits what it gets). Cost moves from the one to the other and the
    micro-batch's total stays; no piece leaves the micro-batch, so none trains later. Returns each rank's cost."""
    loads = [sum(b.attention_cost(length) for b in g) for g in ranks]
    n = len(ranks)
    for _ in range(2 * sum(len(b.pieces) for g in ranks for b in g)):
        total = sum(loads)
        order = sorted(range(n), key=lambda r: (loads[r], r))
        hi = order[-1]
        if not total or loads[hi] * n <= _EVEN_ENOUGH * total:
            break
        others_max = max((loads[r] for r in order[:-1]), default=0)
        best, best_peak = None, loads[hi]
        # The heavy rank's costliest samples against the cheapest of the lightest ranks: where the moves are.
        heavy = sorted(ranks[hi], key=lambda b: -b.attention_cost(length))[:4]
        for q in order[: min(n - 1, 4)]:
            if loads[q] >= best_peak:
                break
            for x in heavy:
                for y in sorted(ranks[q], key=lambda b: b.attention_cost(length))[:4]:
                    m = _best_exchange(x, y, length, loads[hi], loads[q], tries)
                    if m is not None and max(others_max, m[0]) < best_peak:
                        best, best_peak = (x, y, m[1], m[2], q), max(others_max, m[0])
        if best is None:
            break
        x, y, piece, shorter, q = best
        x.pieces.remove(piece)
        y.pieces.append(piece)
        for s in shorter:
            y.pieces.remove(s)
            x.pieces.append(s)
        moved = len(piece.tokens) - sum(len(s.tokens) for s in shorter)
        x.used -= moved
        y.used += moved
        for r in (hi, q):
            loads[r] = sum(b.attention_cost(length) for b in ranks[r])
    return loads


def _best_exchange(x: Bin, y: Bin, length: int, load_x: int, load_y: int, tries: int):
    """A piece of x for shorter pieces of y, of the lengths both rooms allow: (the larger of the two ranks' loads
    after it, the piece, y's pieces) for the one that leaves it lowest, or None. x's largest pieces are tried."""
    room_x, room_y = length - x.used, length - y.used
    best = None
    for piece in sorted(x.pieces, key=lambda p: -len(p.tokens))[:tries]:
        n = len(piece.tokens)
        shorter = sorted((p for p in y.pieces if len(p.tokens) < n), key=lambda p: len(p.tokens))
        taken = _pieces_summing_to(shorter, n - room_y, n + room_x)  # y must fit the piece, x what comes back
        if taken is None:
            continue
        got = sum(len(p.tokens) for p in taken)
        moved = n * n - sum(len(p.tokens) ** 2 for p in taken)
        new_x = load_x - moved - room_x**2 + (room_x + n - got) ** 2
        new_y = load_y + moved - room_y**2 + (room_y - n + got) ** 2
        if best is None or max(new_x, new_y) < best[0]:
            best = (max(new_x, new_y), piece, taken)
    return best


def _pieces_summing_to(pieces: list[Piece], lo: int, hi: int) -> list[Piece] | None:
    """Some of `pieces` (sorted by length) whose lengths sum into [lo, hi]: the shortest first until lo is reached,
    then, if that overshoots hi, one of them dropped or swapped for one left out. None if that finds nothing."""
    if lo <= 0:
        return []
    taken, got = [], 0
    for p in pieces:
        taken.append(p)
        got += len(p.tokens)
        if got >= lo:
            break
    if got < lo:
        return None
    if got <= hi:
        return taken
    cut_lo, cut_hi = got - hi, got - lo  # what must come off
    for p in reversed(taken):
        if cut_lo <= len(p.tokens) <= cut_hi:
            return [q for q in taken if q is not p]
    left = pieces[len(taken) :]
    left_lengths = [len(p.tokens) for p in left]
    for p in reversed(taken):  # p for a piece of length in [len(p) - cut_hi, len(p) - cut_lo]
        j = bisect.bisect_left(left_lengths, len(p.tokens) - cut_hi)
        if j < len(left) and left_lengths[j] <= len(p.tokens) - cut_lo:
            return [q for q in taken if q is not p] + [left[j]]
    return None
