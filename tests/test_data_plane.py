"""The data plane: sources, bad input, mixture, packing, balancing, and (through the trainer) exact resume
and loader failover; the plane process on its own: shared-memory ownership, signals, failures, skipped records."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from holotrain.data.client import with_boundary
from holotrain.data.corpus import prepare_tokenizer
from holotrain.data.mixture import Mixture, weight_at
from holotrain.data.packing import Packer, balance, sample_arrays
from holotrain.data.plane import Constructor, LoaderPool, PlaneSpec, SourceStream
from holotrain.data.sources import SourceConfig, plan_chunks, read_chunk, source_files
from holotrain.errors import ConfigError
from tests.conftest import REPO, launch, read_metrics, run_cli, tiny_args

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def write_jsonl(path: Path, n: int, prefix: str, seed: int = 0, max_words: int = 12) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))
            f.write(json.dumps({"text": f"{prefix} {i} {words}", "id": f"{prefix}-{i}"}) + "\n")


def test_jsonl_chunks_cover_every_document_once(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 1000, "doc")
    src = SourceConfig(name="a", path=str(tmp_path / "a.jsonl"))
    files = source_files(src)
    chunks = plan_chunks(0, files, chunk_bytes=777)
    assert len(chunks) > 20
    keys, texts = [], []
    for c in chunks:
        part = read_chunk(c, files, "text", eos_id=0)
        keys += part.keys
        texts += part.texts
    assert len(keys) == len(set(keys)) == 1000
    assert [t.split()[1] for t in texts] == [str(i) for i in range(1000)]


def test_txt_parquet_and_token_sources(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "txt").mkdir()
    for i in range(3):
        (tmp_path / "txt" / f"{i}.txt").write_text(f"text file {i}")
    table = pa.table({"body": [f"row {i}" for i in range(50)]})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=16)
    np.save(tmp_path / "tok.npy", np.array([5, 6, 0, 7, 0, 8, 9, 9, 0], dtype=np.uint16))

    def read_all(src, eos=0):
        files = source_files(src)
        return [read_chunk(c, files, src.text_field, eos) for c in plan_chunks(0, files, 8)]

    txt = read_all(SourceConfig(name="t", path=str(tmp_path / "txt")))
    assert sorted(t for part in txt for t in part.texts) == ["text file 0", "text file 1", "text file 2"]
    rows = read_all(SourceConfig(name="p", path=str(tmp_path / "rows.parquet"), text_field="body"))
    assert [t for part in rows for t in part.texts] == [f"row {i}" for i in range(50)]
    toks = read_all(SourceConfig(name="n", path=str(tmp_path / "tok.npy")))
    assert [d.tolist() for part in toks for d in part.token_docs] == [[5, 6], [7], [8, 9, 9]]


def test_bad_input_is_skipped_and_counted(tmp_path):
    bad = tmp_path / "bad.jsonl"
    with open(bad, "wb") as f:
        f.write(b'{"text": "good one"}\n')
        f.write(b'{"text": "broken\n')  # malformed JSON
        f.write(b'{"other": "no text field"}\n')
        f.write(b'{"text": "bad bytes \xff\xfe"}\n')  # undecodable
        f.write(b'{"text": "good two"}\n')
    (tmp_path / "empty.jsonl").write_bytes(b"")
    src = SourceConfig(name="b", path=str(tmp_path / "*.jsonl"))
    files = source_files(src)
    parts = [read_chunk(c, files, "text", 0) for c in plan_chunks(0, files, 1 << 20)]
    assert [t for p in parts for t in p.texts] == ["good one", "good two"]
    assert sum(p.skipped for p in parts) == 4
    examples = [e for p in parts for e in p.skip_examples]
    assert any("bad.jsonl:2" in e for e in examples) and any("empty.jsonl" in e for e in examples)


def test_missing_path_and_unknown_format_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.sources\[x\]\.path"):
        source_files(SourceConfig(name="x", path=str(tmp_path / "nope-*.jsonl")))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="unknown format"):
        source_files(SourceConfig(name="y", path=str(tmp_path / "data.csv")))


def test_weight_schedule_is_piecewise_linear():
    sched = [[0, 0.9], [1000, 0.5]]
    assert weight_at(1.0, sched, 0) == 0.9
    assert weight_at(1.0, sched, 500) == pytest.approx(0.7)
    assert weight_at(1.0, sched, 5000) == 0.5
    assert weight_at(0.3, [], 77) == 0.3
    m = Mixture([1.0, 1.0], [sched, []])
    assert m.shares(0) == pytest.approx([0.9 / 1.9, 1 / 1.9])


def test_packing_keeps_documents_and_masks_targets():
    packer = Packer(length=17, max_open=8)
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, size=int(rng.integers(2, 12))).astype(np.uint32) for _ in range(300)]
    for i, d in enumerate(docs):
        packer.add(d, (0, 0, 0, i))
    bins = packer.take(40)
    x, y, doc = sample_arrays(bins, 17, pad_id=0)
    for r, b in enumerate(bins):
        pos = 0
        for d_index, piece in enumerate(b.pieces):
            n = len(piece.tokens)
            assert np.array_equal(np.append(x[r], y[r, -1])[pos : pos + n], piece.tokens)  # documents kept whole
            assert (doc[r, pos : min(pos + n, 16)] == d_index).all()
            # the last token of a piece predicts nothing; the others predict the next token of the piece
            if pos + n - 1 < 16:
                assert y[r, pos + n - 1] == -100
            assert (y[r, pos : pos + n - 1] == piece.tokens[1:]).all()
            pos += n
    assert packer.pad_tokens / packer.total_tokens < 0.05


def test_only_micro_batches_with_a_document_boundary_are_masked():
    # [accum=3, micro=2, T=8]: rows of one document each; a boundary inside a row; a boundary between two rows only.
    one_each = np.array([[0] * 8, [1] * 8], dtype=np.int32)
    inside = np.array([[0] * 8, [1] * 3 + [2] * 5], dtype=np.int32)
    assert with_boundary(np.stack([one_each, inside, one_each + 7])) == [False, True, False]


def test_balancing_long_tailed_lengths_over_8_ranks():
    """max/mean attention cost per rank <= 1.05 with balancing, far above without."""
    rng = np.random.default_rng(1)
    T = 2049
    packer = Packer(T, max_open=128)
    ratios_with, ratios_without = [], []
    for step in range(20):
        while not packer.has(64):
            n = int(min(T * 3, rng.lognormal(5.5, 1.4)) + 1)  # long tail: most short, some past the context
            packer.add(np.ones(n, dtype=np.uint32), (0, 0, 0, 0))
        costs = [b.cost() for b in packer.take(64)]
        for groups, out in ((balance(costs, 8), ratios_with), ([list(range(r * 8, r * 8 + 8)) for r in range(8)], ratios_without)):
            loads = [sum(costs[i] for i in g) for g in groups]
            assert sorted(i for g in groups for i in g) == list(range(64))
            out.append(max(loads) / np.mean(loads))
    assert max(ratios_with) <= 1.05, ratios_with
    assert np.mean(ratios_without) > 1.15


BACKENDS = ["local", pytest.param("ray", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("ray") is None, reason="ray not installed"))]


def _constructor(tmp_path, weights, global_batch, seq_len=32, max_workers=2, backend="local", world_size=1,
                 balance=True, max_words=12):
    srcs = []
    for i, (name, w) in enumerate(weights.items()):
        if not (tmp_path / f"{name}.jsonl").exists():
            write_jsonl(tmp_path / f"{name}.jsonl", 3000, name, seed=i, max_words=max_words)
        srcs.append(SourceConfig(name=name, path=str(tmp_path / f"{name}.jsonl"), weight=w))
    tok, tok_path = prepare_tokenizer(srcs, "", 300, 0.2, tmp_path / "cache")
    spec = PlaneSpec(sources=srcs, tokenizer_path=str(tok_path), eos_id=0, pad_id=1, seq_len=seq_len,
                     global_batch=global_batch, world_size=world_size, local_ranks=list(range(world_size)),
                     micro_batch=global_batch // world_size, accum=1, seed=0, max_workers=max_workers,
                     chunk_bytes=20_000, backend=backend, balance=balance)
    files = [source_files(s) for s in srcs]
    if backend == "ray":
        from holotrain.data.ray_backend import RayLoaderPool

        pool = RayLoaderPool(spec, files)
    else:
        pool = LoaderPool(spec, files)
    streams = [SourceStream(i, plan_chunks(i, f, spec.chunk_bytes), pool, 0, True, s.name)
               for i, (s, f) in enumerate(zip(srcs, files))]
    return Constructor(spec, streams), pool


@pytest.mark.parametrize("backend", BACKENDS)
def test_realized_mixture_within_one_percent_over_10k_samples(tmp_path, backend):
    constructor, pool = _constructor(tmp_path, {"web": 0.6, "code": 0.3, "books": 0.1}, global_batch=250,
                                     backend=backend)
    try:
        for _ in range(40):  # 10,000 samples
            constructor.produce()
    finally:
        pool.close()
    actual = np.array(constructor.mixture.actual, dtype=float)
    assert np.abs(actual / actual.sum() - [0.6, 0.3, 0.1]).max() < 0.01


@pytest.mark.parametrize("world_size", [1, 4])
def test_constructor_state_resumes_the_same_sequence(tmp_path, world_size):
    """With 4 data-parallel ranks, documents up to several samples long: cost balancing holds samples back in its
    window, and the state carries them, so the resumed constructor hands every rank the same samples."""
    kw = {"world_size": world_size, "max_words": 60 if world_size > 1 else 12}
    batch = 4 if world_size > 1 else 16  # one sample per rank: what the window is for
    first, pool1 = _constructor(tmp_path, {"a": 0.5, "b": 0.5}, global_batch=batch, **kw)
    try:
        for _ in range(5):
            first.produce()
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
        expected = [[out["ranks"][r]["arrays"] for r in range(world_size)] for out in (first.produce() for _ in range(5))]
    finally:
        pool1.close()
    if world_size > 1:  # the saved window holds a sample that was passed over: out of order, still to come
        handed = state["packer"]["total"] // 33
        assert any(order < handed for order in state["packer"]["ready_order"]), state["packer"]["ready_order"]
    second, pool2 = _constructor(tmp_path, {"a": 0.5, "b": 0.5}, global_batch=batch, max_workers=4, **kw)
    try:
        second.load_state_dict(state)
        got = [[out["ranks"][r]["arrays"] for r in range(world_size)] for out in (second.produce() for _ in range(5))]
    finally:
        pool2.close()
    for a, b in zip(expected, got):
        for ranks_a, ranks_b in zip(a, b):
            assert all(np.array_equal(x, y) for x, y in zip(ranks_a, ranks_b))


def test_balance_off_hands_out_samples_in_order(tmp_path):
    """data.balance = false: over 4 ranks, the ranks' samples one after another are one process's, in order."""
    one, pool1 = _constructor(tmp_path, {"a": 0.5, "b": 0.5}, global_batch=16, max_words=60)
    four, pool4 = _constructor(tmp_path, {"a": 0.5, "b": 0.5}, global_batch=16, max_words=60, world_size=4,
                               balance=False)
    try:
        for _ in range(4):
            a, b = one.produce(), four.produce()
            for k in range(3):
                assert np.array_equal(a["ranks"][0]["arrays"][k],
                                      np.concatenate([b["ranks"][r]["arrays"][k] for r in range(4)]))
        assert b["cost_max_over_mean"] > 1.0
    finally:
        pool1.close()
        pool4.close()


# ---------------------------------------------------------------------------------------------
# Through the trainer: samples.jsonl lists every document of every sample.


def _plane_job(tmp_path, run_dir, workers: int, backend: str = "local") -> list[str]:
    data = tmp_path / "corpus"
    if not data.exists():
        data.mkdir()
        write_jsonl(data / "web.jsonl", 20000, "web", seed=1)
        write_jsonl(data / "code.jsonl", 20000, "code", seed=2)
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        f'[[data.sources]]\nname = "web"\npath = "{data / "web.jsonl"}"\nweight = 0.7\n'
        f'[[data.sources]]\nname = "code"\npath = "{data / "code.jsonl"}"\nweight = 0.3\n'
    )
    return ["train", "--config", str(cfg), *tiny_args(run_dir, **{
        "training.steps": 120, "checkpoint.every": 10, "data.workers": workers, "data.chunk_mb": 0.02,
        "data.log_samples": True, "data.vocab_size": 400, "data.backend": backend,
    })]


def _samples(run_dir) -> list:
    return [json.loads(line) for line in (Path(run_dir) / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def plane_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plane")
    run_cli(*_plane_job(tmp, tmp / "ref", workers=1))
    return tmp


def _run_and_kill(args, when, kill):
    """`holotrain <args>`, and kill(proc) once when() holds; its stderr in proc.err (a file)."""
    err = tempfile.TemporaryFile()
    proc = launch(["-m", "holotrain.cli", *args], stderr=err)
    proc.err = err
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if when():
            kill(proc)
            break
        time.sleep(0.01)
    return proc


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_after_sigkill_replays_the_same_samples(plane_reference, backend):
    ref, run = plane_reference / "ref", plane_reference / f"killed-{backend}"
    args = _plane_job(plane_reference, run, workers=3, backend=backend)
    target = random.randint(15, 90)
    metrics = run / "metrics.jsonl"
    proc = _run_and_kill(args, lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= target,
                         lambda p: p.send_signal(signal.SIGKILL))
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    run_cli(*args)
    assert _samples(run) == _samples(ref)
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(ref)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_loader_worker_killed_is_replaced_without_loss_or_duplicates(plane_reference, backend):
    psutil = pytest.importorskip("psutil")
    ref, run = plane_reference / "ref", plane_reference / f"failover-{backend}"
    args = _plane_job(plane_reference, run, workers=2, backend=backend)
    killed = []

    def loader_workers(proc):
        if backend == "ray":
            return [p for p in psutil.process_iter(["cmdline"]) if "LoaderActor" in " ".join(p.info["cmdline"] or [])]
        kids = psutil.Process(proc.pid).children(recursive=True)
        planes = [k for k in kids if k.ppid() == proc.pid and "spawn" in " ".join(k.cmdline())]
        return [k for k in kids if planes and k.ppid() == planes[0].pid and "spawn" in " ".join(k.cmdline())
                and "resource_tracker" not in " ".join(k.cmdline())]

    metrics = run / "metrics.jsonl"

    def ready():
        return metrics.is_file() and len(metrics.read_text().splitlines()) >= 20

    proc = _run_and_kill(args, ready, lambda p: killed.extend(w.pid for w in loader_workers(p)[:1]))
    for pid in killed:
        psutil.Process(pid).send_signal(signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, (proc.err.seek(0), proc.err.read().decode())
    assert killed, "no loader worker found to kill"
    assert _samples(run) == _samples(ref)
    rows = read_metrics(run)
    assert rows[-1]["data.worker_restarts"] >= 1
    # Every document appears once across the run (until a source wraps around: it does not here).
    docs = [tuple(p[:4]) for s in _samples(run) for sample in s["samples"] for p in sample if p[4] == 0]
    assert len(docs) == len(set(docs))


def test_metrics_report_the_plane(plane_reference):
    row = read_metrics(plane_reference / "ref")[-1]
    by_source = row["data.tokens_by_source"]
    assert set(by_source) == {"web", "code"}
    share = by_source["web"] / sum(by_source.values())
    assert abs(share - 0.7) < 0.02
    assert row["data.skipped"] == 0 and row["time.data_wait"] >= 0
    assert sum(row["data.workers"].values()) >= 2
    assert 0 < row["data.doc_masked_share"] <= 1  # short documents: most micro-batches hold a boundary


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_record_inside_the_plane_is_one_clear_error(tmp_path, backend):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"] * 10}), tmp_path / "rows.parquet")
    write_jsonl(tmp_path / "ok.jsonl", 200, "ok")
    cfg = tmp_path / "job.toml"
    cfg.write_text(f'[[data.sources]]\nname = "ok"\npath = "{tmp_path / "ok.jsonl"}"\n'
                   f'[[data.sources]]\nname = "rows"\npath = "{tmp_path / "rows.parquet"}"\n')
    # A ready tokenizer, so that the bad source is first read by the plane's loaders, not by tokenizer training.
    _, tok = prepare_tokenizer([SourceConfig(name="ok", path=str(tmp_path / "ok.jsonl"))], "", 300, 0.1, tmp_path / "c")
    proc = run_cli("train", "--config", str(cfg), *tiny_args(tmp_path / "run", **{"data.tokenizer": str(tok),
                   "data.backend": backend}), check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no column 'text'" in proc.stderr and "Traceback" not in proc.stderr


def test_killed_plane_is_restarted_with_identical_samples(tmp_path):
    """SIGKILL of the data plane's service process mid-run: the trainer's client starts a new plane from the state
    of the last step training took, and the run's samples and losses are those of an uninterrupted run."""
    import signal as _signal
    import time as _time

    import psutil

    from tests.conftest import launch, read_metrics, run_cli, tiny_args

    def run_args(run_dir):
        return ["train", *tiny_args(run_dir, **{"training.steps": 24, "checkpoint.every": 0,
                                                "data.log_samples": True})]

    reference = tmp_path / "reference"
    run_cli(*run_args(reference))
    run_dir = tmp_path / "plane-killed"
    out_file, err_file = tmp_path / "out", tmp_path / "err"
    with open(out_file, "wb") as out, open(err_file, "wb") as err:
        proc = launch(["-m", "holotrain.cli", *run_args(run_dir)], stdout=out, stderr=err)
    metrics, killed = run_dir / "metrics.jsonl", None
    deadline = _time.time() + 300
    while killed is None and _time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 8:
            # The plane is the trainer's child process whose own children are the loaders.
            planes = [c for c in psutil.Process(proc.pid).children() if c.children()]
            assert len(planes) == 1, planes
            planes[0].send_signal(_signal.SIGKILL)
            killed = len(metrics.read_text().splitlines())
        _time.sleep(0.005)
    proc.wait(timeout=300)
    out, err = out_file.read_text(), err_file.read_text()
    assert killed is not None and killed < 24, "the run ended before the plane was killed"
    assert proc.returncode == 0, out + err
    assert "restarting it from step" in out
    rows, ref = read_metrics(run_dir), read_metrics(reference)
    assert [(r["step"], r["loss"]) for r in rows] == [(r["step"], r["loss"]) for r in ref]
    assert rows[-1]["data.plane_restarts"] == 1
    assert (run_dir / "samples.jsonl").read_text() == (reference / "samples.jsonl").read_text()


