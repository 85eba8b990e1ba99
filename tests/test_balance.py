"""Attention-cost balance at long context (packing.StepFormer) and directory documents (sources, document =
"directory")."""

import json
from collections import Counter

import numpy as np
import pytest

from holotrain.data.packing import Packer, StepFormer, sample_arrays
from holotrain.data.sources import (
    JOIN,
    SourceConfig,
    plan_chunks,
    read_chunk,
    source_files,
    validate_sources,
)
from holotrain.errors import ConfigError

ONES = np.ones(1 << 20, dtype=np.uint32)


def _heavy_tail(seed: int):
    """Log-normal document lengths, median 2,000 tokens, sigma 1.6 (bench/balance.py's): at seq_len 32768, 4% of the
    documents are longer than a sample and they hold 42% of the tokens."""
    rng = np.random.default_rng(seed)
    while True:
        yield int(rng.lognormal(np.log(2000), 1.6)) + 1


def _run(seq_len, ranks, rows, accum, steps, window=4, seed=0, former=True):
    """Per micro-batch, max/mean of the ranks' attention cost; and the packer."""
    packer = Packer(seq_len + 1, max_open=max(8, 2 * ranks * rows * accum))
    lengths, count = _heavy_tail(seed), 0

    def feed():
        nonlocal count
        packer.add(ONES[: next(lengths)], (0, 0, 0, count))
        count += 1

    f = StepFormer(packer, ranks, rows, accum, window)
    ratios = []
    for _ in range(steps):
        if former:
            while f.wants():
                feed()
            loads = [costs for _, costs in f.next_step()]
        else:  # in order, equal count: data.balance = false
            while not packer.has(ranks * rows * accum):
                feed()
            bins = packer.take(ranks * rows * accum)
            per = rows * accum
            loads = [[sum(b.attention_cost(packer.length) for b in bins[r * per + m * rows: r * per + (m + 1) * rows])
                      for r in range(ranks)] for m in range(accum)]
        ratios += [max(m) / np.mean(m) for m in loads]
    return np.array(ratios)


def test_cost_balance_at_8_ranks_beats_token_balance():
    """Seeded heavy tail at seq_len 32768, 8 ranks: with 4 samples per rank per micro-batch every step is within 5% of
    even (in order: 1.4x); with one, the window takes the median from 1.7x to near even."""
    four = _run(32768, 8, 4, 1, 40)
    four_in_order = _run(32768, 8, 4, 1, 40, former=False)
    assert four.max() <= 1.05, four.max()
    assert np.median(four_in_order) > 1.3, np.median(four_in_order)
    one = _run(32768, 8, 1, 1, 60, window=8)
    one_in_order = _run(32768, 8, 1, 1, 60, former=False)
    assert np.median(one) <= 1.06, np.median(one)
    assert np.median(one_in_order) > 1.5, np.median(one_in_order)


