"""Sources: where documents come from, cut into chunks that loader workers read independently.

A source is a file, directory or glob of one format: `.jsonl` (one JSON object per line, text in
`text_field`), `.txt` (one document per file), `.parquet` (one document per row, via pyarrow) or `.npy`
(pre-tokenized: a 1-D token array, documents separated by the tokenizer's end-of-text id). With
`document = "directory"`, a directory is one document instead: the .txt files of each directory, or the consecutive
.jsonl records whose `path_field` names a file of one directory (a repository's files as one long document). A chat source
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
DOCUMENTS = ("record", "directory")  # what one document is: a record (line, row, .txt file), or a directory
DIRECTORY_FILES = (".jsonl", ".txt")
JOIN = "\n\n"  # between the files of a directory document
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
    # "record": each line, row or .txt file is a document. "directory": the files of one directory make one document,
    # in path order (documents far longer than data.seq_len are cut into samples, as any): the .txt files of each
    # directory, or consecutive .jsonl records whose `path_field` (the embedded corpus writes "file") lies in one.
    document: str = "record"
    path_field: str = "file"


def validate_sources(sources: list[SourceConfig], section: str = "data") -> None:
    """The checks of the [[data.sources]] (or [[eval.sources]]) tables: the first failing one as a ConfigError."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    names = [s.name for s in sources]
    for i, src in enumerate(sources):
        need(bool(src.name), f"{section}.sources[{i}].name is empty")
        need(bool(src.path), f"{section}.sources[{src.name}].path is empty")
        need(src.weight >= 0, f"{section}.sources[{src.name}].weight must be >= 0, got {src.weight}")
        sched = src.weight_schedule
        ok = isinstance(sched, list) and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) for x in p) and p[1] >= 0
            for p in sched
        ) and all(a[0] < b[0] for a, b in zip(sched, sched[1:]))
        need(ok, f"{section}.sources[{src.name}].weight_schedule must be [[step, weight], ...] with increasing steps")
        need(src.format in SOURCE_FORMATS,
             f"{section}.sources[{src.name}].format must be 'text' or 'chat', got {src.format!r}")
        for key in ("messages_field", "prompt_field", "response_field"):
            need(src.format != "chat" or bool(getattr(src, key)), f"{section}.sources[{src.name}].{key} is empty")
        need(src.document in DOCUMENTS,
             f"{section}.sources[{src.name}].document must be 'record' or 'directory', got {src.document!r}")
        need(src.document == "record" or src.format == "text",
             f"{section}.sources[{src.name}].document = 'directory' joins text documents, not format = {src.format!r}")
        need(src.document == "record" or bool(src.path_field), f"{section}.sources[{src.name}].path_field is empty")
    need(len(set(names)) == len(names), f"{section}.sources: names must be unique, got {names}")
    need(not sources or any(s.weight > 0 or s.weight_schedule for s in sources),
         f"{section}.sources: all weights are 0")


@dataclass(frozen=True)
class Chunk:
    source: int
    index: int  # position in the source's chunk list
    file: int
    start: int  # bytes (jsonl), rows (parquet), tokens (npy); txt: 0; a directory of txt: its first file
    stop: int  # a directory of txt: one past its last file
    document: str = "record"  # SourceConfig.document
    path_field: str = ""  # SourceConfig.path_field, for document = "directory"


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
        if src.document == "directory" and f.suffix not in DIRECTORY_FILES:
            raise ConfigError(f"data.sources[{src.name}]: document = 'directory' reads "
                              f"{' or '.join(DIRECTORY_FILES)} files, not {f}")
    if src.document == "directory":  # each directory's files next to each other (a subdirectory's come after)
        files.sort(key=lambda f: (f.parent.parts, f.name))
    return files