def test_a_killed_trainer_leaves_no_shared_memory_blocks_behind(tmp_path):
    """SIGKILL of the training process: its plane notices, stops its loaders and removes every block named for
    it (batches prefetched or being handed over, chunks in flight); a plane killed as well is swept by the next
    run's plane when it starts."""
    from holotrain.data.plane import shm_prefix
    from tests.conftest import launch, run_cli, tiny_args

    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    run_dir = tmp_path / "killed"
    args = ["train", *tiny_args(run_dir, **{"training.steps": 40, "checkpoint.every": 10})]
    prefix = shm_prefix(run_dir)
    proc = launch(["-m", "holotrain.cli", *args])
    metrics, seen, deadline = run_dir / "metrics.jsonl", 0, time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        seen = max(seen, len(list(shm.glob(f"{prefix}*"))))  # the plane's blocks carry the run's prefix
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 5 and seen:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and seen, (proc.returncode, seen)
    deadline = time.time() + 20
    while list(shm.glob(f"{prefix}*")) and time.time() < deadline:
        time.sleep(0.1)
    assert not list(shm.glob(f"{prefix}*"))
    # A block left by a plane that could not clean up (killed too) goes when the next plane of the run starts.
    stale = shm / f"{prefix}stale"
    stale.write_bytes(b"x" * 64)
    run_cli(*args)
    assert not stale.exists() and not list(shm.glob(f"{prefix}*"))


