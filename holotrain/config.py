"""Job configuration: the sections composed into one Config, TOML files, `--section.key=value` overrides, resolution.

Precedence: dataclass defaults < TOML file (`--config`) < command-line overrides. The resolved config
(every model dimension filled in from its preset) is what a run saves as `config.toml` and what a
resumed run reads back.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from holotrain.config_checks import validate
from holotrain.config_values import closest, coerce
from holotrain.data.config import DataConfig
from holotrain.data.sources import SourceConfig, validate_sources
from holotrain.errors import ConfigError
from holotrain.hw.config import HwConfig
from holotrain.memory.config import MemoryConfig
from holotrain.model.config import ModelConfig
from holotrain.model.registry import (DEFAULT_FAMILY, check as check_model, fix_switches, model_args,
                                      preset as family_preset)
from holotrain.parallel.config import PP_SCHEDULES, ParallelConfig
from holotrain.plan.config import PlanConfig
from holotrain.profile.config import ProfileConfig
from holotrain.section import Section, need

# What other modules import from here. Each lever's section is defined with the lever (holotrain/<lever>/config.py)
# and re-exported; the trainer's own sections (job, training, checkpoint) are defined below.
__all__ = [
    "PP_SCHEDULES", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "HwConfig", "JobConfig",
    "MemoryConfig", "ModelConfig", "ParallelConfig", "PlanConfig", "ProfileConfig", "TrainingConfig",
    "batch_layout", "default_job_name", "find_config", "load_config", "parse_overrides", "resolve",
    "shipped_configs", "validate",
]


@dataclass
class JobConfig(Section):
    # Names the run directory, runs/<name>, unless job.run_dir says otherwise. Empty: the config file's name (sft for
    # sft.toml), else the directory's name of model.init_from, else "default" (the embedded default job).
    name: str = ""
    # Empty: runs/<name>. An output folder: a relative path is relative to the current directory, in a TOML file too.
    run_dir: str = ""
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # Mean time between failures of the job's machines, in hours: the plan's checkpoint interval (Young/Daly) comes
    # from it and the measured time a save blocks.
    mtbf_hours: float = 24.0

    def check(self) -> None:
        need(self.device in ("auto", "cpu", "cuda"), f"job.device must be auto, cpu or cuda, got {self.device!r}")
        need(self.mtbf_hours > 0, f"job.mtbf_hours must be positive, got {self.mtbf_hours}")


@dataclass
class TrainingConfig(Section):
    steps: int = 150
    batch_size: int = 16  # global: sequences per optimizer step, over all ranks and micro-batches
    micro_batch_size: int = 0  # per rank per forward; 0 = batch_size / world size (no accumulation)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 15
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    compile: bool = False
    # Preferred kernel for unpacked causal attention on GPU (auto | cudnn | flash). A packed micro-batch from the data
    # plane whose rows hold more than one document carries document ids and uses flex attention with a document
    # mask; one whose rows each hold a piece of one document takes this kernel.
    attention: str = "auto"
    log_every: int = 10
    # A step whose loss or gradient norm is not finite is skipped (weights and optimizer state untouched) and
    # counted (train.nonfinite_steps); this many in a row stop the run with exit code 3 (checked at logged steps).
    max_nonfinite_steps: int = 20
    # FP8 matmuls for the linear layers (holotrain/precision): none | tensorwise | rowwise (torchao float8 training)
    # | delayed (scales from each tensor's recent maxima, casts fused into their producers: precision/delayed.py) |
    # auto (where a supported GPU's measured FP8 GEMMs beat bf16 at the layer's shapes: delayed on one GPU if the
    # memory plan fits it, else tensorwise). fp8_skip: name patterns (fnmatch) of linear layers kept in the compute dtype.
    # fp8_emulate: FP8 numerics without FP8 hardware (slow; for tests on a CPU).
    fp8: str = "none"
    fp8_skip: list[str] = field(default_factory=lambda: ["output"])
    fp8_emulate: bool = False
    # A MoE model on one device under bf16 autocast: its expert weights cast once a step, not at each micro-batch,
    # and their gradients summed over the micro-batches in bf16 (model/moe.py's ExpertCopies); false: the cast at
    # each forward and an fp32 sum.
    expert_weight_copies: bool = True

    def check(self) -> None:
        need(self.steps > 0, f"training.steps must be positive, got {self.steps}")
        need(self.batch_size > 0, f"training.batch_size must be positive, got {self.batch_size}")
        need(self.micro_batch_size >= 0, f"training.micro_batch_size must be >= 0, got {self.micro_batch_size}")
        need(self.lr > 0, f"training.lr must be positive, got {self.lr}")
        need(0 <= self.min_lr_ratio <= 1, f"training.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(self.warmup_steps >= 0, f"training.warmup_steps must be >= 0, got {self.warmup_steps}")
        need(self.weight_decay >= 0, f"training.weight_decay must be >= 0, got {self.weight_decay}")
        need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "training.beta1 and training.beta2 must be in [0, 1)")
        need(self.grad_clip >= 0, f"training.grad_clip must be >= 0, got {self.grad_clip}")
        need(self.dtype in ("auto", "bf16", "fp32"), f"training.dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        need(self.attention in ("auto", "cudnn", "flash"),
             f"training.attention must be auto, cudnn or flash, got {self.attention!r}")
        need(self.log_every > 0, f"training.log_every must be positive, got {self.log_every}")
        need(self.fp8 in ("none", "tensorwise", "rowwise", "delayed", "auto"),
             f"training.fp8 must be none, tensorwise, rowwise, delayed or auto, got {self.fp8!r}")
        need(self.max_nonfinite_steps > 0,
             f"training.max_nonfinite_steps must be positive, got {self.max_nonfinite_steps}")


@dataclass
class CheckpointConfig(Section):
    every: int = 50  # steps between checkpoints; 0 = only the final one
    keep: int = 2  # newest checkpoints kept
    resume: bool = True  # continue from the newest intact checkpoint in the run directory
    # Write checkpoints in the background: training blocks only while the state is copied to host memory.
    async_save: bool = True
    # In-memory snapshots: every this many steps (0 = off) the state also lands in host RAM that outlives the
    # process (/dev/shm); a restart resumes from the newest of RAM and disk. memory_gb caps the RAM they take.
    memory_every: int = 0
    memory_gb: float = 64.0
    save_final: bool = True
    # The first SIGINT or SIGTERM finishes the step under way and saves a checkpoint; the wait for its write is
    # bounded by this many seconds (a scheduler's grace period), after which the process exits without it.
    interrupt_grace_s: float = 120.0
    # Keep the checkpoint of the lowest eval.loss (evaluated at a checkpoint's step) besides the newest `keep`, named
    # by RUN_DIR/checkpoints/best.json: a fine-tune's best step survives its later, worse ones.
    keep_best: bool = False

    def check(self) -> None:
        need(self.every >= 0, f"checkpoint.every must be >= 0, got {self.every}")
        need(self.keep >= 1, f"checkpoint.keep must be >= 1, got {self.keep}")
        need(self.memory_every >= 0, f"checkpoint.memory_every must be >= 0 (0 = off), got {self.memory_every}")
        need(self.memory_gb > 0, f"checkpoint.memory_gb must be positive, got {self.memory_gb}")
        need(self.interrupt_grace_s > 0,
             f"checkpoint.interrupt_grace_s must be positive, got {self.interrupt_grace_s}")


@dataclass
class EvalConfig(Section):
    """Validation (holotrain/train/evaluation.py): the loss on documents training never sees."""

    every: int = 50  # steps between evaluations, and one at the end of the run; 0 = off
    batches: int = 2  # batches of training.batch_size rows each eval scores, shared among the sources by weight
    # The share of each training source's documents held out (whole documents, by a hash of where they are: the
    # same split on every rank, after a resume and after a loader restarts); used when eval.sources is empty.
    holdout: float = 0.01
    # [[eval.sources]] tables (keys as [[data.sources]]): evaluate on these instead of a held-out share.
    sources: list = field(default_factory=list)
    # Each eval continues these prompts greedily by sample_tokens tokens (eval.samples in the metrics and the
    # report); empty: the opening of each source's first evaluation document. sample_tokens = 0: none.
    prompts: list = field(default_factory=list)
    sample_tokens: int = 32

    def check(self) -> None:
        need(self.every >= 0, f"eval.every must be >= 0 (0 = off), got {self.every}")
        need(self.batches >= 1, f"eval.batches must be >= 1, got {self.batches}")
        need(self.sample_tokens >= 0, f"eval.sample_tokens must be >= 0 (0 = no samples), got {self.sample_tokens}")
        need(all(isinstance(p, str) and p for p in self.prompts),
             f"eval.prompts must be a list of non-empty strings, got {self.prompts!r}")
        need(0 <= self.holdout < 1, f"eval.holdout must be in [0, 1), got {self.holdout}")
        if self.sources:
            validate_sources(self.sources, "eval")
        need(self.sources or self.holdout > 0 or self.every == 0, "eval.holdout = 0 holds no document out: set "
             "eval.sources, a holdout share, or eval.every = 0")


@dataclass
class Config(Section):
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    hw: HwConfig = field(default_factory=HwConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_dict())

    @property
    def run_dir(self) -> Path:
        return Path(self.job.run_dir or f"runs/{self.job.name}")

    def freeze(self) -> Config:
        """Makes this config and its sections read-only: a resolved config is shared by every lever, and none may
        change what another reads. Returns self."""
        for f in dataclasses.fields(self):
            object.__setattr__(getattr(self, f.name), "_frozen", True)
        object.__setattr__(self, "_frozen", True)
        return self

    @property
    def frozen(self) -> bool:
        return self._frozen


# --------------------------------------------------------------------------------------------
# Loading


def _known_keys() -> dict[str, list[str]]:
    """Every section's keys, in the order they are declared."""
    sections = typing.get_type_hints(Config)
    return {f.name: [k.name for k in dataclasses.fields(sections[f.name])] for f in dataclasses.fields(Config)}


