"""A source loader process: reads chunks of one source, tokenizes them, and hands the tokens over in
shared memory. Only a chunk's name and sizes travel through the queue, never per-sample pickles.

Shared block layout: tokens uint32[n_tokens] | doc starts int64[n_docs + 1] | doc keys int64[n_docs, 2].
The consumer unlinks the block once it has copied it out.
"""

from __future__ import annotations

import os
import queue
import secrets
import sys
import traceback
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

from holotrain.data.sources import Chunk, read_chunk
from holotrain.errors import ConfigError


def _starts_offset(n_tokens: int) -> int:
    return -(-4 * n_tokens // 8) * 8  # int64 arrays start 8-byte aligned


def block_size(n_tokens: int, n_docs: int) -> int:
    return max(8, _starts_offset(n_tokens) + 8 * (n_docs + 1) + 16 * n_docs)


def block_views(buf, n_tokens: int, n_docs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens = np.ndarray((n_tokens,), dtype=np.uint32, buffer=buf, offset=0)
    o = _starts_offset(n_tokens)
    starts = np.ndarray((n_docs + 1,), dtype=np.int64, buffer=buf, offset=o)
    keys = np.ndarray((n_docs, 2), dtype=np.int64, buffer=buf, offset=o + 8 * (n_docs + 1))
    return tokens, starts, keys


def start_light(proc) -> None:
    """Start a spawned process without re-importing the parent's main module in it.

    Spawned children normally import the launching script (here the trainer's CLI, and with it torch),
    which would cost every loader process hundreds of MB; the plane and its workers need none of it.
    """
    main = sys.modules["__main__"]
    saved = {k: main.__dict__.pop(k) for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    try:
        proc.start()
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def worker_main(worker_id: int, files: list[str], text_field: str, tokenizer_path: str, eos_id: int,
                tasks, results, parent_pid: int, shm_prefix: str = "") -> None:
    # One core per worker: the plane scales by workers, so the tokenizer must not fan out threads itself.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    paths = [Path(f) for f in files]
    while True:
        if os.getppid() != parent_pid:  # the data plane is gone: do not outlive it
            return
        try:
            task = tasks.get(timeout=0.5)
        except queue.Empty:
            continue
        if task is None:
            return
        chunk, epoch = task
        try:
            results.put(("chunk", worker_id, load_chunk(chunk, epoch, paths, text_field, tokenizer, eos_id,
                                                         shm_prefix)))
        except Exception as e:  # a bad file fails the same way every time: report it, do not die and retry
            kind = "config_error" if isinstance(e, ConfigError) else "error"
            results.put((kind, worker_id, {"source": chunk.source, "epoch": epoch, "index": chunk.index,
                                           "message": str(e) if kind == "config_error" else traceback.format_exc()}))


def tokenize_chunk(chunk: Chunk, paths: list[Path], text_field: str, tokenizer, eos_id: int):
    """Read and tokenize one chunk: (tokens uint32, doc starts int64[n+1], doc keys int64[n, 2], ChunkText).
    Every document ends with eos_id."""
    text = read_chunk(chunk, paths, text_field, eos_id)
    if text.token_docs:
        docs = text.token_docs
    else:
        docs = [np.asarray(e.ids, dtype=np.uint32) for e in tokenizer.encode_batch(text.texts, add_special_tokens=False)]
    starts = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) + 1 for d in docs], out=starts[1:])
    tokens = np.empty(int(starts[-1]), dtype=np.uint32)
    for d, s in zip(docs, starts[:-1]):
        tokens[s : s + len(d)] = d
    tokens[starts[1:] - 1] = eos_id
    keys = np.asarray(text.keys, dtype=np.int64).reshape(len(docs), 2)
    return tokens, starts, keys, text


def new_block(size: int, prefix: str = "") -> shared_memory.SharedMemory:
    """A shared-memory block named with the plane's prefix (random otherwise), so that the blocks a killed run
    left behind can be found and removed (plane.sweep_blocks)."""
    return shared_memory.SharedMemory(create=True, size=size, name=f"{prefix}{secrets.token_hex(8)}" if prefix else None)


def load_chunk(chunk: Chunk, epoch: int, paths: list[Path], text_field: str, tokenizer, eos_id: int,
               shm_prefix: str = "") -> dict:
    tokens, starts, keys, text = tokenize_chunk(chunk, paths, text_field, tokenizer, eos_id)
    n_tokens, n_docs = len(tokens), len(keys)
    shm = new_block(block_size(n_tokens, n_docs), shm_prefix)
    for dst, src in zip(block_views(shm.buf, n_tokens, n_docs), (tokens, starts, keys)):
        dst[:] = src
    name = shm.name
    shm.close()
    # The consumer owns the block from now on (it unlinks it); this process's exit must not remove it.
    resource_tracker.unregister(shm._name, "shared_memory")
    return {
        "source": chunk.source, "index": chunk.index, "epoch": epoch, "shm": name, "n_tokens": n_tokens,
        "n_docs": n_docs, "skipped": text.skipped, "skip_examples": text.skip_examples,
    }
