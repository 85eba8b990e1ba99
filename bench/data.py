"""Data plane benchmarks: loader throughput per core, memory against per-rank DataLoaders, rank balance.

  python bench/data.py --out data.json                 # (a), (c), (d) on this machine
  (b), the data wait while training, comes from the trainer's own metrics: see bench/RESULTS.md.

(a) tokens/s through the plane's loader workers with on-the-fly tokenization, per worker (= per core).
(c) proportional memory (PSS) of all loader processes: holotrain's one plane per node against
    torch.utils.data.DataLoader(num_workers=8) per rank reading and tokenizing the same sources.
(d) max/mean attention cost across 8 ranks on long-tailed document lengths, with and without balancing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from holotrain.data.corpus import cache_dir, prepare_tokenizer, stdlib_sources  # noqa: E402
from holotrain.data.packing import Packer, balance  # noqa: E402
from holotrain.data.plane import Constructor, LoaderPool, PlaneSpec, SourceStream  # noqa: E402
from holotrain.data.sources import plan_chunks, read_chunk, source_files  # noqa: E402


def setup(vocab: int):
    sources = stdlib_sources(cache_dir(""))
    tok, path = prepare_tokenizer(sources, "", vocab, 8.0, cache_dir(""))
    return sources, tok, path


def spec_for(sources, tok_path, workers, seq_len=2048, batch=8):
    return PlaneSpec(sources=sources, tokenizer_path=str(tok_path), eos_id=0, pad_id=1, seq_len=seq_len,
                     global_batch=batch, world_size=1, local_ranks=[0], micro_batch=batch, accum=1, seed=0,
                     max_workers=workers, chunk_bytes=1 << 20, prefetch_steps=4)


def loader_throughput(sources, tok_path, workers: int, seconds: float) -> dict:
    """(a) Drive one source's workers flat out: tokens/s delivered, and per worker."""
    src = sources[:1]  # the code source: the heavier one to tokenize
    spec = spec_for(src, tok_path, workers)
    files = [source_files(s) for s in src]
    pool = LoaderPool(spec, files)
    for _ in range(workers - 1):
        pool._spawn(0)
    stream = SourceStream(0, plan_chunks(0, files[0], spec.chunk_bytes), pool, 0, True, "code")
    tokens, t0 = 0, None
    try:
        while True:
            doc = stream.next_doc()[0]
            if t0 is None:  # time from the first delivered document: worker start-up excluded
                t0 = time.perf_counter()
            tokens += len(doc)
            if time.perf_counter() - t0 > seconds:
                break
    finally:
        pool.close()
    rate = tokens / (time.perf_counter() - t0)
    return {"workers": workers, "tokens_per_s": rate, "tokens_per_s_per_worker": rate / workers}


def pss_mb(pids) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total / 2**20


def plane_memory(sources, tok_path, ranks: int, steps: int) -> dict:
    """(c) holotrain: one plane per node (its constructor and loaders) serves every rank."""
    spec = spec_for(sources, tok_path, workers=4, batch=8 * ranks)
    spec.world_size, spec.local_ranks = ranks, list(range(ranks))
    files = [source_files(s) for s in spec.sources]
    pool = LoaderPool(spec, files)
    streams = [SourceStream(i, plan_chunks(i, f, spec.chunk_bytes), pool, 0, True, s.name)
               for i, (s, f) in enumerate(zip(spec.sources, files))]
    constructor = Constructor(spec, streams)
    try:
        for _ in range(steps):
            constructor.produce()
        workers = [w.proc.pid for w in pool.workers.values() if w.proc.is_alive()]
        # The plane process itself: measured as this process's growth over its imports.
        mb = pss_mb(workers) + (psutil.Process().memory_full_info().pss / 2**20 - BASE_PSS_MB)
    finally:
        pool.close()
    return {"ranks": ranks, "processes": len(workers) + 1, "pss_mb": mb}