def plan_chunks(source_index: int, files: list[Path], chunk_bytes: int, document: str = "record",
                path_field: str = "") -> list[Chunk]:
    """Cut a source into chunks of about chunk_bytes of input each (a directory of .txt files, with
    document = "directory": one chunk)."""
    chunks: list[Chunk] = []

    def add(file: int, start: int, stop: int) -> None:
        chunks.append(Chunk(source_index, len(chunks), file, start, stop, document, path_field))

    for fi, path in enumerate(files):
        kind = FORMATS[path.suffix]
        if document == "directory" and kind == "txt":
            if fi == 0 or files[fi - 1].parent != path.parent:
                last = fi
                while last + 1 < len(files) and files[last + 1].parent == path.parent:
                    last += 1
                add(fi, fi, last + 1)
        elif kind == "jsonl":
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
    records: int = 0  # records read: those kept (a directory document counts each of its records) and those skipped
    skipped: int = 0
    skip_examples: list[str] = field(default_factory=list)

    def skip(self, where: str, why: str) -> None:
        self.records += 1
        self.skipped += 1
        if len(self.skip_examples) < MAX_SKIP_EXAMPLES:
            self.skip_examples.append(f"{where}: {why}")

    def add(self, key: tuple[int, int], text: str, spans: list[tuple[int, int]] | None = None,
            records: int = 1) -> None:
        self.records += records
        self.keys.append(key)
        self.texts.append(text)
        if spans is not None:
            self.spans.append(spans)

    def select(self, keep: list[bool]) -> ChunkText:
        """The documents where `keep` is true (the counts of what was read unchanged)."""
        out = ChunkText(records=self.records, skipped=self.skipped, skip_examples=self.skip_examples,
                        spans=None if self.spans is None else [s for s, k in zip(self.spans, keep) if k])
        out.keys = [x for x, k in zip(self.keys, keep) if k]
        if self.token_docs:
            out.token_docs = [x for x, k in zip(self.token_docs, keep) if k]
        else:
            out.texts = [x for x, k in zip(self.texts, keep) if k]
        return out

    def extend(self, other: ChunkText) -> None:
        """Adds another part's counts (not its documents)."""
        self.records += other.records
        self.skipped += other.skipped
        self.skip_examples = (self.skip_examples + other.skip_examples)[:MAX_SKIP_EXAMPLES]


def read_chunk(chunk: Chunk, files: list[Path], text_field: str, eos_id: int, chat=None) -> ChunkText:
    """The documents of one chunk. `chat`: the source's ChatReader (chat.py) when it is a chat source."""
    path = files[chunk.file]
    kind = FORMATS[path.suffix]
    out = ChunkText(spans=[] if chat is not None else None)
    if chunk.document == "directory" and kind == "txt":
        _read_txt_directory(chunk, files, out)
    elif path.stat().st_size == 0:
        out.skip(str(path), "empty file")
    elif chunk.document == "directory":
        _read_jsonl_directories(chunk, path, text_field, chunk.path_field, out)
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


def _read_txt_directory(chunk: Chunk, files: list[Path], out: ChunkText) -> None:
    """The .txt files of one directory (files[start:stop]) as one document; unreadable ones skipped and counted."""
    parts = []
    for fi in range(chunk.start, chunk.stop):
        one = ChunkText()
        _read_txt(chunk, files[fi], one)
        parts += one.texts
        out.extend(one)
    if parts:
        out.add((chunk.file, 0), JOIN.join(parts), records=0)  # its files are counted above