def _unknown_key(section: str, key: str) -> ConfigError:
    """The error for a section.key the config does not have, naming the closest known key."""
    known = _known_keys()
    if section not in known:
        near = closest(section, known)
        if near is None:
            return ConfigError(f"unknown config section {section} in {section}.{key} (sections: {', '.join(known)})")
        near_key = key if key in known[near] else closest(key, known[near])
        suggestion = f"{near}.{near_key}" if near_key else near
        return ConfigError(f"unknown config section {section} in {section}.{key} (did you mean {suggestion}?)")
    elsewhere = [s for s, keys in known.items() if key in keys]  # the right key in the wrong section
    near_key = closest(key, known[section])
    if elsewhere:
        hint = f"did you mean {elsewhere[0]}.{key}?"
    elif near_key:
        hint = f"did you mean {section}.{near_key}?"
    else:
        hint = f"holotrain train --help {section} lists its keys"
    return ConfigError(f"unknown config key {section}.{key} ({hint})")


# Keys that name input files. A relative path is relative to the TOML file that gives it (its folder), or to the
# current directory when given on the command line; load_config stores it absolute.
INPUT_PATHS = (("data", "tokenizer"), ("data", "chat_template"), ("model", "init_from"))


def _input_path(value: str, base: Path) -> str:
    """An input path made absolute: a leading ~ is the user's home, a relative path is relative to `base`. Empty (not
    set) stays empty. Globs pass through untouched."""
    if not value:
        return value
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def _place(section: str, key: str, value: Any, base: Path) -> Any:
    """A path-valued key's value as the loaded config stores it, so that the saved config.toml means the same
    wherever it is read from."""
    if (section, key) == ("data", "chat_template") and not value.endswith(".jinja"):
        return value  # "", "chatml", "llama3": names, not paths
    if (section, key) in INPUT_PATHS:
        return _input_path(value, base)
    # Output folders are relative to the current directory wherever they are given, as users expect of output.
    # The cache becomes absolute now: the embedded corpus's source paths are built inside it and saved with the run.
    if (section, key) == ("data", "cache_dir"):
        return os.path.abspath(os.path.expanduser(value)) if value else value
    if (section, key) == ("job", "run_dir"):
        return os.path.expanduser(value)
    return value


