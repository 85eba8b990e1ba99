"""Sources: where documents come from, cut into chunks that loader workers read independently.

A source is a file, directory or glob of one format: `.jsonl` (one JSON object per line, text in
`text_field`), `.txt` (one document per file), `.parquet` (one document per row, via pyarrow) or `.npy`
(pre-tokenized: a 1-D token array, documents separated by the tokenizer's end-of-text id). A chat source
(`format = "chat"`, .jsonl or .parquet) holds conversations instead, which a ChatReader (chat.py) renders into
text and the spans of its assistant turns.

Every document has a stable key (file index, offset: byte offset of its line, row, or token offset), and
every chunk a stable index, so the order of documents is a pure function of the sources and the seed:
resume and failover replay exactly, whatever the number of workers.

This module is imported by loader processes: it must not import torch.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from holotrain.errors import ConfigError

FORMATS = {".jsonl": "jsonl", ".txt": "txt", ".parquet": "parquet", ".npy": "tokens"}
SOURCE_FORMATS = ("text", "chat")  # what a source's records are: documents, or conversations
CHAT_FILES = (".jsonl", ".parquet")
MAX_SKIP_EXAMPLES = 5


@dataclass
class SourceConfig:
    name: str = ""
    path: str = ""
    weight: float = 1.0
    # Piecewise-linear weight over optimizer steps, e.g. [[0, 0.9], [1000, 0.5]]; empty: constant `weight`.
    weight_schedule: list = field(default_factory=list)
    text_field: str = "text"
    format: str = "text"  # "text" | "chat": records of `messages_field`, or of `prompt_field` and `response_field`
    messages_field: str = "messages"  # a list of {"role": system | user | assistant, "content": ...}
    prompt_field: str = "prompt"  # with response_field: a user message and the assistant's answer
    response_field: str = "response"


def validate_sources(sources: list[SourceConfig]) -> None:
    """The checks of the [[data.sources]] tables (config.validate): the first failing one as a ConfigError."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    names = [s.name for s in sources]
    for i, src in enumerate(sources):
        need(bool(src.name), f"data.sources[{i}].name is empty")
        need(bool(src.path), f"data.sources[{src.name}].path is empty")
        need(src.weight >= 0, f"data.sources[{src.name}].weight must be >= 0, got {src.weight}")
        sched = src.weight_schedule
        ok = isinstance(sched, list) and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) for x in p) and p[1] >= 0
            for p in sched
        ) and all(a[0] < b[0] for a, b in zip(sched, sched[1:]))
        need(ok, f"data.sources[{src.name}].weight_schedule must be [[step, weight], ...] with increasing steps")
        need(src.format in SOURCE_FORMATS, f"data.sources[{src.name}].format must be 'text' or 'chat', got {src.format!r}")
        for key in ("messages_field", "prompt_field", "response_field"):
            need(src.format != "chat" or bool(getattr(src, key)), f"data.sources[{src.name}].{key} is empty")
    need(len(set(names)) == len(names), f"data.sources: names must be unique, got {names}")
    need(not sources or any(s.weight > 0 or s.weight_schedule for s in sources), "data.sources: all weights are 0")


@dataclass(frozen=True)
class Chunk:
    source: int
    index: int  # position in the source's chunk list
    file: int
    start: int  # bytes (jsonl), rows (parquet), tokens (npy); txt: 0
    stop: int


def source_files(src: SourceConfig) -> list[Path]:
    path = Path(src.path).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FORMATS)
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    if not files:
        raise ConfigError(f"data.sources[{src.name}].path: no .jsonl, .txt, .parquet or .npy files at {src.path!r}")
    for f in files:
        if f.suffix not in FORMATS:
            raise ConfigError(f"data.sources[{src.name}]: unknown format of {f} (known: {', '.join(FORMATS)})")
        if src.format == "chat" and f.suffix not in CHAT_FILES:
            raise ConfigError(f"data.sources[{src.name}]: format = 'chat' reads {' or '.join(CHAT_FILES)} files, not {f}")
    return files


