"""Validation: the held-out share of each source is whole documents, the same on every call, disjoint from what
training reads; the evaluator's loss is the model's mean over target tokens; rows carry eval.* at eval steps."""

import json
import math

import pytest
import torch

from tests.conftest import read_metrics, run_cli, tiny_args


def test_the_carve_out_splits_whole_documents_deterministically(tmp_path):
    from holotrain.data.sources import SourceConfig, plan_chunks, source_files
    from holotrain.data.split import Split, held_out
    from holotrain.data.worker import tokenize_chunk

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document number {i} " * 3}) + "\n" for i in range(400)))
    src = SourceConfig(name="docs", path=str(path))
    files = source_files(src)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    chunks = plan_chunks(0, files, 4096)

    def keys(split):
        return [tuple(k) for c in chunks for k in tokenize_chunk(c, files, "text", tok, 1, None, split).keys]

    every, train, held = keys(None), keys(Split("docs", 0.1)), keys(Split("docs", 0.1, held=True))
    assert sorted(train + held) == sorted(every) and not set(train) & set(held)
    assert 20 <= len(held) <= 60  # about 10% of 400
    assert held == keys(Split("docs", 0.1, held=True))  # the same on every call
    assert all(held_out("docs", files[f], o, 0.1) for f, o in held)
    assert keys(Split("other", 0.1, held=True)) != held  # each source has its own


def test_the_evaluator_is_the_mean_over_target_tokens():
    """Two sources of 3 rows each, micro-batches of 2 (a padded row without targets): eval.loss is the cross-entropy
    summed over every target token divided by their count, each source's likewise."""
    import torch.nn.functional as F

    from holotrain.model import ModelArgs, build
    from holotrain.parallel.dims import ParallelDims
    from holotrain.train.evaluation import EvalRows, Evaluator

    torch.manual_seed(0)
    model = build(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=16))
    g = torch.Generator().manual_seed(1)
    sets = {}
    for name, rows in (("a", 3), ("b", 3)):
        inputs = torch.randint(0, 50, (rows, 16), generator=g)
        targets = torch.randint(0, 50, (rows, 16), generator=g)
        targets[0, :5] = -100
        targets[2, 8:] = -100
        sets[name] = EvalRows(inputs, targets, torch.zeros_like(inputs))
    got = Evaluator(sets, ParallelDims(world=1), 0, 2, torch.device("cpu"), autocast=False)(model)
    assert all(p.grad is None for p in model.parameters())  # training's grad mode, but nothing flows back
    with torch.no_grad():
        sums = {n: F.cross_entropy(model(r.inputs).flatten(0, 1), r.targets.flatten(), ignore_index=-100,
                                   reduction="sum").item() for n, r in sets.items()}
    counts = {n: r.target_tokens for n, r in sets.items()}
    assert got["eval.tokens"] == sum(counts.values())
    assert got["eval.loss"] == pytest.approx(sum(sums.values()) / sum(counts.values()), rel=1e-5)
    for n in sets:
        assert got[f"eval.{n}.loss"] == pytest.approx(sums[n] / counts[n], rel=1e-5)


@pytest.mark.slow
def test_eval_rows_and_no_held_out_document_is_trained_on(tmp_path):
    """The embedded default with eval every 5 steps: rows at steps 5, 10 and the last carry eval.loss and eval.ppl
    overall and per source, counted over target tokens; samples.jsonl (every document trained on) holds no held-out
    document; and the evaluator agrees with the model's own loss on its rows."""
    from holotrain.data.sources import source_files
    from holotrain.data.split import held_out

    run = tmp_path / "run"
    run_cli("train", *tiny_args(run, **{"training.steps": 12, "eval.every": 5, "eval.holdout": 0.05,
                                         "data.log_samples": True, "checkpoint.every": 0}))
    rows = read_metrics(run)
    evaluated = [r for r in rows if r.get("eval.loss") is not None]
    assert [r["step"] for r in evaluated] == [5, 10, 12]
    for r in evaluated:
        assert r["eval.ppl"] == pytest.approx(math.exp(r["eval.loss"]))
        assert {"eval.code.loss", "eval.docs.loss", "eval.tokens", "time.eval"} <= set(r)
        # Samples: the opening of each source's first held-out document, continued by eval.sample_tokens tokens.
        assert len(r["eval.samples"]) == 2 and all(s["prompt"] and s["text"] for s in r["eval.samples"])
        assert min(r["eval.code.loss"], r["eval.docs.loss"]) <= r["eval.loss"] <= max(r["eval.code.loss"],
                                                                                     r["eval.docs.loss"])
    assert evaluated[-1]["eval.loss"] < evaluated[0]["eval.loss"]
    from holotrain.config import load_config

    cfg = load_config(run / "config.toml")
    files = {s.name: source_files(s) for s in cfg.data.sources}
    names = [s.name for s in cfg.data.sources]
    trained = 0
    for line in (run / "samples.jsonl").read_text().splitlines():
        for key in (k for sample in json.loads(line)["samples"] for k in sample):
            source, _, file, offset = key[:4]
            assert not held_out(names[source], files[names[source]][file], offset, 0.05), key
            trained += 1
    assert trained > 0