# ---------------------------------------------------------------------------------------------
# The plane process on its own: shared-memory ownership, signals, failures, skipped records


def test_a_sweep_removes_only_the_blocks_of_owners_that_are_gone(tmp_path):
    """Blocks carry their plane's pid: a sweep (a plane starting or ending) leaves a live plane's blocks alone, even
    one of another process on the same run directory, and removes those of a plane that is gone, and its own."""
    from multiprocessing import resource_tracker

    from holotrain.data.shm import new_block, owner_prefix, shm_prefix, sweep_blocks

    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    prefix = shm_prefix(tmp_path)
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is no one's now
    names = {}
    for who, pid in (("live", os.getppid()), ("gone", gone.pid), ("own", os.getpid())):
        block = new_block(64, owner_prefix(prefix, pid))
        block.close()
        resource_tracker.unregister(block._name, "shared_memory")  # the sweep removes it, not this process's exit
        names[who] = block.name
    assert names["live"].startswith(f"{prefix}{os.getppid()}_") and len(names["live"]) < 31
    try:
        assert sweep_blocks(prefix) == 2
        assert [p.name for p in shm.glob(f"{prefix}*")] == [names["live"]]
    finally:
        (shm / names["live"]).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def small_source(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    write_jsonl(d / "a.jsonl", 3000, "a")
    src = SourceConfig(name="a", path=str(d / "a.jsonl"))
    _, tokenizer_path = prepare_tokenizer([src], "", 300, 0.1, d / "cache")
    return src, tokenizer_path


def _plane_spec(src: SourceConfig, tokenizer_path, run_dir) -> PlaneSpec:
    from holotrain.data.shm import shm_prefix

    return PlaneSpec(sources=[src], tokenizer_path=str(tokenizer_path), eos_id=0, pad_id=1, seq_len=32, global_batch=4,
                     world_size=1, local_ranks=[0], micro_batch=4, accum=1, seed=0, max_workers=1, chunk_bytes=4000,
                     shm_prefix=shm_prefix(run_dir))


def test_plane_and_loaders_ignore_sigint_and_sigterm(small_source, tmp_path, capfd):
    """Ctrl-C signals the whole process group, and schedulers send SIGTERM to it: the plane and its loaders go on
    serving (the trainer saves a checkpoint, asking the plane for its state), then end cleanly when closed: exit 0,
    nothing on stderr, no block left."""
    psutil = pytest.importorskip("psutil")
    import torch

    from holotrain.data.client import DataClient, plane_address, start_plane

    spec = _plane_spec(*small_source, tmp_path)
    address, key = plane_address(tmp_path)
    plane = start_plane(spec, None, address, key)
    os.kill(plane.pid, signal.SIGINT)  # during its start-up (imports): held back, then dropped
    client = DataClient(address, key, 0, 0, torch.device("cpu"), plane=plane)
    try:
        client.next()
        loaders = psutil.Process(plane.pid).children()
        assert loaders
        for proc in (psutil.Process(plane.pid), *loaders):
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGTERM)
        for _ in range(20):  # 20 steps take chunks the loaders read after the signals
            client.next()
        assert client.state(21)["step"] == 21
        assert plane.is_alive() and all(p.is_running() for p in loaders)
        assert client.stats["worker_restarts"] == 0
    finally:
        client.close(stop_plane=True)
    assert plane.exitcode == 0
    assert not list(Path("/dev/shm").glob(f"{spec.shm_prefix}*"))
    assert capfd.readouterr().err == ""