def _apply(cfg: Config, section: str, key: str, value: Any, base: Path) -> None:
    """Sets section.key; `base` is the folder relative input paths are relative to."""
    known = _known_keys()
    if section not in known or key not in known[section]:
        raise _unknown_key(section, key)
    sec_obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(sec_obj))
    if key == "sources" and section in ("data", "eval"):
        sec_obj.sources = _sources(value, base, section)
        return
    setattr(sec_obj, key, _place(section, key, coerce(f"{section}.{key}", value, hints[key]), base))


def _sources(value: Any, base: Path, section: str = "data") -> list[SourceConfig]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{section}.sources: declare sources as [[{section}.sources]] tables in a TOML file")
    hints = typing.get_type_hints(SourceConfig)
    out = []
    for i, table in enumerate(value):
        src = SourceConfig()
        for k, v in table.items():
            if k not in hints:
                near = closest(k, hints)
                hint = f" (did you mean {section}.sources[{i}].{near}?)" if near else f" (keys: {', '.join(hints)})"
                raise ConfigError(f"unknown config key {section}.sources[{i}].{k}{hint}")
            setattr(src, k, v if k == "weight_schedule" else coerce(f"{section}.sources[{i}].{k}", v, hints[k]))
        src.path = _input_path(src.path, base)
        out.append(src)
    return out


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """`--training.steps=20` -> ("training", "steps", "20"); a bare `--checkpoint.resume` means true."""
    out = []
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        section, _, key = name.removeprefix("--").partition(".")
        if not name.startswith("--") or not key or "." in key:
            raise ConfigError(f"unrecognized argument {arg!r}{_override_hint(name, args[i - 1] if i else '')}")
        out.append((section, key, value if "=" in arg else "true"))
    return out