@pytest.mark.parametrize("rows,accum", [(1, 1), (2, 3)])
def test_every_piece_once_and_none_later_than_the_window(rows, accum):
    ranks, window, seq_len = 4, 2, 4096
    packer = Packer(seq_len + 1, max_open=16)
    former = StepFormer(packer, ranks, rows, accum, window)
    rng = np.random.default_rng(3)
    added, handed, worst_late, per_round = Counter(), Counter(), 0, ranks * rows
    for step in range(30):
        while former.wants():
            n = int(rng.lognormal(np.log(600), 1.5)) + 1
            packer.add(ONES[:n], (0, 0, 0, len(added)))
            added[(len(added), n)] += 1
        first_round = packer.handed // per_round
        micro_batches = former.next_step()
        assert len(micro_batches) == accum
        for m, (per_rank, costs) in enumerate(micro_batches):
            assert [len(g) for g in per_rank] == [rows] * ranks
            for g, cost in zip(per_rank, costs):
                assert cost == sum(b.attention_cost(packer.length) for b in g)
                for b in g:
                    assert b.used == sum(len(p.tokens) for p in b.pieces) <= packer.length
                    worst_late = max(worst_late, first_round + m - b.order // per_round)
                    for p in b.pieces:
                        handed[p.key[3]] += len(p.tokens)
    left = Counter()
    for b in packer.open + packer.ready:
        for p in b.pieces:
            left[p.key[3]] += len(p.tokens)
    total = handed + left
    assert total == Counter({doc: n for doc, n in added})  # every token of every document, once
    assert worst_late <= window * accum


def test_state_resumes_the_same_samples():
    """The window travels in the packer's state: resumed from a checkpoint's JSON, the same samples follow."""
    lengths = np.random.default_rng(5).lognormal(np.log(1500), 1.6, 4000).astype(int) + 1

    orders = []

    def steps(packer, former, position, n):
        out = []
        for _ in range(n):
            while former.wants():
                packer.add(np.full(lengths[position], position % 1000, dtype=np.uint32), (0, 0, 0, position))
                position += 1
            micro_batches = former.next_step()
            orders.extend(b.order for bins, _ in micro_batches for g in bins for b in g)
            out.append([sample_arrays(g, packer.length, 0)[0] for bins, _ in micro_batches for g in bins])
        return out, position

    def make():
        packer = Packer(2049, max_open=16)
        return packer, StepFormer(packer, 4, 1, 2, 3)

    first = make()
    _, position = steps(*first, 0, 12)
    state = json.loads(json.dumps(first[0].state_dict()))  # what a checkpoint stores
    expected, _ = steps(*first, position, 6)
    assert orders != sorted(orders)  # the window was used: samples went out of order
    second = make()
    second[0].load_state_dict(state)
    got, _ = steps(*second, position, 6)
    assert len(got) == len(expected) == 6
    for a, b in zip(expected, got):
        assert len(a) == len(b) == 8 and all(np.array_equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------
# Directory documents


def test_txt_files_of_a_directory_are_one_document(tmp_path):
    for d, names in {"repo/pkg": ["b.txt", "a.txt"], "repo": ["setup.txt"], "other": ["x.txt"]}.items():
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        for name in names:
            (tmp_path / d / name).write_text(f"{d}/{name} " * 3)
    (tmp_path / "repo" / "blank.txt").write_text("  \n")
    src = SourceConfig(name="t", path=str(tmp_path), document="directory")
    files = source_files(src)
    parts = [read_chunk(c, files, "text", 0) for c in plan_chunks(0, files, 1 << 20, "directory", "file")]
    docs = [t for p in parts for t in p.texts]
    assert docs == ["other/x.txt " * 3, JOIN.join(["repo/setup.txt " * 3]),
                    JOIN.join(["repo/pkg/a.txt " * 3, "repo/pkg/b.txt " * 3])]
    assert sum(p.skipped for p in parts) == 1  # the blank file
    records = [read_chunk(c, files, "text", 0) for c in plan_chunks(0, files, 1 << 20)]
    assert len([t for p in records for t in p.texts]) == 4  # "record": a document per file, as before


def test_jsonl_records_of_a_directory_join_across_chunks(tmp_path):
    """Consecutive records of one directory (the embedded corpus's `file` field) make one document, however the
    file is cut into chunks; a blank line or a bad record ends it, and is counted once."""
    rng = np.random.default_rng(2)
    lines, expected, current, directory, walk = [], [], [], None, 0
    for i in range(300):
        u = rng.random()
        walk += rng.random() < 0.08  # files sorted by path: a directory's come one after another
        if u < 0.03:
            lines.append("{not json")
        elif u < 0.05:
            lines.append("")
        else:
            d = f"lib/{walk}" if u < 0.97 else None
            text = f"doc {i} " + "w" * int(rng.integers(1, 40))
            lines.append(json.dumps({"text": text, **({"file": f"{d}/m{i}.py"} if d else {})}))
            if d is not None and d == directory:
                current.append(text)
                continue
            expected += [JOIN.join(current)] if current else []
            current, directory = [text], d
            if d is None:
                expected.append(text)
                current = []
            continue
        expected += [JOIN.join(current)] if current else []
        current, directory = [], None
    expected += [JOIN.join(current)] if current else []
    (tmp_path / "code.jsonl").write_text("\n".join(lines) + "\n")
    src = SourceConfig(name="code", path=str(tmp_path / "code.jsonl"), document="directory")
    files = source_files(src)
    for chunk_bytes in (37, 512, 1 << 20):
        parts = [read_chunk(c, files, "text", 0) for c in plan_chunks(0, files, chunk_bytes, "directory", "file")]
        assert [t for p in parts for t in p.texts] == expected, chunk_bytes
        assert sum(p.skipped for p in parts) == sum(line == "{not json" for line in lines)
        keys = [k for p in parts for k in p.keys]
        assert len(keys) == len(set(keys)) == len(expected)
    assert max(map(len, expected)) > 5 * max(len(json.loads(line)["text"]) for line in lines if line.startswith('{"'))


def test_directory_documents_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"document must be 'record' or 'directory'"):
        validate_sources([SourceConfig(name="a", path="x", document="repo")])
    with pytest.raises(ConfigError, match="joins text documents"):
        validate_sources([SourceConfig(name="a", path="x", format="chat", document="directory")])
    np.save(tmp_path / "t.npy", np.arange(5, dtype=np.uint16))
    with pytest.raises(ConfigError, match="reads .jsonl or .txt files"):
        source_files(SourceConfig(name="n", path=str(tmp_path / "t.npy"), document="directory"))


def test_balance_window_is_a_checked_config_key():
    import pytest

    from holotrain.config import ConfigError, load_config, resolve

    assert resolve(load_config(None, ["--data.balance_window=8"]), tokenizer_vocab=500).data.balance_window == 8
    with pytest.raises(ConfigError, match="data.balance_window must be >= 1"):
        resolve(load_config(None, ["--data.balance_window=0"]), tokenizer_vocab=500)