class TokenizedStream(torch.utils.data.IterableDataset):
    """The DataLoader peer: an IterableDataset over the same sources, tokenized in each worker."""

    def __init__(self, sources, tok_path, seq_len):
        self.sources, self.tok_path, self.seq_len = sources, tok_path, seq_len

    def __iter__(self):
        from tokenizers import Tokenizer

        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        tok = Tokenizer.from_file(str(self.tok_path))
        buf: list[int] = []
        chunks = [(i, c) for i, s in enumerate(self.sources) for c in plan_chunks(i, source_files(s), 1 << 20)]
        for i, c in chunks[wid::nw]:
            files = source_files(self.sources[i])
            for enc in tok.encode_batch(read_chunk(c, files, "text", 0).texts):
                buf.extend(enc.ids + [0])
                while len(buf) > self.seq_len:
                    yield torch.tensor(buf[: self.seq_len + 1])
                    buf = buf[self.seq_len + 1 :]


def dataloader_memory(sources, tok_path, ranks: int, steps: int, loader_cls=None) -> dict:
    loader_cls = loader_cls or torch.utils.data.DataLoader
    iters, loaders = [], []
    for _ in range(ranks):
        dl = loader_cls(TokenizedStream(sources, tok_path, 2048), batch_size=8, num_workers=8,
                        persistent_workers=True, prefetch_factor=2)
        loaders.append(dl)
        iters.append(iter(dl))
    for _ in range(steps):
        for it in iters:
            next(it)
    pids = [p.pid for p in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
    mb = pss_mb(pids)
    del iters, loaders
    return {"ranks": ranks, "processes": len(pids), "pss_mb": mb}


def balance_ratios(steps: int = 50, ranks: int = 8, per_rank: int = 4, T: int = 2049) -> dict:
    """(d) Long-tailed lengths (log-normal, median ~250 tokens, some past the context) packed to T."""
    rng = np.random.default_rng(0)
    packer = Packer(T, max_open=4 * ranks * per_rank)
    with_b, without = [], []
    for _ in range(steps):
        while not packer.has(ranks * per_rank):
            packer.add(np.ones(int(min(3 * T, rng.lognormal(5.5, 1.4)) + 1), dtype=np.uint32), (0, 0, 0, 0))
        costs = [b.cost() for b in packer.take(ranks * per_rank)]
        for groups, out in ((balance(costs, ranks), with_b),
                            ([list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ranks)], without)):
            loads = [sum(costs[i] for i in g) for g in groups]
            out.append(max(loads) / np.mean(loads))
    return {"ranks": ranks, "samples_per_rank": per_rank, "with_mean": float(np.mean(with_b)),
            "with_max": float(np.max(with_b)), "without_mean": float(np.mean(without)),
            "without_max": float(np.max(without))}


BASE_PSS_MB = 0.0


def main():
    global BASE_PSS_MB
    p = argparse.ArgumentParser()
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--mem-steps", type=int, default=20)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--stateful", action="store_true", help="also measure torchdata's StatefulDataLoader")
    p.add_argument("--out", default="")
    a = p.parse_args()
    sources, tok, tok_path = setup(a.vocab)
    BASE_PSS_MB = psutil.Process().memory_full_info().pss / 2**20
    result = {"date": datetime.date.today().isoformat(), "host": platform.node(), "cores": os.cpu_count(),
              "command": "python " + " ".join(sys.argv), "throughput": [], "memory": [], "balance": None}
    for w in map(int, a.workers.split(",")):
        result["throughput"].append(loader_throughput(sources, tok_path, w, a.seconds))
        print(json.dumps(result["throughput"][-1]), flush=True)
    for r in map(int, a.ranks.split(",")):
        ours, theirs = plane_memory(sources, tok_path, r, a.mem_steps), dataloader_memory(sources, tok_path, r, a.mem_steps)
        row = {"holotrain": ours, "dataloader": theirs, "ratio": theirs["pss_mb"] / ours["pss_mb"]}
        if a.stateful:  # torchdata's StatefulDataLoader: resumable, same worker-per-rank model
            from torchdata.stateful_dataloader import StatefulDataLoader

            sdl = dataloader_memory(sources, tok_path, r, a.mem_steps, StatefulDataLoader)
            row.update({"stateful_dataloader": sdl, "stateful_ratio": sdl["pss_mb"] / ours["pss_mb"]})
        result["memory"].append(row)
        print(json.dumps(result["memory"][-1]), flush=True)
    result["balance"] = [balance_ratios(per_rank=k) for k in (8, 4, 2)]
    print(json.dumps(result["balance"]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
