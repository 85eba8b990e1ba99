"""A source loader process: reads chunks of one source, tokenizes them, and hands the tokens over in
shared memory. Only a chunk's name and sizes travel through the queue, never per-sample pickles.

Shared block layout: tokens uint32[n_tokens] | doc starts int64[n_docs + 1] | doc keys int64[n_docs, 2] |
mask uint8[n_mask]. The mask says which tokens are trained on; only chat sources have one (n_mask = n_tokens), a
text source's block has none (n_mask = 0: every token counts). The consumer unlinks the block once it has copied it
out.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

from holotrain.data.chat import assistant_mask, reader_for
from holotrain.data.shm import new_block
from holotrain.data.split import Split
from holotrain.data.sources import Chunk, ChunkText, SourceConfig, read_chunk
from holotrain.errors import ConfigError

# A terminal's Ctrl-C and many schedulers signal the whole process group. The data plane and its loaders ignore
# these: their lifetime is the training process's, which closes them (or whose end they notice).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _starts_offset(n_tokens: int) -> int:
    return -(-4 * n_tokens // 8) * 8  # int64 arrays start 8-byte aligned


def block_size(n_tokens: int, n_docs: int, n_mask: int = 0) -> int:
    return max(8, _starts_offset(n_tokens) + 8 * (n_docs + 1) + 16 * n_docs + n_mask)


def block_views(buf, n_tokens: int, n_docs: int, n_mask: int = 0) -> tuple[np.ndarray, ...]:
    """(tokens, starts, keys, mask) over a shared block."""
    tokens = np.ndarray((n_tokens,), dtype=np.uint32, buffer=buf, offset=0)
    o = _starts_offset(n_tokens)
    starts = np.ndarray((n_docs + 1,), dtype=np.int64, buffer=buf, offset=o)
    o += 8 * (n_docs + 1)
    keys = np.ndarray((n_docs, 2), dtype=np.int64, buffer=buf, offset=o)
    mask = np.ndarray((n_mask,), dtype=np.uint8, buffer=buf, offset=o + 16 * n_docs)
    return tokens, starts, keys, mask


@dataclass
class TokenizedChunk:
    tokens: np.ndarray  # uint32: every document followed by eos_id
    starts: np.ndarray  # int64 [n_docs + 1]: where each document starts in tokens
    keys: np.ndarray  # int64 [n_docs, 2]: (file, offset) of each document
    mask: np.ndarray | None  # bool per token, whether it is trained on (chat sources); None: every token is
    text: ChunkText  # what was read, and skipped

    def arrays(self) -> tuple:
        return self.tokens, self.starts, self.keys, self.mask


def start_light(proc) -> None:
    """Start a spawned process without re-importing the parent's main module in it, with SIGINT and SIGTERM blocked
    until its target ignores them (ignore_stop_signals).

    Spawned children normally import the launching script (here the trainer's CLI, and with it torch),
    which would cost every loader process hundreds of MB; the plane and its workers need none of it.
    The child inherits the signal mask of the thread that starts it: a Ctrl-C during its start-up (the imports
    before its target runs) then waits, blocked, and is dropped, instead of raising KeyboardInterrupt there.
    """
    main = sys.modules["__main__"]
    saved = {k: main.__dict__.pop(k) for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    # Spawning starts multiprocessing's resource tracker the first time, and that unblocks these signals on its way
    # out: started first, it leaves the mask below alone.
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # this thread's only: any thread may start one
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal that came meanwhile is delivered here now
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def ignore_stop_signals() -> None:
    """The first thing a plane or loader process does (start_light blocked these signals until now)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # also drops one that is pending
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def worker_main(worker_id: int, files: list[str], src: SourceConfig, tokenizer_path: str, eos_id: int,
                chat_template: str, tasks, results, parent_pid: int, shm_prefix: str = "",
                split: Split | None = None) -> None:
    """A loader process: it stops when the plane sends None, or when the plane is gone. Its errors go to the plane
    through `results` (which hands them to the training ranks); it prints nothing."""
    ignore_stop_signals()
    # One core per worker: the plane scales by workers, so the tokenizer must not fan out threads itself.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tokenizer_path)
        chat = reader_for(src, chat_template, tokenizer_path)
    except Exception as e:  # the same in every replacement: report it once rather than die
        results.put(_failure(e, worker_id, {"source": -1, "epoch": 0, "index": -1}))
        return
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
            tokenized = tokenize_chunk(chunk, paths, src.text_field, tokenizer, eos_id, chat, split)
            if os.getppid() != parent_pid:  # no one would free the block
                return
            results.put(("chunk", worker_id, write_block(chunk, epoch, tokenized, shm_prefix)))
        except Exception as e:  # a bad file fails the same way every time: report it, do not die and retry
            results.put(_failure(e, worker_id, {"source": chunk.source, "epoch": epoch, "index": chunk.index}))


def _failure(e: Exception, worker_id: int, where: dict) -> tuple:
    """A loader's error for the plane: a user error as its one line, anything else with its traceback."""
    kind = "config_error" if isinstance(e, ConfigError) else "error"
    return kind, worker_id, {**where, "message": str(e) if kind == "config_error" else traceback.format_exc()}


def tokenize_chunk(chunk: Chunk, paths: list[Path], text_field: str, tokenizer, eos_id: int,
                   chat=None, split: Split | None = None) -> TokenizedChunk:
    """Read and tokenize one chunk (a chat source's with its ChatReader). Every document ends with eos_id. `split`:
    which side of the source's validation carve-out to keep (data/split.py); None keeps every document."""
    text = read_chunk(chunk, paths, text_field, eos_id, chat)
    if split is not None and not split.everything:
        text = text.select([split.keeps(paths[file], offset) for file, offset in text.keys])
    # Plain text takes the tokenizer's own special tokens (a pretrained Llama's begin-of-text); a rendered chat
    # already holds those its template writes.
    encodings = [] if text.token_docs else tokenizer.encode_batch(text.texts, add_special_tokens=chat is None)
    docs = text.token_docs or [np.asarray(e.ids, dtype=np.uint32) for e in encodings]
    starts = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) + 1 for d in docs], out=starts[1:])
    tokens = np.empty(int(starts[-1]), dtype=np.uint32)
    for d, s in zip(docs, starts[:-1]):
        tokens[s : s + len(d)] = d
    tokens[starts[1:] - 1] = eos_id
    keys = np.asarray(text.keys, dtype=np.int64).reshape(len(docs), 2)
    mask = None
    if text.spans is not None:  # the assistant turns; the end-of-text after a conversation is not one
        mask = np.zeros(len(tokens), dtype=bool)
        for e, spans, s in zip(encodings, text.spans, starts[:-1]):
            mask[s : s + len(e.ids)] = assistant_mask(e.offsets, spans)
    return TokenizedChunk(tokens, starts, keys, mask, text)


