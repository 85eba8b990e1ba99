"""Job configuration: dataclass sections, TOML files, `--section.key=value` overrides, validation.

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

from holotrain.config_checks import PP_SCHEDULES, validate  # noqa: F401 - validate is part of this module's interface
from holotrain.config_values import closest, coerce
from holotrain.data.sources import SourceConfig
from holotrain.errors import ConfigError
from holotrain.model.llama import PRESETS


class _Section:
    """A config section; read-only once the config is resolved (Config.freeze)."""

    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise AttributeError(f"the resolved config is read-only: {type(self).__name__}.{name} cannot change "
                                 "after resolution (make a changed copy with dataclasses.replace)")
        object.__setattr__(self, name, value)


@dataclass
class JobConfig(_Section):
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


@dataclass
class ModelConfig(_Section):
    preset: str = "tiny"
    # 0 / 0.0 means "take the preset's value"; the resolved config holds the real numbers.
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    ffn_dim: int = 0
    vocab_size: int = 0  # tiny preset: 0 = the tokenizer's vocabulary, rounded up to a multiple of 64
    max_seq_len: int = 0  # 0 = data.seq_len
    rope_theta: float = 0.0
    rope_scaling: dict = field(default_factory=dict)  # {} = none; {rope_type = "llama3" | "linear", factor, ...}
    norm_eps: float = 0.0
    tie_embeddings: bool = False  # the head shares the embedding's weight
    qkv_bias: bool = False  # biases as pretrained checkpoints have them (Qwen2: q/k/v)
    out_bias: bool = False
    mlp_bias: bool = False
    # A Hugging Face model directory or a holotrain run / checkpoint: the dimensions, weights and tokenizer come
    # from it (model/pretrained.py); a new run starts from its weights with a fresh optimizer. A relative path in a
    # TOML file is relative to the file's folder (as every input path there), on the command line to the current one.
    init_from: str = ""


@dataclass
class DataConfig(_Section):
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


@dataclass
class TrainingConfig(_Section):
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


@dataclass
class CheckpointConfig(_Section):
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




@dataclass
class ParallelConfig(_Section):
    # Data parallelism over all ranks of a torchrun launch (world size / tp of them); world size 1 runs unsharded.
    dp: str = "fsdp"  # fsdp
    reshard_after_forward: bool = True
    # Tensor parallelism (holotrain/parallel/tp.py): ranks per model replica, splitting heads and FFN columns, with
    # sequence-parallel norms; ranks tp*i .. tp*i+tp-1 form one group (one node's GPUs). 1 = off.
    tp: int = 1
    # How a TP layer's all-gather / reduce-scatter meets its GEMM (holotrain/parallel/overlap.py): "none" (NCCL
    # collective, then the GEMM; the only CPU path), "async_tp" (torch's symmetric-memory async-TP ops) or
    # "fused" (our Triton kernels: the GEMM consumes gathered tiles as they arrive and scatters as it goes).
    tp_overlap: str = "none"
    # Tiles of the fused kernels, "BMxBNxBK" with optional "-sSTAGES-wWARPS-gGROUP_M-rRESERVED_SMS-dDYNAMIC-xWS"
    # "-fFLAT-eEPILOGUE_PIECES-cCORE" (holotrain/parallel/tiles.py; -c1: the all-gather GEMM on the
    # warp-specialized Gluon core); empty = the built-in default (bench/overlap.py tries a few).
    tp_tiles: str = ""
    # The fused kernels' safety limits and piece size. A wait that polls a peer's flag more than tp_spin_limit times
    # ends the kernel with an error (a peer is missing) instead of hanging; tp_barrier_ms bounds the host-side
    # barrier before each op; tp_piece_mb is the unit in which the all-gather's copies land and are signalled.
    tp_spin_limit: int = 1 << 26
    tp_barrier_ms: int = 120000
    tp_piece_mb: float = 4.0
    # Context parallelism (holotrain/parallel/cp.py): ranks that split each sequence, load-balanced (each rank holds
    # chunks i and 2N-1-i of 2N). "ring": keys and values pass around the group, each hop overlapped with attention on
    # the block at hand; "alltoall": all-to-all from sequence to heads (the heads, and kv heads, of a TP rank must divide
    # by cp) and attention over the whole sequence; "auto": alltoall where heads divide, else ring. 1 = off.
    cp: int = 1
    cp_mode: str = "auto"
    # Pipeline parallelism (holotrain/parallel/pp.py): ranks that each hold a contiguous share of the blocks (stages
    # balanced by cost, the embedding on the first and the head on the last), on torch.distributed.pipelining's
    # schedules: "1f1b", "interleaved" (2 stages per rank, looped), "zb1p" (interleaved zero bubble), "zbv" (zero bubble,
    # 2 stages per rank in a V); "auto": interleaved when training.compile, else zbv (1f1b with too few blocks for two
    # stages a rank). pp_microbatches: micro-batches per step through the pipeline, the step's gradient accumulation
    # (0: as training.micro_batch_size makes them, else the fewest of at least 2 x pp that split a replica's rows).
    # Not yet with memory.offload, activation offload or delayed FP8. 1 = off.
    pp: int = 1
    pp_schedule: str = "auto"
    pp_microbatches: int = 0


@dataclass
class MemoryConfig(_Section):
    # "none" | "full" (every block recomputed in backward) | "selective" (every other block) | "pointwise" (the
    # norms, rotary and SwiGLU products recomputed, no matmul); see holotrain/memory/activation_checkpointing.py.
    # true / false are accepted as "full" / "none". "auto": the least recomputation the memory plan fits (none at
    # short sequences, more as they grow), chosen when the run starts and saved in its config.toml.
    activation_checkpointing: str | bool = "auto"
    # "full" or "pointwise" on this many blocks, spread evenly over the depth (0 = every block).
    activation_checkpointing_blocks: int = 0
    # ZeRO-Offload (holotrain/memory/offload/): fp32 master weights and AdamW states in CPU memory, working
    # weights on the GPU in the compute dtype, the CPU step overlapped with backward and the next forward.
    offload: bool = False
    # Share of the parameters whose optimizer step runs on the CPU (the last units in forward order); the rest on the
    # GPU. "auto": the smallest share that the memory plan fits in GPU and host memory (the most work on the GPU).
    offload_ratio: float | str = 1.0
    # The CPU step's loops: "auto" (the compiled extension, holotrain/memory/offload/csrc; torch ops with a warning
    # where it cannot be built), "native" (the extension or an error) or "torch" (torch ops: more passes over memory).
    offload_kernel: str = "auto"
    offload_threads: int = 0  # CPU threads of the offloaded step; 0 = this rank's share of the cores, minus one
    # Python's GIL switch interval while the engine runs, in ms (0 = Python's 5 ms): the CPU worker takes the GIL back
    # a dozen times a bucket, and at 5 ms its native threads wait on the training thread's Python.
    offload_gil_switch_ms: float = 0.25
    # ZeRO-Offload's delayed parameter update (memory/offload/__init__.py; changes the optimization: never planned).
    # On one process it takes one micro-batch per step (the working weights change when a bucket's gradient lands).
    offload_delayed_update: bool = False
    adamw_moments: str = "fp32"  # on the device: fp32 | bf16 (4 bytes a parameter less; optim/bf16_moments.py)
    check_fit: bool = True  # refuse, before training starts, a plan that cannot fit GPU or host memory
    # The head and the loss fused, in pieces of this many tokens (model/head.py: one piece's fp32 logits alive).
    # 0 = auto: 8192 with activation checkpointing (memory first), else the whole micro-batch at once.
    loss_chunk_tokens: int = 0
    # The first this many blocks keep their saved tensors in pinned host memory between forward and backward
    # (memory/activation_offload.py): less GPU memory at the peak, no recompute, PCIe traffic instead.
    activation_offload_blocks: int = 0


@dataclass
class ProfileConfig(_Section):
    tensorboard: bool = True
    progress: bool = True  # rich progress bar when the terminal is interactive
    phases: bool = True  # time.forward/backward/optimizer per logged step (CUDA events, read at log time)
    trace_steps: list = field(default_factory=list)  # steps (1-based) captured by torch.profiler, e.g. [10, 11]
    trace_max_mb: float = 64.0  # a trace file larger than this keeps only its longest events
    report: bool = True  # write RUN_DIR/report.html when training ends
    straggler_margin: float = 0.2  # a rank this share over the median in a phase is named (stragglers.py); 0 = off


@dataclass
class HwConfig(_Section):
    telemetry: bool = True  # NVML sampler: clocks, power, energy, throttle reasons -> RUN_DIR/telemetry.jsonl
    telemetry_hz: float = 100.0
    # Changing clocks or power limits affects everyone on the card: off unless the user asks explicitly.
    allow_clock_control: bool = False
    lock_sm_clock_mhz: int = 0  # 0 = leave the clocks alone
    power_limit_w: float = 0.0  # 0 = leave the power limit alone
    # GPU memory this run may use, in GB (0 = all of it): to plan for a smaller card, or to share one. The memory
    # plan and the allocator both keep to it.
    gpu_memory_gb: float = 0.0


@dataclass
class PlanConfig(_Section):
    """`holotrain plan` / `holotrain train --plan auto` (holotrain/plan/)."""

    objective: str = "tokens_per_s"  # tokens_per_s | j_per_token
    trials: int = 3  # the best predicted candidates run as short trials through `holotrain train`
    trial_steps: int = 8  # steps per trial; the first two (compilation, warm-up) are not timed
    seconds: float = 180.0  # planning budget: no trial starts that it would not finish (judged by the last one)


@dataclass
class Config(_Section):
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
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
    if (section, key) == ("data", "sources"):
        sec_obj.sources = _sources(value, base)
        return
    setattr(sec_obj, key, _place(section, key, coerce(f"{section}.{key}", value, hints[key]), base))


def _sources(value: Any, base: Path) -> list[SourceConfig]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError("data.sources: declare sources as [[data.sources]] tables in a TOML file")
    hints = typing.get_type_hints(SourceConfig)
    out = []
    for i, table in enumerate(value):
        src = SourceConfig()
        for k, v in table.items():
            if k not in hints:
                near = closest(k, hints)
                hint = f" (did you mean data.sources[{i}].{near}?)" if near else f" (keys: {', '.join(hints)})"
                raise ConfigError(f"unknown config key data.sources[{i}].{k}{hint}")
            setattr(src, k, v if k == "weight_schedule" else coerce(f"data.sources[{i}].{k}", v, hints[k]))
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
    """Fill model dims from the preset (and the vocabulary from the tokenizer, once it is known), then
    validate. Called once before the corpus is prepared, so mistakes surface at once, and again after."""
    m = cfg.model
    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {m.preset!r} (known: {', '.join(PRESETS)})")
    preset = PRESETS[m.preset]
    if m.init_from:
        from holotrain.model.pretrained import fill_config

        fill_config(cfg)  # every dimension (and the tokenizer) from the checkpoint; the preset is not used
    for f in dataclasses.fields(preset):
        if hasattr(m, f.name) and not getattr(m, f.name):
            setattr(m, f.name, getattr(preset, f.name))
    if not m.n_kv_heads:
        m.n_kv_heads = m.n_heads
    if not m.max_seq_len:
        m.max_seq_len = cfg.data.seq_len
    if not m.vocab_size and tokenizer_vocab is not None:
        m.vocab_size = -(-tokenizer_vocab // 64) * 64
    validate(cfg, tokenizer_vocab)
    return cfg


def batch_layout(cfg: Config, world_size: int) -> tuple[int, int]:
    """(micro_batch_size per rank, gradient accumulation steps) for this world size."""
    t = cfg.training
    micro = t.micro_batch_size or t.batch_size // world_size
    if micro == 0 or t.batch_size % (micro * world_size) != 0:
        raise ConfigError(f"training.batch_size={t.batch_size} must be a multiple of "
                          f"training.micro_batch_size x world size ({micro or 1} x {world_size})")
    return micro, t.batch_size // (micro * world_size)
