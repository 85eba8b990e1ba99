"""Job configuration: dataclass sections, TOML files, `--section.key=value` overrides, validation.

Precedence: dataclass defaults < TOML file (`--config`) < command-line overrides. The resolved config
(every model dimension filled in from its preset) is what a run saves as `config.toml` and what a
resumed run reads back.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from holotrain.config_values import coerce
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
    name: str = "default"
    run_dir: str = ""  # empty: runs/<name>
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
    # from it (model/pretrained.py); a new run starts from its weights with a fresh optimizer.
    init_from: str = ""


@dataclass
class DataConfig(_Section):
    # [[data.sources]] tables (name, path, weight, weight_schedule, text_field, format = "text" | "chat",
    # messages_field, prompt_field, response_field, document = "record" | "directory", path_field; see
    # holotrain/data/sources.py); none: the embedded corpus, two sources built from this Python's
    # standard library (code, and docstrings as prose).
    sources: list = field(default_factory=list)
    seq_len: int = 256
    tokenizer: str = ""  # path to a tokenizer.json; empty = train a byte-level BPE on the sources
    vocab_size: int = 4096  # size of the BPE trained when data.tokenizer is empty
    tokenizer_sample_mb: float = 8.0  # text the BPE is trained on
    cache_dir: str = ""  # empty: $HOLOTRAIN_CACHE or ~/.cache/holotrain
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
    chat_template: str = ""  # for chat sources: "" the tokenizer's own, "chatml", "llama3" or a .jinja file's path


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


PP_SCHEDULES = ("auto", "1f1b", "interleaved", "zb1p", "zbv")


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


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    sections = {f.name for f in dataclasses.fields(Config)}
    if section not in sections:
        raise ConfigError(f"unknown config section {section!r} (known: {', '.join(sorted(sections))})")
    sec_obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(sec_obj))
    if key not in hints:
        raise ConfigError(f"unknown config key {section}.{key}")
    if (section, key) == ("data", "sources"):
        sec_obj.sources = _sources(value)
        return
    setattr(sec_obj, key, coerce(f"{section}.{key}", value, hints[key]))


def _sources(value: Any) -> list[SourceConfig]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError("data.sources: declare sources as [[data.sources]] tables in a TOML file")
    hints = typing.get_type_hints(SourceConfig)
    out = []
    for i, table in enumerate(value):
        src = SourceConfig()
        for k, v in table.items():
            if k not in hints:
                raise ConfigError(f"unknown config key data.sources[{i}].{k}")
            setattr(src, k, v if k == "weight_schedule" else coerce(f"data.sources[{i}].{k}", v, hints[k]))
        out.append(src)
    return out


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """`--training.steps=20` -> ("training", "steps", "20"); a bare `--checkpoint.resume` means true."""
    out = []
    for arg in args:
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unrecognized argument {arg!r}: overrides look like --section.key=value")
        name, _, value = arg[2:].partition("=")
        section, _, key = name.partition(".")
        if not key or "." in key:
            raise ConfigError(f"unrecognized argument {arg!r}: overrides look like --section.key=value")
        out.append((section, key, value if "=" in arg else "true"))
    return out


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
    """Defaults, then the file (a path or a shipped config's name), then the overrides."""
    cfg = Config()
    if path is not None:
        path = find_config(path)
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
            for key, value in values.items():
                _apply(cfg, section, key, value)
    for section, key, value in parse_overrides(overrides or []):
        _apply(cfg, section, key, value)
    return cfg


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


def validate(cfg: Config, tokenizer_vocab: int | None = None) -> None:
    m, t, d = cfg.model, cfg.training, cfg.data

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
        need(getattr(m, key) > 0, f"model.{key} must be positive, got {getattr(m, key)}")
    need(m.vocab_size >= 0, f"model.vocab_size must be positive, got {m.vocab_size}")
    if tokenizer_vocab is not None:
        need(m.vocab_size > 0, f"model.vocab_size must be positive, got {m.vocab_size}")
    need(m.dim % m.n_heads == 0, f"model.n_heads={m.n_heads} does not divide model.dim={m.dim}")
    need((m.dim // m.n_heads) % 2 == 0, f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even for RoPE")
    need(m.n_heads % m.n_kv_heads == 0, f"model.n_kv_heads={m.n_kv_heads} does not divide model.n_heads={m.n_heads}")
    need(m.rope_theta > 0, f"model.rope_theta must be positive, got {m.rope_theta}")
    if m.rope_scaling:
        from holotrain.model.hf import rope_settings

        rope_settings({"rope_scaling": m.rope_scaling}, "model.rope_scaling")  # raises ConfigError naming the key
    need(m.norm_eps > 0, f"model.norm_eps must be positive, got {m.norm_eps}")
    need(d.seq_len > 0, f"data.seq_len must be positive, got {d.seq_len}")
    need(d.seq_len <= m.max_seq_len, f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    from holotrain.data.chat import check_template_choice
    from holotrain.data.sources import validate_sources

    validate_sources(d.sources)
    check_template_choice(d.chat_template)
    need(d.backend in ("local", "ray"), f"data.backend must be 'local' or 'ray', got {d.backend!r}")
    if d.backend == "ray":
        import importlib.util

        need(importlib.util.find_spec("ray") is not None, "data.backend = 'ray' needs Ray: pip install 'holotrain[ray]'")
    need(d.workers >= 1, f"data.workers must be >= 1, got {d.workers}")
    need(d.chunk_mb > 0, f"data.chunk_mb must be positive, got {d.chunk_mb}")
    need(d.balance_window >= 1, f"data.balance_window must be >= 1, got {d.balance_window}")
    need(d.prefetch_steps >= 1, f"data.prefetch_steps must be >= 1, got {d.prefetch_steps}")
    need(d.vocab_size >= 259, f"data.vocab_size must be at least 259 (256 bytes + special tokens), got {d.vocab_size}")
    if tokenizer_vocab is not None:
        need(tokenizer_vocab <= m.vocab_size,
             f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer_vocab})")
    need(t.steps > 0, f"training.steps must be positive, got {t.steps}")
    need(t.batch_size > 0, f"training.batch_size must be positive, got {t.batch_size}")
    need(t.micro_batch_size >= 0, f"training.micro_batch_size must be >= 0, got {t.micro_batch_size}")
    need(t.lr > 0, f"training.lr must be positive, got {t.lr}")
    need(0 <= t.min_lr_ratio <= 1, f"training.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    need(t.warmup_steps >= 0, f"training.warmup_steps must be >= 0, got {t.warmup_steps}")
    need(t.weight_decay >= 0, f"training.weight_decay must be >= 0, got {t.weight_decay}")
    need(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "training.beta1 and training.beta2 must be in [0, 1)")
    need(t.grad_clip >= 0, f"training.grad_clip must be >= 0, got {t.grad_clip}")
    need(t.dtype in ("auto", "bf16", "fp32"), f"training.dtype must be auto, bf16 or fp32, got {t.dtype!r}")
    need(t.attention in ("auto", "cudnn", "flash"), f"training.attention must be auto, cudnn or flash, got {t.attention!r}")
    need(t.log_every > 0, f"training.log_every must be positive, got {t.log_every}")
    need(t.fp8 in ("none", "tensorwise", "rowwise", "delayed", "auto"),
         f"training.fp8 must be none, tensorwise, rowwise, delayed or auto, got {t.fp8!r}")
    need(not (t.fp8 in ("tensorwise", "rowwise", "delayed") and cfg.job.device == "cpu" and not t.fp8_emulate),
         f"training.fp8 = {t.fp8!r} needs a GPU with FP8 (compute capability 8.9 or later); job.device is cpu")
    need(not (t.fp8 == "delayed" and cfg.parallel.tp > 1),
         "training.fp8 = 'delayed' does not run under parallel.tp > 1 yet; use 'tensorwise' there")
    need(not (t.fp8 in ("tensorwise", "rowwise") and cfg.parallel.tp > 1 and cfg.parallel.tp_overlap != "none"),
         f"training.fp8 = {t.fp8!r} with parallel.tp > 1 needs parallel.tp_overlap = 'none' (the overlapped "
         f"GEMMs, {cfg.parallel.tp_overlap!r}, have no FP8 path)")
    need(t.max_nonfinite_steps > 0, f"training.max_nonfinite_steps must be positive, got {t.max_nonfinite_steps}")
    need(cfg.job.device in ("auto", "cpu", "cuda"), f"job.device must be auto, cpu or cuda, got {cfg.job.device!r}")
    c = cfg.checkpoint
    need(c.every >= 0, f"checkpoint.every must be >= 0, got {c.every}")
    need(c.keep >= 1, f"checkpoint.keep must be >= 1, got {c.keep}")
    need(c.memory_every >= 0, f"checkpoint.memory_every must be >= 0 (0 = off), got {c.memory_every}")
    need(c.memory_gb > 0, f"checkpoint.memory_gb must be positive, got {c.memory_gb}")
    need(cfg.parallel.dp == "fsdp", f"parallel.dp must be 'fsdp', got {cfg.parallel.dp!r}")
    par = cfg.parallel
    need(par.tp >= 1, f"parallel.tp must be >= 1, got {par.tp}")
    need(par.tp_overlap in ("none", "async_tp", "fused"),
         f"parallel.tp_overlap must be none, async_tp or fused, got {par.tp_overlap!r}")
    if par.tp > 1:
        for key in ("n_heads", "n_kv_heads", "ffn_dim"):
            need(getattr(m, key) % par.tp == 0,
                 f"parallel.tp={par.tp} must divide model.{key}={getattr(m, key)} (each rank takes 1/tp of them)")
        need(m.vocab_size % par.tp == 0,
             f"parallel.tp={par.tp} must divide model.vocab_size={m.vocab_size} (vocabulary-parallel embedding and head)")
        need(d.seq_len % par.tp == 0,
             f"parallel.tp={par.tp} must divide data.seq_len={d.seq_len} (sequence-parallel activations)")
        need(not (par.tp_overlap != "none" and cfg.job.device == "cpu"),
             f"parallel.tp_overlap={par.tp_overlap!r} runs on CUDA GPUs only; use 'none' on the CPU")
        need(not (par.tp_overlap == "fused" and t.dtype == "fp32"),
             "parallel.tp_overlap='fused' computes in bf16: set training.dtype to auto or bf16")
        need(not getattr(cfg.memory, "offload", False),
             "parallel.tp > 1 does not combine with memory.offload yet: use one of them")
    need(par.cp >= 1, f"parallel.cp must be >= 1, got {par.cp}")
    need(par.pp >= 1, f"parallel.pp must be >= 1, got {par.pp}")
    need(par.pp_schedule in PP_SCHEDULES, f"parallel.pp_schedule must be one of {', '.join(PP_SCHEDULES)}, got "
         f"{par.pp_schedule!r}")
    need(par.pp_microbatches >= 0, f"parallel.pp_microbatches must be >= 0, got {par.pp_microbatches}")
    if par.pp > 1:
        # What pipeline stages do not run with yet, each in one line.
        need(not cfg.memory.offload, "parallel.pp > 1 does not combine with memory.offload: use one of them")
        need(cfg.memory.activation_offload_blocks == 0,
             "parallel.pp > 1 does not combine with memory.activation_offload_blocks > 0 yet")
        need(not m.tie_embeddings, "model.tie_embeddings shares the embedding with the head, which pipeline stages "
             "put on different ranks: set model.tie_embeddings = false or parallel.pp = 1")
        need(m.n_layers + 2 >= par.pp, f"parallel.pp={par.pp} needs at least as many units as stages (embedding, "
             f"{m.n_layers} blocks, head)")
        need(not (t.compile and par.pp_schedule in ("zb1p", "zbv")),
             f"parallel.pp_schedule = {par.pp_schedule!r} splits backward in a way torch.compile does not trace: "
             "set training.compile = false, or choose 1f1b or interleaved")
        need(t.fp8 != "delayed", "training.fp8 = 'delayed' does not run under parallel.pp > 1 yet: use 'tensorwise'")
    need(par.cp_mode in ("auto", "ring", "alltoall"), f"parallel.cp_mode must be auto, ring or alltoall, got {par.cp_mode!r}")
    if par.cp > 1:
        need(d.seq_len % (2 * par.cp * par.tp) == 0, f"data.seq_len={d.seq_len} must divide by 2 x parallel.cp x "
             f"parallel.tp = {2 * par.cp * par.tp} (each rank holds two equal chunks of every sequence)")
        need(not cfg.memory.offload, "parallel.cp > 1 does not combine with memory.offload yet: use one of them")
    need(par.tp_spin_limit > 0, f"parallel.tp_spin_limit must be positive, got {par.tp_spin_limit}")
    need(par.tp_barrier_ms > 0, f"parallel.tp_barrier_ms must be positive, got {par.tp_barrier_ms}")
    need(par.tp_piece_mb > 0, f"parallel.tp_piece_mb must be positive, got {par.tp_piece_mb}")
    if par.tp_tiles:
        from holotrain.parallel.tiles import parse_tiles

        parse_tiles(par.tp_tiles)  # raises ConfigError naming parallel.tp_tiles
    p, hw = cfg.profile, cfg.hw
    need(all(s > 0 for s in p.trace_steps), f"profile.trace_steps are 1-based step numbers, got {p.trace_steps}")
    need(len(p.trace_steps) <= 16, f"profile.trace_steps: at most 16 steps are traced, got {len(p.trace_steps)}")
    need(p.trace_max_mb > 0, f"profile.trace_max_mb must be positive, got {p.trace_max_mb}")
    need(p.straggler_margin >= 0, f"profile.straggler_margin must be >= 0 (0 = off), got {p.straggler_margin}")
    need(0 < hw.telemetry_hz <= 1000, f"hw.telemetry_hz must be in (0, 1000], got {hw.telemetry_hz}")
    need(hw.lock_sm_clock_mhz >= 0, f"hw.lock_sm_clock_mhz must be >= 0, got {hw.lock_sm_clock_mhz}")
    need(hw.power_limit_w >= 0, f"hw.power_limit_w must be >= 0, got {hw.power_limit_w}")
    need(hw.gpu_memory_gb >= 0, f"hw.gpu_memory_gb must be >= 0 (0 = the whole GPU), got {hw.gpu_memory_gb}")
    need(cfg.job.mtbf_hours > 0, f"job.mtbf_hours must be positive, got {cfg.job.mtbf_hours}")
    pl = cfg.plan
    need(pl.objective in ("tokens_per_s", "j_per_token"),
         f"plan.objective must be tokens_per_s or j_per_token, got {pl.objective!r}")
    need(pl.trials >= 0, f"plan.trials must be >= 0, got {pl.trials}")
    need(pl.trial_steps >= 3, f"plan.trial_steps must be >= 3 (two are not timed), got {pl.trial_steps}")
    need(pl.seconds > 0, f"plan.seconds must be positive, got {pl.seconds}")
    wants_control = hw.lock_sm_clock_mhz > 0 or hw.power_limit_w > 0
    need(not wants_control or hw.allow_clock_control, "hw.lock_sm_clock_mhz / hw.power_limit_w change the card's "
         "settings for every user of it: set hw.allow_clock_control = true to allow that")
    mem = cfg.memory
    # activation_checkpointing = true / false is accepted; the resolved config stores the policy name.
    ac = mem.activation_checkpointing
    ac = {"true": "full", "false": "none"}.get(str(ac).lower(), ac) if isinstance(ac, (bool, str)) else ac
    need(ac in ("none", "full", "selective", "pointwise", "auto"),
         "memory.activation_checkpointing must be auto, none, full, selective or pointwise, got "
         f"{mem.activation_checkpointing!r}")
    mem.activation_checkpointing = ac
    blocks = mem.activation_checkpointing_blocks
    need(isinstance(blocks, int) and 0 <= blocks <= m.n_layers,
         f"memory.activation_checkpointing_blocks must be between 0 and model.n_layers = {m.n_layers}, got {blocks!r}")
    need(blocks == 0 or ac in ("full", "pointwise"),
         f'memory.activation_checkpointing_blocks = {blocks} applies to "full" and "pointwise", not {ac!r} '
         '("selective" is "full" on every other block)')
    ratio = mem.offload_ratio
    if isinstance(ratio, str) and ratio.strip().lower() == "auto":
        mem.offload_ratio = "auto"  # chosen with the memory plan when the model is built (train.trainer.build_model)
    else:
        try:
            mem.offload_ratio = float(ratio)
        except ValueError:
            raise ConfigError(f'memory.offload_ratio must be a number in [0, 1] or "auto", got {ratio!r}') from None
        need(0.0 <= mem.offload_ratio <= 1.0, f"memory.offload_ratio must be in [0, 1], got {ratio}")
    need(mem.offload_kernel in ("auto", "native", "torch"),
         f"memory.offload_kernel must be auto, native or torch, got {mem.offload_kernel!r}")
    need(mem.offload_threads >= 0, f"memory.offload_threads must be >= 0, got {mem.offload_threads}")
    need(mem.offload_gil_switch_ms >= 0, f"memory.offload_gil_switch_ms must be >= 0 (0 = Python's own), got "
         f"{mem.offload_gil_switch_ms}")
    need(mem.offload or not mem.offload_delayed_update, "memory.offload_delayed_update needs memory.offload = true")
    need(mem.adamw_moments in ("fp32", "bf16"), f"memory.adamw_moments must be fp32 or bf16, got {mem.adamw_moments!r}")
    need(not (mem.offload and mem.adamw_moments == "bf16"), "memory.adamw_moments = bf16 is for AdamW on the device; "
         "memory.offload keeps the moments in host memory in fp32")
    need(mem.loss_chunk_tokens >= 0, f"memory.loss_chunk_tokens must be >= 0 (0 = auto), got {mem.loss_chunk_tokens}")
    need(0 <= mem.activation_offload_blocks <= m.n_layers, "memory.activation_offload_blocks must be between 0 and "
         f"model.n_layers = {m.n_layers}, got {mem.activation_offload_blocks}")
    # The offload engine assumes FSDP2's sharding (disjoint shards, one gradient per step); tensor parallelism
    # replicates some parameters across ranks, which its norm would count twice.
    need(not (mem.offload and cfg.parallel.tp > 1), "memory.offload does not combine with parallel.tp > 1 yet")


def batch_layout(cfg: Config, world_size: int) -> tuple[int, int]:
    """(micro_batch_size per rank, gradient accumulation steps) for this world size."""
    t = cfg.training
    micro = t.micro_batch_size or t.batch_size // world_size
    if micro == 0 or t.batch_size % (micro * world_size) != 0:
        raise ConfigError(f"training.batch_size={t.batch_size} must be a multiple of "
                          f"training.micro_batch_size x world size ({micro or 1} x {world_size})")
    return micro, t.batch_size // (micro * world_size)
