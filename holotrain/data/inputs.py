"""The data section's inputs, checked in the trainer's process before anything starts (train/preflight.py calls
check_inputs before the tokenizer is prepared and before the data plane starts): mistakes that would otherwise surface
minutes later inside a loader process surface in seconds, each as one ConfigError line naming the key and the file.

- every source's path or glob matches files, each readable and of a known format;
- a sample of each source's first records, read exactly as the loaders read them (sources.read_chunk and its
  readers), skips no more than data.max_skip_fraction of them;
- data.tokenizer, when given, loads and has an end-of-text token; data.chat_template names a template that exists
  and compiles.

The sample is at most SAMPLE_RECORDS records or SAMPLE_BYTES of input per source, from its first files (a parquet
file's first rows, not its first row group), so the check takes seconds for a corpus of any size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from holotrain.data.chat import ChatReader, ChatTemplate, check_template_choice, special_tokens, template_for
from holotrain.data.corpus import load_tokenizer, special_ids
from holotrain.data.sources import FORMATS, Chunk, ChunkText, SourceConfig, read_chunk, read_parquet_head, source_files
from holotrain.errors import ConfigError

if TYPE_CHECKING:
    from holotrain.data.config import DataConfig

SAMPLE_RECORDS = 1000
SAMPLE_BYTES = 4 << 20
SAMPLE_FILES = 1000  # files looked into per source (a source of many small .txt or .npy files)


def check_inputs(section: DataConfig) -> None:
    """Raises one ConfigError line for the first problem found in the data section's files."""
    tokenizer_path = None
    if section.tokenizer:
        tokenizer, tokenizer_path = load_tokenizer(section.tokenizer)
        special_ids(tokenizer, tokenizer_path)  # no end-of-text token: one line naming the file
    check_template_choice(section.chat_template)
    template = _chat_template(section, tokenizer_path)
    for i, src in enumerate(section.sources):
        files = source_files(src)  # no match, an unknown format: one line naming the key
        for f in files:
            if not os.access(f, os.R_OK):
                raise ConfigError(f"data.sources[{src.name}].path: cannot read {f} (permission denied)")
        chat = None
        if src.format == "chat":
            chat = ChatReader(src, ChatTemplate(template, special_tokens(tokenizer_path) if tokenizer_path else {}))
        sample = sample_source(i, src, files, chat)
        if sample.skipped > section.max_skip_fraction * sample.records:
            raise ConfigError(f"data.sources[{src.name}]: {sample.skipped} of the first {sample.records} records "
                              f"cannot be used, more than data.max_skip_fraction = {section.max_skip_fraction:g} "
                              f"(first: {sample.skip_examples[0]})")


def _chat_template(section: DataConfig, tokenizer_path: Path | None) -> str:
    """The chat sources' template source ("" without chat sources), compiled once here as the trainer does."""
    if not any(s.format == "chat" for s in section.sources):
        return ""
    if tokenizer_path is None and not section.chat_template:
        # The tokenizer is trained on the sources then, and a trained one has no template of its own.
        raise ConfigError("data.chat_template is empty (the tokenizer's own) and data.tokenizer is empty (a tokenizer "
                          "trained on the sources, without a chat template): set data.chat_template to 'chatml', "
                          "'llama3' or a .jinja file, or data.tokenizer to a chat model's tokenizer.json")
    return template_for(section.sources, section.chat_template, tokenizer_path or "")


def sample_source(index: int, src: SourceConfig, files: list[Path], chat: ChatReader | None) -> ChunkText:
    """The counts (records read, skipped, the first skips' file:line and reason) of a source's first records, read
    as its loaders read them: up to SAMPLE_RECORDS records or SAMPLE_BYTES of input, from its first files in order.
    Pre-tokenized (.npy) files hold no records to parse; each is checked to be a 1-D array of token ids."""
    sample, budget = ChunkText(), SAMPLE_BYTES
    for fi, path in enumerate(files[:SAMPLE_FILES]):
        if sample.records >= SAMPLE_RECORDS or budget <= 0:
            break
        kind, size = FORMATS[path.suffix], path.stat().st_size
        where = f"data.sources[{src.name}]: {path}"
        try:
            if kind == "tokens":
                _check_tokens(path, where)
                continue
            if kind == "parquet":
                part = read_parquet_head(path, fi, src.text_field, chat, SAMPLE_RECORDS - sample.records)
            elif kind == "txt":  # one record per file (a directory document joins them, each read alike)
                if size > budget:
                    break
                part = read_chunk(Chunk(index, 0, fi, 0, 0), files, src.text_field, -1, chat)
            else:  # jsonl: the lines that start in the file's first bytes, up to the records still wanted
                size = _lines_end(path, min(size, budget), SAMPLE_RECORDS - sample.records)
                part = read_chunk(Chunk(index, 0, fi, 0, size, src.document, src.path_field), files, src.text_field,
                                  -1, chat)
        except ConfigError:
            raise
        except (OSError, ValueError) as e:  # pyarrow's errors are among these
            raise ConfigError(f"{where} cannot be read as {path.suffix} ({e})") from None
        sample.extend(part)
        budget -= size
    return sample


def _lines_end(path: Path, limit: int, lines: int) -> int:
    """The byte offset after the first `lines` lines of a file, reading at most `limit` bytes."""
    with open(path, "rb") as f:
        head = f.read(limit)
    end = 0
    for _ in range(lines):
        newline = head.find(b"\n", end)
        if newline < 0:
            return len(head)
        end = newline + 1
    return end


def _check_tokens(path: Path, where: str) -> None:
    tokens = np.load(path, mmap_mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"{where} is not a 1-D array of token ids (shape {tokens.shape}, dtype {tokens.dtype})")