def _override_hint(name: str, previous: str) -> str:
    """For an argument that is not --section.key=value: the override it may have meant."""
    if previous.startswith("--") and "=" not in previous and not name.startswith("-"):
        return f" (a value goes after '=': {previous}={name})"  # --training.steps 5
    bare = name.lstrip("-")
    sections = [s for s, keys in _known_keys().items() if bare in keys]
    if sections:
        return f" (did you mean --{sections[0]}.{bare}?)"  # --steps=5
    return ": overrides look like --section.key=value"


def shipped_configs() -> dict[str, Path]:
    """The presets shipped inside the package (holotrain/configs/*.toml), by name."""
    from importlib.resources import files

    folder = files("holotrain") / "configs"
    return {Path(str(f)).stem: Path(str(f)) for f in folder.iterdir() if str(f).endswith(".toml")}


def find_config(name_or_path: str | Path) -> Path:
    """A config file: a path, or the name of a shipped config ("1.4b" or "1.4b.toml")."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_configs()
    if path.parent == Path(".") and path.name.removesuffix(".toml") in shipped:
        return shipped[path.name.removesuffix(".toml")]
    raise ConfigError(f"config file not found: {name_or_path} (shipped configs, by name: {', '.join(sorted(shipped))})")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the file (a path or a shipped config's name), then the overrides. Relative input paths are
    relative to the file's folder in the file, and to the current directory on the command line."""
    cfg = Config()
    if path is not None:
        path = find_config(path)
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
        folder = path.parent.resolve()
        try:
            for section, values in data.items():
                if not isinstance(values, dict):
                    owners = [s for s, keys in _known_keys().items() if section in keys]
                    hint = f" (did you mean {section} in [{owners[0]}]?)" if owners else ""
                    raise ConfigError(f"top-level key {section!r} must be a [section]{hint}")
                for key, value in values.items():
                    _apply(cfg, section, key, value, folder)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None  # the file the mistake is in
    for section, key, value in parse_overrides(overrides or []):
        _apply(cfg, section, key, value, Path.cwd())
    if not cfg.job.name:
        cfg.job.name = default_job_name(path, cfg.model.init_from)
    return cfg