def test_keep_best_protects_the_best_checkpoint_from_pruning(tmp_path):
    """write_checkpoint with keep = 1 prunes all but the newest, except the protected step; through the trainer,
    checkpoints/best.json names a kept checkpoint whose eval.loss is the lowest of those evaluated at a save."""
    from holotrain.train.checkpoint import list_checkpoints, write_checkpoint

    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step, {"w": torch.ones(3) * step}, {"step": step}, keep=1, protect=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 6]

    run = tmp_path / "run"
    run_cli("train", *tiny_args(run, **{"training.steps": 6, "eval.every": 2, "checkpoint.every": 2,
                                         "checkpoint.keep": 1, "checkpoint.keep_best": True}))
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    losses = {r["step"]: r["eval.loss"] for r in read_metrics(run) if r.get("eval.loss") is not None}
    assert best["eval.loss"] == min(losses.values()) and losses[best["step"]] == best["eval.loss"]
    assert (run / "checkpoints" / f"step-{best['step']}").is_dir()


def test_eval_rows_are_shared_among_the_sources_by_weight():
    """eval.batches x batch_size rows in all, by the sources' weights; a source short of its share leaves the rest
    to the others."""
    from holotrain.train.evaluation import allot

    assert allot({"code": 80, "docs": 80}, {"code": 0.7, "docs": 0.3}, 80) == {"code": 56, "docs": 24}
    assert allot({"code": 80, "docs": 7}, {"code": 0.7, "docs": 0.3}, 80) == {"code": 73, "docs": 7}
    assert allot({"a": 1, "b": 1, "c": 100}, {"a": 1, "b": 1, "c": 1}, 10) == {"a": 1, "b": 1, "c": 8}
    assert allot({"a": 3, "b": 3}, {"a": 1, "b": 1}, 100) == {"a": 3, "b": 3}


def test_eval_samples_continue_as_the_full_forward_does():
    """The samples (prompts of one length batched, padded to 16 rows, continued with a KV cache) draw the greedy
    tokens that the model's ordinary forward over the whole row gives, one prompt at a time; a prompt near the end of
    the context stops there."""
    from holotrain.model import ModelArgs, build
    from holotrain.train.samples import Samples

    torch.manual_seed(0)
    model = build(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97,
                            max_seq_len=64)).eval()

    class Ids:  # a tokenizer whose text is the ids
        decode = staticmethod(lambda ids: " ".join(map(str, ids)))

    prompts = [[5, 17, 3, 42, 8], [9, 1, 1, 60, 2], [33, 4], list(range(1, 60))]

    def greedy(ids, new):
        row = list(ids)
        with torch.no_grad():
            for _ in range(new):
                row.append(int(model(torch.tensor([row]))[0, -1].argmax()))
        return row[len(ids):]

    samples = Samples([(f"p{i}", ids) for i, ids in enumerate(prompts)], Ids, 12, torch.device("cpu"),
                      autocast=False)
    got = samples(model)["eval.samples"]
    assert [s["prompt"] for s in got] == ["p0", "p1", "p2", "p3"]
    for ids, sample in zip(prompts, got):
        expected = greedy(ids, min(12, 64 - len(ids)))
        assert sample["text"] == Ids.decode(expected)
    assert len(got[3]["text"].split()) == 5