def plan_chunks(source_index: int, files: list[Path], chunk_bytes: int) -> list[Chunk]:
    """Cut a source into chunks of about chunk_bytes of input each."""
    chunks: list[Chunk] = []

    def add(file: int, start: int, stop: int) -> None:
        chunks.append(Chunk(source_index, len(chunks), file, start, stop))

    for fi, path in enumerate(files):
        kind = FORMATS[path.suffix]
        if kind == "jsonl":
            size = path.stat().st_size
            for start in range(0, max(size, 1), chunk_bytes):
                add(fi, start, min(size, start + chunk_bytes))
        elif kind == "txt":
            add(fi, 0, 0)
        elif kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            row = 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                add(fi, row, row + n)
                row += n
        else:  # tokens
            n = len(np.load(path, mmap_mode="r"))
            step = max(1, chunk_bytes // 4)
            for start in range(0, max(n, 1), step):
                add(fi, start, min(n, start + step))
    return chunks


class BadRecord(ValueError):
    """A record that cannot be used (a malformed conversation): skipped and counted, with this reason."""


@dataclass
class ChunkText:
    """What reading one chunk gives: documents with their keys, plus what had to be skipped."""

    keys: list[tuple[int, int]] = field(default_factory=list)  # (file, offset)
    texts: list[str] = field(default_factory=list)  # text documents
    token_docs: list[np.ndarray] = field(default_factory=list)  # pre-tokenized documents (npy sources)
    # Chat sources: per text, the (start, stop) character spans of its assistant turns (the tokens trained on).
    spans: list[list[tuple[int, int]]] | None = None
    skipped: int = 0
    skip_examples: list[str] = field(default_factory=list)

    def skip(self, where: str, why: str) -> None:
        self.skipped += 1
        if len(self.skip_examples) < MAX_SKIP_EXAMPLES:
            self.skip_examples.append(f"{where}: {why}")

    def add(self, key: tuple[int, int], text: str, spans: list[tuple[int, int]] | None = None) -> None:
        self.keys.append(key)
        self.texts.append(text)
        if spans is not None:
            self.spans.append(spans)


def read_chunk(chunk: Chunk, files: list[Path], text_field: str, eos_id: int, chat=None) -> ChunkText:
    """The documents of one chunk. `chat`: the source's ChatReader (chat.py) when it is a chat source."""
    path = files[chunk.file]
    kind = FORMATS[path.suffix]
    out = ChunkText(spans=[] if chat is not None else None)
    if path.stat().st_size == 0:
        out.skip(str(path), "empty file")
    elif kind == "jsonl":
        _read_jsonl(chunk, path, text_field, chat, out)
    elif kind == "txt":
        _read_txt(chunk, path, out)
    elif kind == "parquet":
        _read_parquet(chunk, path, text_field, chat, out)
    else:
        _read_tokens(chunk, path, eos_id, out)
    return out


def _read_jsonl(chunk: Chunk, path: Path, text_field: str, chat, out: ChunkText) -> None:
    for offset, lineno, raw in _lines_in_range(path, chunk.start, chunk.stop):
        where = f"{path}:{lineno}" if lineno else f"{path}@{offset}"
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            out.skip(where, "undecodable bytes")
            continue
        except json.JSONDecodeError:
            out.skip(where, f"not a JSON object with a string field {text_field!r}" if chat is None else "not valid JSON")
            continue
        if chat is not None:
            _add_conversation(chat, record, (chunk.file, offset), where, out)
            continue
        if not isinstance(record, dict) or text_field not in record:
            out.skip(where, f"not a JSON object with a string field {text_field!r}")
            continue
        text = record[text_field]
        if not isinstance(text, str):
            out.skip(where, f"field {text_field!r} is not a string")
        elif not text:
            out.skip(where, "empty text")
        else:
            out.add((chunk.file, offset), text)


def _add_conversation(chat, record, key: tuple[int, int], where: str, out: ChunkText) -> None:
    try:
        text, spans = chat.read(record)
    except BadRecord as e:
        out.skip(where, str(e))
        return
    out.add(key, text, spans)


def _read_txt(chunk: Chunk, path: Path, out: ChunkText) -> None:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        out.skip(str(path), "undecodable bytes")
        return
    if not text.strip():
        out.skip(str(path), "blank file")
        return
    out.add((chunk.file, 0), text)


def _read_parquet(chunk: Chunk, path: Path, text_field: str, chat, out: ChunkText) -> None:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if chat is None and text_field not in names:
        raise ConfigError(f"{path}: no column {text_field!r} (data.sources text_field)")
    columns = chat.parquet_columns(names, path) if chat is not None else [text_field]
    row, group = 0, 0
    while row < chunk.start:  # find the row group this chunk is
        row += pf.metadata.row_group(group).num_rows
        group += 1
    records = pf.read_row_group(group, columns=columns).to_pylist()
    for i, record in enumerate(records):
        where, key = f"{path}:row {chunk.start + i}", (chunk.file, chunk.start + i)
        if chat is not None:
            _add_conversation(chat, record, key, where, out)
        elif not isinstance(record[text_field], str) or not record[text_field]:
            out.skip(where, f"missing or empty {text_field!r}")
        else:
            out.add(key, record[text_field])


def _read_tokens(chunk: Chunk, path: Path, eos_id: int, out: ChunkText) -> None:
    """Documents end at eos_id; a document belongs to the chunk it starts in."""
    tokens = np.load(path, mmap_mode="r")
    pos = chunk.start
    if pos > 0 and tokens[pos - 1] != eos_id:  # the document in progress belongs to the previous chunk
        pos = _next_doc_start(tokens, pos, eos_id)
    while pos < chunk.stop:
        end = _next_doc_start(tokens, pos, eos_id)
        doc = np.asarray(tokens[pos:end], dtype=np.uint32)
        if doc[-1] == eos_id:
            doc = doc[:-1]
        if len(doc):
            out.keys.append((chunk.file, pos))
            out.token_docs.append(doc)
        pos = end


def _next_doc_start(tokens: np.ndarray, pos: int, eos_id: int, window: int = 1 << 16) -> int:
    """Index just past the next eos at or after pos (or the end of the array)."""
    n = len(tokens)
    while pos < n:
        block = np.asarray(tokens[pos : pos + window])
        hits = np.flatnonzero(block == eos_id)
        if len(hits):
            return pos + int(hits[0]) + 1
        pos += len(block)
    return n


def _lines_in_range(path: Path, start: int, stop: int) -> Iterator[tuple[int, int, bytes]]:
    """(byte offset, line number or 0 when unknown, raw line) of lines that start in [start, stop)."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line that started before `start` belongs to the previous chunk
        lineno = 1 if start == 0 else 0
        while True:
            offset = f.tell()
            if offset >= stop:
                return
            raw = f.readline()
            if not raw:
                return
            yield offset, lineno, raw
            if lineno:
                lineno += 1