def test_a_plane_ignores_sigint_from_its_first_instant():
    """A Ctrl-C while the plane process is still starting (importing, before its own code runs) waits, blocked, and is
    dropped. In a fresh interpreter, where starting the plane also starts multiprocessing's resource tracker."""
    script = (
        "import multiprocessing as mp, os, signal\n"
        "from holotrain.data.plane import plane_main\n"
        "from holotrain.data.worker import start_light\n"
        "ctx = mp.get_context('spawn')\n"
        "link, plane_end = ctx.Pipe()\n"
        "args = ('/nonexistent/plane.sock', b'k', None, None, os.getpid(), plane_end)\n"
        "proc = ctx.Process(target=plane_main, args=args)\n"
        "start_light(proc)\n"
        "plane_end.close()\n"
        "os.kill(proc.pid, signal.SIGINT)\n"
        "proc.join()\n"
        "print(proc.exitcode, link.recv()[1].splitlines()[-1] if link.poll() else 'no word')\n"
    )  # the plane ran: it says it could not listen there
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stderr == "" and out.stdout.startswith("0 FileNotFoundError"), out


def test_a_plane_that_cannot_start_says_why_at_once(small_source, tmp_path):
    """A source path that matches nothing, found by the plane (the trainer's input check would find it first): the
    trainer's next batch raises the plane's own line as a ConfigError within seconds, not after the 300 s connect
    timeout. A plane that cannot even listen: its owner raises the reason from the plane's process."""
    import torch

    from holotrain.data.client import DataClient, plane_address, start_plane

    src, tokenizer_path = small_source
    spec = _plane_spec(dataclasses.replace(src, path=str(tmp_path / "missing-*.jsonl")), tokenizer_path, tmp_path)
    address, key = plane_address(tmp_path)
    t0 = time.monotonic()
    plane = start_plane(spec, None, address, key)
    client = DataClient(address, key, 0, 0, torch.device("cpu"), plane=plane)
    try:
        with pytest.raises(ConfigError, match=r"^data\.sources\[a\]\.path: no \.jsonl.* files at .*missing-"):
            client.next()
    finally:
        client.close(stop_plane=True)
    assert time.monotonic() - t0 < 30 and plane.exitcode == 0
    unreachable = str(tmp_path / "gone" / "plane.sock")
    t0 = time.monotonic()
    plane = start_plane(spec, None, unreachable, key)
    with pytest.raises(RuntimeError, match=r"(?s)^data plane failed: Traceback.*FileNotFoundError"):
        DataClient(unreachable, key, 0, 0, torch.device("cpu"), plane=plane)
    assert time.monotonic() - t0 < 30


