"""Text corpora turned into one flat token file plus the tokenizer that made it, cached on disk.

The embedded default corpus is the installed Python standard library's `.py` files: real text that is
present on every machine with Python. Other corpora are `.txt` files (one document each) or `.jsonl`
files (one document per line, in `data.text_field`), given as a file, a directory or a glob.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from holotrain.config import ConfigError, DataConfig

EOS = "<|endoftext|>"
PAD = "<|pad|>"


@dataclass
class PreparedCorpus:
    tokens: np.ndarray  # flat uint16/uint32 token ids, documents separated by EOS
    tokenizer: Tokenizer
    tokenizer_path: Path
    directory: Path

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def default_cache_dir(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir or os.environ.get("HOLOTRAIN_CACHE") or Path.home() / ".cache" / "holotrain")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def source_files(cfg: DataConfig) -> list[Path]:
    if cfg.dataset == "stdlib":
        return stdlib_files()
    path = Path(cfg.dataset).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
    elif path.is_file():
        files = [path]
    else:
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
    if not files:
        raise ConfigError(f"data.dataset: no .txt or .jsonl files found at {cfg.dataset!r}")
    return files


def iter_documents(files: list[Path], cfg: DataConfig) -> Iterator[str]:
    """Documents in file order, stopping once data.max_corpus_mb of text has been read."""
    budget = int(cfg.max_corpus_mb * 2**20)
    for path in files:
        if budget <= 0:
            return
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)[cfg.text_field]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ConfigError(
                            f"{path}:{lineno}: not a JSON object with a string field {cfg.text_field!r} (data.text_field)"
                        ) from None
                    budget -= len(text)
                    yield text
                    if budget <= 0:
                        return
        else:
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue  # unreadable files in the stdlib tree are skipped
            budget -= len(text)
            yield text


def _fingerprint(files: list[Path], cfg: DataConfig) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([cfg.dataset, cfg.text_field, cfg.tokenizer, cfg.vocab_size, cfg.max_corpus_mb]).encode())
    for p in files:
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    if cfg.tokenizer:
        h.update(Path(cfg.tokenizer).read_bytes())
    return h.hexdigest()[:16]


def train_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tok


def _load_tokenizer(path: str) -> Tokenizer:
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a generic Exception on a bad file
        raise ConfigError(f"data.tokenizer: cannot load {path!r} ({e})") from None


def prepare_corpus(cfg: DataConfig) -> PreparedCorpus:
    """Tokenize the configured corpus once and cache it; later calls with the same inputs reuse it."""
    if cfg.tokenizer and not Path(cfg.tokenizer).is_file():
        raise ConfigError(f"data.tokenizer: file not found: {cfg.tokenizer}")
    files = source_files(cfg)
    directory = default_cache_dir(cfg) / f"corpus-{_fingerprint(files, cfg)}"
    if not (directory / "meta.json").is_file():
        _build(files, cfg, directory)
    meta = json.loads((directory / "meta.json").read_text())
    tokens = np.memmap(directory / "tokens.bin", dtype=meta["dtype"], mode="r")
    tok_path = directory / "tokenizer.json"
    return PreparedCorpus(tokens=tokens, tokenizer=Tokenizer.from_file(str(tok_path)), tokenizer_path=tok_path, directory=directory)


def _build(files: list[Path], cfg: DataConfig, directory: Path) -> None:
    documents = list(iter_documents(files, cfg))
    if not documents:
        raise ConfigError(f"data.dataset: {cfg.dataset!r} holds no text")
    tokenizer = _load_tokenizer(cfg.tokenizer) if cfg.tokenizer else train_tokenizer(documents, cfg.vocab_size)
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise ConfigError(f"data.tokenizer: {cfg.tokenizer!r} has no {EOS} token")
    ids = []
    for enc in tokenizer.encode_batch(documents, add_special_tokens=False):
        ids.append(np.asarray(enc.ids, dtype=np.uint32))
        ids.append(np.asarray([eos], dtype=np.uint32))
    flat = np.concatenate(ids)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    # Build beside the final place and rename, so a crash or a concurrent builder never leaves half a cache.
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".tmp-", dir=directory.parent))
    flat.astype(dtype).tofile(tmp / "tokens.bin")
    tokenizer.save(str(tmp / "tokenizer.json"))
    meta = {"dtype": np.dtype(dtype).name, "tokens": int(flat.size), "documents": len(documents), "files": len(files)}
    (tmp / "meta.json").write_text(json.dumps(meta))
    try:
        os.rename(tmp, directory)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
