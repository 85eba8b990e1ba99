import json

import numpy as np
import pytest

from holotrain.config import ConfigError, DataConfig
from holotrain.data import TokenBatches, prepare_corpus


def test_stdlib_corpus_is_built_once_and_cached(tmp_path):
    cfg = DataConfig(max_corpus_mb=0.5, vocab_size=400, cache_dir=str(tmp_path))
    first = prepare_corpus(cfg)
    assert first.vocab_size == 400
    assert len(first.tokens) > 50_000
    text = first.tokenizer.decode(first.tokens[:200].tolist())
    assert "import" in text or "def " in text or '"""' in text
    second = prepare_corpus(cfg)
    assert second.directory == first.directory
    assert np.array_equal(np.asarray(first.tokens), np.asarray(second.tokens))


def test_jsonl_and_txt_sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "a.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"body": f"document number {i} says hello world " * 5}) + "\n")
    (src / "b.txt").write_text("plain text file " * 300)
    cfg = DataConfig(dataset=str(src), text_field="body", vocab_size=300, cache_dir=str(tmp_path / "cache"))
    corpus = prepare_corpus(cfg)
    assert "document number 0" in corpus.tokenizer.decode(corpus.tokens[:50].tolist())


def test_malformed_jsonl_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"nope": 1}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        prepare_corpus(DataConfig(dataset=str(bad), cache_dir=str(tmp_path / "c")))
    with pytest.raises(ConfigError, match="data.dataset"):
        prepare_corpus(DataConfig(dataset=str(tmp_path / "nothing-*.jsonl"), cache_dir=str(tmp_path / "c")))


def _step_batches(tokens, world, micro, accum, seq_len=16, steps=3):
    """All (input) rows each step sees, in global order, for a given world size and micro-batch."""
    loaders = [TokenBatches(tokens, seq_len, seed=5, rank=r, world_size=world) for r in range(world)]
    out = []
    for _ in range(steps):
        rows = []
        for m in range(accum):
            for ld in loaders:
                rows.append(ld.micro_batch(m, micro)[0])
        out.append(np.concatenate([r.numpy() for r in rows]))
        for ld in loaders:
            ld.advance(world * micro * accum)
    return out


def test_global_batch_is_independent_of_world_size():
    tokens = np.arange(5000, dtype=np.uint16)
    one = _step_batches(tokens, world=1, micro=8, accum=1)
    two = _step_batches(tokens, world=2, micro=4, accum=1)
    accum = _step_batches(tokens, world=2, micro=2, accum=2)
    for a, b, c in zip(one, two, accum):
        assert sorted(map(tuple, a)) == sorted(map(tuple, b)) == sorted(map(tuple, c))


def test_targets_are_inputs_shifted_and_epochs_reshuffle():
    tokens = np.arange(1000, dtype=np.uint16)
    ld = TokenBatches(tokens, seq_len=10, seed=1)
    x, y = ld.micro_batch(0, 4)
    assert (x[:, 1:] == y[:, :-1]).all()
    seen = set()
    for _ in range(ld.num_samples // 3):
        seen.update(int(r[0]) for r in ld.micro_batch(0, 3)[0])
        ld.advance(3)
    assert len(seen) == ld.num_samples // 3 * 3  # no repeats within an epoch


def test_resume_position_is_exact():
    tokens = np.arange(3000, dtype=np.uint16)
    a = TokenBatches(tokens, 12, seed=2)
    for _ in range(7):
        a.advance(5)
    b = TokenBatches(tokens, 12, seed=2)
    b.load_state_dict(a.state_dict())
    assert (a.micro_batch(0, 5)[0] == b.micro_batch(0, 5)[0]).all()
    with pytest.raises(ConfigError):
        TokenBatches(tokens, 12, seed=3).load_state_dict(a.state_dict())