def test_skipped_records_are_counted_per_source_and_stop_the_run(tmp_path, capsys):
    """A source half of whose lines are broken, beside a clean one: every step's stats carry each source's records
    read and skipped and its first bad file:line; Data.metrics, fed them, stops the run in one line naming the file
    (on every rank; the main rank alone prints warnings)."""
    from types import SimpleNamespace

    from holotrain.data.lever import Data
    from holotrain.data.monitor import SkipMonitor

    write_jsonl(tmp_path / "good.jsonl", 3000, "good")
    with open(tmp_path / "bad.jsonl", "w") as f:
        for i in range(1500):
            f.write(json.dumps({"text": f"bad {i} alpha"}) + "\n{broken\n")
    srcs = [SourceConfig(name=n, path=str(tmp_path / f"{n}.jsonl")) for n in ("good", "bad")]
    _, tokenizer_path = prepare_tokenizer(srcs[:1], "", 300, 0.1, tmp_path / "cache")
    spec = PlaneSpec(sources=srcs, tokenizer_path=str(tokenizer_path), eos_id=0, pad_id=1, seq_len=32, global_batch=4,
                     world_size=1, local_ranks=[0], micro_batch=4, accum=1, seed=0, max_workers=2,
                     chunk_bytes=1 << 20)  # a chunk per file: each source's counts are its file's from the first step
    files = [source_files(s) for s in srcs]
    pool = LoaderPool(spec, files)
    try:
        streams = [SourceStream(i, plan_chunks(i, f, spec.chunk_bytes), pool, 0, True, s.name)
                   for i, (s, f) in enumerate(zip(srcs, files))]
        constructor = Constructor(spec, streams)
        constructor.produce()
        stats = constructor.stats()
    finally:
        pool.close()
    assert stats["sources"] == {
        "good": {"records": 3000, "skipped": 0, "passes": 0, "first": None},
        "bad": {"records": 3000, "skipped": 1500, "passes": 0,
                "first": f"{tmp_path / 'bad.jsonl'}:2: not a JSON object with a string field 'text'"},
    }
    data = object.__new__(Data)  # the lever's metrics() over these stats, without a plane
    data.client = SimpleNamespace(stats=stats, restarts=0, micro_batches=1, masked_micro_batches=1)
    data.skips = SkipMonitor(0.6, is_main=True)  # 50% is within 60%: a warning, and the row
    row = data.metrics(1)
    assert row["data.skipped_by_source"] == {"good": 0, "bad": 1500} and row["data.skipped"] == 1500
    assert capsys.readouterr().out == (f"holotrain: warning: data source 'bad': 1500 of 3000 records skipped so far "
                                       f"(first: {tmp_path / 'bad.jsonl'}:2: not a JSON object with a string field "
                                       "'text')\n")
    data.skips = SkipMonitor(0.01, is_main=False)
    with pytest.raises(ConfigError, match=r"^data source 'bad': 1500 of 3000 .*bad\.jsonl:2: .*max_skip_fraction"):
        data.metrics(1)
    assert capsys.readouterr().out == ""