def _read_jsonl_directories(chunk: Chunk, path: Path, text_field: str, path_field: str, out: ChunkText) -> None:
    """Consecutive records whose `path_field` lies in one directory, joined into one document. A document belongs
    to the chunk its first record starts in: that chunk reads on past its end while the directory lasts, and the next
    chunk passes over those records. A blank line, or a record that is skipped (and counted), ends the document in
    progress; a record with a text but no path is a document of its own."""
    texts, key, directory = [], None, None

    def flush() -> None:
        nonlocal texts, key
        if texts:
            out.add(key, JOIN.join(texts), records=len(texts))
        texts, key = [], None

    with open(path, "rb") as f:
        previous = None  # the directory of the previous chunk's document that runs into this one
        if chunk.start > 0:
            previous = _directory_of(_line_before(f, chunk.start), text_field, path_field)
            f.seek(chunk.start - 1)
            f.readline()  # the line that started before `start` belongs to the previous chunk
        lineno = 1 if chunk.start == 0 else 0
        while True:
            offset = f.tell()
            raw = f.readline()
            if not raw:
                break
            if offset >= chunk.stop and (not texts or _directory_of(raw, text_field, path_field) != directory):
                break  # past the end, only the document in progress goes on
            where = f"{path}:{lineno}" if lineno else f"{path}@{offset}"
            lineno = lineno + 1 if lineno else 0
            record = _record_text(raw, text_field, path_field) if raw.strip() else None
            if previous is not None:
                if isinstance(record, tuple) and record[1] == previous:
                    continue
                previous = None
            if not isinstance(record, tuple) or record[1] is None or record[1] != directory:
                flush()
                directory = None
            if isinstance(record, str):
                out.skip(where, record)
            if not isinstance(record, tuple):
                continue
            texts.append(record[0])
            key = key or (chunk.file, offset)
            directory = record[1]
            if directory is None:  # no path: a document of its own
                flush()
        flush()


def _record_text(raw: bytes, text_field: str, path_field: str):
    """(text, directory or None) of a .jsonl line, or why it is skipped (a str)."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return "undecodable bytes"
    except json.JSONDecodeError:
        return f"not a JSON object with a string field {text_field!r}"
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        return f"not a JSON object with a string field {text_field!r}"
    if not record[text_field]:
        return "empty text"
    where = record.get(path_field)
    return record[text_field], (str(Path(where).parent) if isinstance(where, str) and where else None)


def _directory_of(raw: bytes, text_field: str, path_field: str) -> str | None:
    """The directory a .jsonl line's record belongs to; None where it starts no document that others join."""
    if not raw or not raw.strip():
        return None
    record = _record_text(raw, text_field, path_field)
    return None if isinstance(record, str) else record[1]


def _line_before(f, pos: int, block: int = 1 << 16) -> bytes:
    """The line that starts before byte `pos` and runs up to it (or over it): the one the previous chunk ends in."""
    start = pos - 1  # the byte before pos ends or belongs to that line
    while start > 0:
        f.seek(max(0, start - block))
        data = f.read(start - max(0, start - block))
        hit = data.rfind(b"\n")
        if hit >= 0:
            start = max(0, start - block) + hit + 1
            break
        start = max(0, start - block)
    f.seek(max(start, 0))
    return f.readline()


def _read_parquet(chunk: Chunk, path: Path, text_field: str, chat, out: ChunkText) -> None:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    columns = _parquet_columns(pf, path, text_field, chat)
    row, group = 0, 0
    while row < chunk.start:  # find the row group this chunk is
        row += pf.metadata.row_group(group).num_rows
        group += 1
    _parquet_records(pf.read_row_group(group, columns=columns).to_pylist(), chunk.file, chunk.start, path, text_field,
                     chat, out)


def read_parquet_head(path: Path, file_index: int, text_field: str, chat, rows: int) -> ChunkText:
    """The first `rows` rows of a parquet file read as a loader reads them, without reading a whole row group (for
    data.inputs' sample of a source)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    columns = _parquet_columns(pf, path, text_field, chat)
    out = ChunkText(spans=[] if chat is not None else None)
    for batch in pf.iter_batches(batch_size=max(1, rows), columns=columns):
        _parquet_records(batch.to_pylist(), file_index, 0, path, text_field, chat, out)
        break
    return out


def _parquet_columns(pf, path: Path, text_field: str, chat) -> list[str]:
    names = pf.schema_arrow.names
    if chat is None and text_field not in names:
        raise ConfigError(f"{path}: no column {text_field!r} (data.sources text_field)")
    return chat.parquet_columns(names, path) if chat is not None else [text_field]


def _parquet_records(records: list[dict], file_index: int, first_row: int, path: Path, text_field: str, chat,
                     out: ChunkText) -> None:
    for i, record in enumerate(records):
        where, key = f"{path}:row {first_row + i}", (file_index, first_row + i)
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
            out.records += 1
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