def write_block(chunk: Chunk, epoch: int, tokenized: TokenizedChunk, shm_prefix: str = "") -> dict:
    """A tokenized chunk into a new shared block named with its plane's owner prefix (shm.owner_prefix); returns
    what the queue carries to the plane."""
    n_tokens, n_docs = len(tokenized.tokens), len(tokenized.keys)
    n_mask = 0 if tokenized.mask is None else n_tokens
    shm = new_block(block_size(n_tokens, n_docs, n_mask), shm_prefix)
    for dst, src in zip(block_views(shm.buf, n_tokens, n_docs, n_mask), tokenized.arrays()):
        if src is not None:
            dst[:] = src
    name = shm.name
    shm.close()
    # The consumer owns the block from now on (it unlinks it); this process's exit must not remove it.
    resource_tracker.unregister(shm._name, "shared_memory")
    return {
        "source": chunk.source, "index": chunk.index, "epoch": epoch, "shm": name, "n_tokens": n_tokens,
        "n_docs": n_docs, "n_mask": n_mask, "records": tokenized.text.records, "skipped": tokenized.text.skipped,
        "skip_examples": tokenized.text.skip_examples,
    }


def read_block(res: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Copy a chunk out of its shared block and free the block: (tokens, starts, keys, mask or None)."""
    shm = shared_memory.SharedMemory(name=res["shm"])
    tokens, starts, keys, mask = block_views(shm.buf, res["n_tokens"], res["n_docs"], res.get("n_mask", 0))
    out = tokens.copy(), starts.copy(), keys.copy(), mask.astype(bool) if len(mask) else None
    del tokens, starts, keys, mask  # views into the block: it cannot close while they live
    shm.close()
    shm.unlink()
    return out
