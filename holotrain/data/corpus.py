"""The embedded corpus and the tokenizer.

With no `[[data.sources]]` configured, holotrain trains on two sources built on first use from the
installed Python standard library: `code` (each .py file) and `docs` (the docstrings of each file, as
prose). The tokenizer is a byte-level BPE trained on a sample of the sources with HF `tokenizers`, or a
given tokenizer.json; both are cached under data.cache_dir.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import warnings
from pathlib import Path

from holotrain.data.sources import SourceConfig, plan_chunks, read_chunk, source_files
from holotrain.errors import ConfigError

EOS = "<|endoftext|>"
PAD = "<|pad|>"
STDLIB_WEIGHTS = {"code": 0.7, "docs": 0.3}
CORPUS_LAYOUT = 2  # 2: files holding only whitespace left out


def cache_dir(configured: str) -> Path:
    return Path(configured or os.environ.get("HOLOTRAIN_CACHE") or Path.home() / ".cache" / "holotrain")


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished build into place; a concurrent builder that won the race leaves ours unused."""
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def stdlib_sources(root: Path) -> list[SourceConfig]:
    """The embedded default: code and docstrings of this Python's standard library, as two jsonl sources."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(_stdlib_files(lib))
    # The layout's version leads the key, so a cache written by an older layout is not read as this one.
    listing = "\n".join([f"layout {CORPUS_LAYOUT}"] + [f"{p}:{p.stat().st_size}" for p in files])
    key = hashlib.sha256(listing.encode()).hexdigest()[:16]
    directory = root / f"stdlib-{key}"
    if not (directory / "docs.jsonl").is_file():
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".tmp-", dir=directory.parent))
        with open(tmp / "code.jsonl", "w") as code, open(tmp / "docs.jsonl", "w") as docs:
            for path in files:
                try:
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if not text.strip():  # an empty __init__.py is no document (and would count as a skipped record)
                    continue
                name = str(path.relative_to(lib))
                code.write(json.dumps({"text": text, "file": name}) + "\n")
                prose = _docstrings(text)
                if prose:
                    docs.write(json.dumps({"text": prose, "file": name}) + "\n")
        _publish(tmp, directory)
    return [SourceConfig(name=n, path=str(directory / f"{n}.jsonl"), weight=w) for n, w in STDLIB_WEIGHTS.items()]


def _stdlib_files(lib: Path):
    """The .py files under the standard library, not descending into installed packages (site-packages can hold
    a hundred times more files, and every run lists these)."""
    for directory, subdirs, names in os.walk(lib):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]
        yield from (Path(directory, n) for n in names if n.endswith(".py"))


def _docstrings(source: str) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old modules
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    parts = [ast.get_docstring(n) for n in nodes]
    return "\n\n".join(p for p in parts if p)


def train_tokenizer(documents: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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


def sample_documents(sources: list[SourceConfig], budget_mb: float) -> list[str]:
    """Up to budget_mb of text, shared among the sources by weight, from the start of each."""
    total_weight = sum(s.weight for s in sources) or 1.0
    docs: list[str] = []
    for i, src in enumerate(sources):
        files = source_files(src)
        if all(f.suffix == ".npy" for f in files):
            continue
        budget = budget_mb * 2**20 * src.weight / total_weight
        for chunk in plan_chunks(i, files, 1 << 20):
            if budget <= 0:
                break
            for text in read_chunk(chunk, files, src.text_field, eos_id=-1).texts:
                docs.append(text)
                budget -= len(text)
    return docs


def prepare_tokenizer(sources: list[SourceConfig], tokenizer: str, vocab_size: int, sample_mb: float, root: Path):
    """The job's tokenizer: the given tokenizer.json, or a BPE trained on the sources and cached.
    Returns (tokenizers.Tokenizer, path of its tokenizer.json)."""
    from tokenizers import Tokenizer

    if tokenizer:
        tok, path = load_tokenizer(tokenizer)
    else:
        h = hashlib.sha256(json.dumps([vocab_size, sample_mb]).encode())
        for src in sources:
            h.update(f"{src.name}:{src.weight}:{src.text_field}".encode())
            for f in source_files(src):
                h.update(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
        path = root / f"tokenizer-{h.hexdigest()[:16]}" / "tokenizer.json"
        if not path.is_file():
            docs = sample_documents(sources, sample_mb)
            if not docs:
                raise ConfigError("data.tokenizer is empty and the sources hold no text to train one on")
            path.parent.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=path.parent.name + ".tmp-", dir=path.parent.parent))
            train_tokenizer(docs, vocab_size).save(str(tmp / "tokenizer.json"))
            _publish(tmp, path.parent)
        tok = Tokenizer.from_file(str(path))
    special_ids(tok, path)  # a tokenizer without an end-of-text token is refused now, naming the file
    return tok, path


def load_tokenizer(tokenizer: str):
    """data.tokenizer's file loaded: (tokenizers.Tokenizer, its path), or a ConfigError line naming it."""
    from tokenizers import Tokenizer

    path = Path(tokenizer).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.tokenizer: file not found: {tokenizer}")
    try:
        return Tokenizer.from_file(str(path)), path
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ConfigError(f"data.tokenizer: cannot load {tokenizer!r} ({e})") from None


TOKENIZER_CONFIG = "tokenizer_config.json"  # Hugging Face's: special tokens and chat template, beside tokenizer.json


CHAT_TEMPLATE = "chat_template.jinja"  # where newer Hugging Face tokenizers keep the template instead
TOKENIZER_FILES = (TOKENIZER_CONFIG, CHAT_TEMPLATE)  # what travels with a tokenizer.json (run dir, export)


def tokenizer_config(tokenizer_path: str | Path) -> dict:
    """The tokenizer_config.json beside a tokenizer.json ({} where there is none), with the chat template of a
    chat_template.jinja beside it where the JSON has none."""
    path = Path(tokenizer_path).with_name(TOKENIZER_CONFIG)
    config = {}
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not a readable JSON file ({e})") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{path}: expected a JSON object")
    template = path.with_name(CHAT_TEMPLATE)
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = template.read_text()
    return config


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def special_ids(tokenizer, tokenizer_path: str | Path) -> tuple[int, int]:
    """(end-of-text id, padding id) of a tokenizer: the eos and pad tokens its tokenizer_config.json names (a
    Hugging Face model's), else holotrain's own <|endoftext|> and <|pad|>. Padding never becomes a target, so a
    tokenizer without a pad token pads with end-of-text."""
    config = tokenizer_config(tokenizer_path)
    eos_text = _token_text(config.get("eos_token")) or EOS
    eos = tokenizer.token_to_id(eos_text)
    if eos is None:
        raise ConfigError(f"{tokenizer_path}: the tokenizer has no end-of-text token {eos_text!r}")
    pad_text = _token_text(config.get("pad_token")) or PAD
    pad = tokenizer.token_to_id(pad_text)
    return eos, eos if pad is None else pad


def begin_of_text(tokenizer, tokenizer_path: str | Path) -> int | None:
    """The begin-of-text id of a tokenizer, or None where it has none: the bos_token its tokenizer_config.json names,
    else the token its post-processor puts before every text (plain text is encoded with it, worker.py)."""
    named = _token_text(tokenizer_config(tokenizer_path).get("bos_token"))
    if named is not None and tokenizer.token_to_id(named) is not None:
        return tokenizer.token_to_id(named)
    plain, marked = tokenizer.encode("a", add_special_tokens=False).ids, tokenizer.encode("a").ids
    return marked[0] if len(marked) > len(plain) and marked[:1] != plain[:1] else None