def default_job_name(config_path: Path | None, init_from: str) -> str:
    """A job without job.name is named after its config file (sft.toml: "sft"), else after the model it starts
    from (model.init_from = "/models/Qwen3-0.6B": "Qwen3-0.6B"; a holotrain run's checkpoint: "from-<run>"), else
    "default": so that two different jobs started in one folder do not share runs/<name>."""
    if config_path is not None:
        return Path(config_path).stem
    if init_from:
        source = Path(init_from).expanduser().resolve()
        if source.name.startswith("step-") and source.parent.name == "checkpoints":
            return f"from-{source.parent.parent.name}-{source.name}"
        if (source / "config.toml").is_file():  # a holotrain run: its own runs/<name> is not this job's
            return f"from-{source.name}"
        return source.name or "default"
    return "default"


# --------------------------------------------------------------------------------------------
# Resolution and validation


def resolve(cfg: Config, tokenizer_vocab: int | None = None) -> Config:
    """Fill model dims from the family's preset (and the vocabulary from the tokenizer, once it is known), then
    validate. Called once before the corpus is prepared, so mistakes surface at once, and again after."""
    m = cfg.model
    if m.init_from:
        from holotrain.model.pretrained import fill_config

        fill_config(cfg)  # every dimension (and the tokenizer) from the checkpoint; the preset is not used
    m.family = m.family or DEFAULT_FAMILY
    shape = family_preset(m.family, m.preset)
    for f in dataclasses.fields(shape):
        # A model from init_from is described whole by it: a switch it has off stays off.
        if hasattr(m, f.name) and not getattr(m, f.name) and not m.init_from and f.name != "head_dim":
            setattr(m, f.name, getattr(shape, f.name))
    fix_switches(m.family, m)
    if not m.n_kv_heads:
        m.n_kv_heads = m.n_heads
    if not m.head_dim and m.n_heads:
        # The preset's own head_dim where it sets one apart from its width (qwen3), else this width's share of a head.
        explicit = shape.head_dim != shape.dim // shape.n_heads and not m.init_from
        if not explicit and m.dim % m.n_heads:
            raise ConfigError(f"model.n_heads={m.n_heads} does not divide model.dim={m.dim} (or set model.head_dim)")
        m.head_dim = shape.head_dim if explicit else m.dim // m.n_heads
    if not m.max_seq_len:
        m.max_seq_len = cfg.data.seq_len
    if not m.vocab_size and tokenizer_vocab is not None:
        m.vocab_size = -(-tokenizer_vocab // 64) * 64
    validate(cfg, tokenizer_vocab)
    check_model(model_args(m))
    return cfg


def batch_layout(cfg: Config, world_size: int) -> tuple[int, int]:
    """(micro_batch_size per rank, gradient accumulation steps) for this world size."""
    t = cfg.training
    micro = t.micro_batch_size or t.batch_size // world_size
    if micro == 0 or t.batch_size % (micro * world_size) != 0:
        raise ConfigError(f"training.batch_size={t.batch_size} must be a multiple of "
                          f"training.micro_batch_size x world size ({micro or 1} x {world_size})")
    return micro, t.batch_size // (micro * world_size)
