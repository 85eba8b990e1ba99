"""The config's [data] section: the sources, tokenizer and loaders, and the checks on its own keys."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from holotrain.data.sources import validate_sources
from holotrain.section import Section, need


@dataclass
class DataConfig(Section):
    # [[data.sources]] tables (name, path, weight, weight_schedule, text_field, format = "text" | "chat",
    # messages_field, prompt_field, response_field, document = "record" | "directory", path_field; see
    # holotrain/data/sources.py); none: the embedded corpus, two sources built from this Python's
    # standard library (code, and docstrings as prose). A relative path (or glob) is relative to the TOML file's folder;
    # a leading ~ is the home directory.
    sources: list = field(default_factory=list)
    seq_len: int = 256
    # Path to a tokenizer.json (relative: to the TOML file's folder); empty = train a byte-level BPE on the sources.
    tokenizer: str = ""
    vocab_size: int = 4096  # size of the BPE trained when data.tokenizer is empty
    tokenizer_sample_mb: float = 8.0  # text the BPE is trained on
    cache_dir: str = ""  # empty: $HOLOTRAIN_CACHE or ~/.cache/holotrain; relative: to the current directory
    workers: int = 4  # most loader processes per node, over all sources (they scale with demand)
    chunk_mb: float = 1.0  # unit of work of a loader
    prefetch_steps: int = 4  # steps the plane builds ahead of training
    # Balance attention cost (sum of squared document lengths) across data-parallel ranks in every micro-batch, reaching
    # up to balance_window steps ahead when the step's own samples cannot be evened (data/packing.py StepFormer);
    # false: in order.
    balance: bool = True
    # With balance: how many steps ahead a micro-batch may take its samples from (data/packing.py StepFormer), when
    # the step's own samples cannot be evened; no sample trains more than this many steps late.
    balance_window: int = 4
    shuffle: bool = True  # chunk order shuffled per epoch
    log_samples: bool = False  # write RUN_DIR/samples.jsonl: the documents of every sample (rank 0's)
    backend: str = "local"  # loader processes: "local", or "ray" actors (pip install holotrain[ray])
    ray_address: str = ""  # Ray cluster to join; empty: start one on this node
    # A source whose loaders skip more than this share of its records (malformed lines, a missing text field, a chat
    # record the template refuses) stops the run with one line naming its first bad file:line.
    max_skip_fraction: float = 0.01
    # For chat sources: "" the tokenizer's own, "chatml", "llama3" or a .jinja file's path (relative: to the TOML
    # file's folder).
    chat_template: str = ""

    def check(self) -> None:
        need(self.seq_len > 0, f"data.seq_len must be positive, got {self.seq_len}")
        # Imported here: the chat templates load jinja2, which a config that is only read does not need.
        from holotrain.data.chat import check_template_choice

        validate_sources(self.sources)
        check_template_choice(self.chat_template)
        need(self.backend in ("local", "ray"), f"data.backend must be 'local' or 'ray', got {self.backend!r}")
        if self.backend == "ray":
            need(importlib.util.find_spec("ray") is not None,
                 "data.backend = 'ray' needs Ray: pip install 'holotrain[ray]'")
        need(self.workers >= 1, f"data.workers must be >= 1, got {self.workers}")
        need(self.chunk_mb > 0, f"data.chunk_mb must be positive, got {self.chunk_mb}")
        need(self.balance_window >= 1, f"data.balance_window must be >= 1, got {self.balance_window}")
        need(self.prefetch_steps >= 1, f"data.prefetch_steps must be >= 1, got {self.prefetch_steps}")
        need(0 <= self.max_skip_fraction <= 1,
             f"data.max_skip_fraction must be in [0, 1], got {self.max_skip_fraction}")
        need(self.vocab_size >= 259,
             f"data.vocab_size must be at least 259 (256 bytes + special tokens), got {self.vocab_size}")
