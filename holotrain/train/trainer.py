"""The training loop. Every lever is reached from here in one hop: data, model, parallel, memory, hw."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import fields

import torch
import torch.distributed as dist

from holotrain.config import Config, ConfigError, batch_layout, load_config, resolve
from holotrain.hw import peak_bf16_flops
from holotrain.memory import apply_activation_checkpointing
from holotrain.memory.offload import OffloadEngine
from holotrain.memory.plan import check_fit, choose_offload_ratio, loss_chunk_tokens
from holotrain.model import Llama, LlamaArgs, flops_per_token, num_params
from holotrain.parallel import DistEnv, apply_fsdp, init_distributed
from holotrain.parallel.launch import destroy_distributed, device_mesh
from holotrain.parallel.tp import apply_tp
from holotrain.profile import PhaseClock
from holotrain.profile.trace import StepTracer
from holotrain.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from holotrain.train.metrics import MetricsLogger, truncate_jsonl

DATA_STATE = "data_state.json"


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to training.lr, then cosine decay to lr * min_lr_ratio at the last step."""
    t = cfg.training
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    min_lr = t.lr * t.min_lr_ratio
    return min_lr + 0.5 * (t.lr - min_lr) * (1 + math.cos(math.pi * progress))


def model_args(cfg: Config) -> LlamaArgs:
    return LlamaArgs(**{f.name: getattr(cfg.model, f.name) for f in fields(LlamaArgs)})


def resolve_offload_ratio(cfg: Config, env: DistEnv, micro: int, accum: int, resumed_run=None) -> None:
    """memory.offload_ratio = "auto" -> a number, before the run's config.toml is written: the smallest ratio the
    memory plan fits, agreed by all ranks (the largest of their choices), or, when resuming, the run's own choice
    (the checkpoint's split of optimizer state between GPU and host follows it)."""
    mem = cfg.memory
    if mem.offload_ratio != "auto":
        return
    if not mem.offload:
        mem.offload_ratio = 1.0  # unused
        return
    if resumed_run is not None:
        saved = load_config(resumed_run / "config.toml").memory.offload_ratio
        if saved != "auto":
            mem.offload_ratio = float(saved)
            return
    with torch.device("meta"):
        model = Llama(model_args(cfg))
    ratio = choose_offload_ratio(model, cfg, env.world_size, env.device, micro, accum)
    if env.world_size > 1:
        agreed = torch.tensor([ratio], dtype=torch.float64, device=env.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        ratio = float(agreed.item())
    mem.offload_ratio = ratio
    if env.is_main:
        print(f"holotrain: memory.offload_ratio = auto -> {ratio:g} (the smallest share of the optimizer on the CPU "
              "that the memory plan fits)")


def build_model(cfg: Config, env: DistEnv, compute_dtype: torch.dtype) -> torch.nn.Module:
    """Builds the plain model with seeded weights, then applies the levers from outside."""
    args = model_args(cfg)
    dp = max(1, env.world_size // cfg.parallel.tp)
    resolve_offload_ratio(cfg, env, *batch_layout(cfg, dp))  # if the caller has not (train does, first)
    # Built on "meta" (no memory), wrapped by the levers, placed (sharded, if FSDP), and only then
    # initialized: a 7B model never exists whole in host memory, and the seed alone decides the weights.
    with torch.device("meta"):
        model = Llama(args)
    if cfg.memory.check_fit:
        # A plan that cannot fit GPU or host memory is refused now, with the numbers, not by an OOM later.
        check_fit(model, cfg, env.world_size, env.device, *batch_layout(cfg, dp))
    mesh = device_mesh(env, cfg.parallel.tp)  # ("dp",), or ("dp", "tp") with tensor parallelism
    if cfg.parallel.tp > 1:
        apply_tp(model, mesh["tp"], cfg.parallel.tp_overlap, cfg.parallel.tp_tiles)
    apply_compute_levers(model, cfg)
    if env.world_size > 1:
        apply_fsdp(model, mesh["dp"], compute_dtype, cfg.parallel.reshard_after_forward)
    # With offload on one device the model is materialized in fp32 on the host: the offload engine (made by
    # build_optimizer) takes those values as its master weights and puts working copies on the device, so the
    # GPU never holds fp32 copies of the offloaded weights. (FSDP2 shards are 1/N: they go to the device.)
    model.to_empty(device="cpu" if cfg.memory.offload and env.world_size == 1 else env.device)
    model.init_weights(seed=cfg.job.seed)
    return model


def apply_compute_levers(model: torch.nn.Module, cfg: Config) -> None:
    """Activation checkpointing and compilation, applied to the plain (or tensor-parallel) model before sharding."""
    if cfg.memory.activation_checkpointing != "none":
        apply_activation_checkpointing(model, cfg.memory.activation_checkpointing)
    # (Tensor parallelism has its own vocabulary-parallel loss, which holds 1/tp of the logits: never chunked.)
    model.loss_chunk_tokens = loss_chunk_tokens(cfg) if cfg.parallel.tp == 1 else 0
    if cfg.training.compile:
        # Regional compilation: each block (identical code, compiled once) and the loss head (the whole loss, or
        # the unit of a chunked one). Keeps parameter names, composes with FSDP2's per-block hooks, and compiles
        # in seconds, not minutes.
        for block in model.layers.values():
            block.compile()
        if model.loss_chunk_tokens:
            model.loss_sum = torch.compile(model.loss_sum)
        else:
            model.loss = torch.compile(model.loss)


def build_optimizer(model: torch.nn.Module, cfg: Config, env: DistEnv | None = None,
                    dtype: torch.dtype | None = None) -> torch.optim.Optimizer | OffloadEngine:
    """AdamW, fused; no weight decay on norms (1-D parameters). With memory.offload, the offload engine
    (holotrain/memory/offload.py) in its place, which needs the run's `env` and compute `dtype`."""
    if cfg.memory.offload:
        if env is None:
            raise ValueError("memory.offload: build_optimizer needs the run's DistEnv")
        return OffloadEngine(model, cfg, env, dtype or compute_dtype_for(cfg, env.device))
    t = cfg.training
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)


def compute_dtype_for(cfg: Config, device: torch.device) -> torch.dtype:
    choice = cfg.training.dtype
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if choice == "bf16" else torch.float32


def attention_kernels(choice: str, device: torch.device):
    """A context that makes scaled_dot_product_attention prefer the chosen kernel (auto: torch's order)."""
    if choice == "auto" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[choice]
    order = [first] + [b for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                   SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if b != first]
    return sdpa_kernel(order, set_priority=True)


class TrainStep:
    """One optimizer step over `accum` micro-batches: the hot path, shared with bench/peers.py.

    Returns the step's mean loss and the gradient norm as device tensors, without synchronizing.
    """

    def __init__(self, model, optimizer, cfg: Config, env: DistEnv, dtype: torch.dtype, clock: PhaseClock | None = None):
        self.model, self.optimizer, self.env = model, optimizer, env
        self.clock = clock  # None: no phase timing (bench/peers.py times whole steps itself)
        self.clip = cfg.training.grad_clip if cfg.training.grad_clip > 0 else float("inf")
        # Autocast on one device; FSDP2 applies bf16 itself through its mixed-precision policy.
        self.autocast = dtype == torch.bfloat16 and env.world_size == 1
        self.attention = cfg.training.attention
        # memory.offload: the engine clips and steps (begin_step before the micro-batches, finish_step after).
        self.offload = optimizer if isinstance(optimizer, OffloadEngine) else None
        if self.offload is not None:
            self.offload.clock = clock
            self.fold_clip = False
        else:
            fused_adamw = all(g.get("fused") for g in optimizer.param_groups)
            # DTensor gradients (FSDP2) take the plain clipping path.
            self.fold_clip = fused_adamw and env.world_size == 1

    def __call__(self, fetch, accum: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self.offload is not None:
            self.offload.begin_step(lr, accum)
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        total = None
        device_type = self.env.device.type
        with attention_kernels(self.attention, self.env.device):
            for m in range(accum):
                batch = fetch(m)  # (inputs, targets[, doc_ids])
                if self.env.world_size > 1:
                    self.model.set_requires_gradient_sync(m == accum - 1)
                with self._phase("forward"), torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.autocast):
                    loss = self.model(*batch) / accum
                with self._phase("backward"):
                    loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
        if self.offload is not None:
            self.offload.wait_landed()  # timed as time.offload_wait (exposed), not as the optimizer
            with self._phase("optimizer"):
                grad_norm = self.offload.finish_step()
            return total, grad_norm
        with self._phase("optimizer"):
            grad_norm = self._clip_and_step()
        return total, grad_norm

    def lever_metrics(self, steps: int) -> dict:
        """Per-step figures of the levers the step drives (offload: CPU step, transfers), for the metrics row."""
        return self.offload.metrics(steps) if self.offload is not None else {}

    def _phase(self, name: str):
        return self.clock.phase(name) if self.clock is not None else contextlib.nullcontext()

    def _clip_and_step(self) -> torch.Tensor:
        if self.fold_clip:
            # Clip inside the fused AdamW kernel: it divides each gradient by grad_scale as it reads it,
            # which saves a read-modify-write pass over all gradients; a non-finite norm skips the step.
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
            self.optimizer.grad_scale = torch.clamp(grad_norm / self.clip, min=1.0)
            self.optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm


def _global_mean(value: torch.Tensor, env: DistEnv) -> float:
    if env.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value.item()


def train(cfg: Config) -> list[dict]:
    """Runs (or resumes) the job described by cfg. Returns the rows logged by this call (rank 0)."""
    env = init_distributed(cfg.job.device)
    try:
        return _train(cfg, env)
    finally:
        destroy_distributed()


def _data_plane(cfg: Config, env: DistEnv, tokenizer, micro: int, accum: int, state: dict | None, start_step: int):
    """Starts this node's data plane (local rank 0) and connects this rank to it."""
    from holotrain.data.client import DataClient, plane_address, start_plane
    from holotrain.data.corpus import EOS, PAD
    from holotrain.data.plane import PlaneSpec

    d = cfg.data
    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    node_first = env.rank - env.local_rank
    spec = PlaneSpec(
        sources=d.sources, tokenizer_path=str(cfg.run_dir / "tokenizer.json"), eos_id=tokenizer.token_to_id(EOS),
        pad_id=tokenizer.token_to_id(PAD) or 0, seq_len=d.seq_len, global_batch=cfg.training.batch_size,
        world_size=env.world_size, local_ranks=list(range(node_first, node_first + local)), micro_batch=micro,
        tp=cfg.parallel.tp,
        accum=accum, seed=cfg.job.seed, max_workers=d.workers, chunk_bytes=int(d.chunk_mb * 2**20),
        prefetch_steps=d.prefetch_steps, balance=d.balance, shuffle=d.shuffle, log_samples=d.log_samples,
        backend=d.backend, ray_address=d.ray_address,
    )
    address, key = plane_address(cfg.run_dir)
    plane = start_plane(spec, state, address, key) if env.local_rank == 0 else None
    return DataClient(address, key, env.rank, start_step, env.device, plane=plane)


def _train(cfg: Config, env: DistEnv) -> list[dict]:
    from holotrain.data.corpus import cache_dir, prepare_tokenizer, stdlib_sources

    run_dir = cfg.run_dir
    resolve(cfg)  # everything but the vocabulary can be checked before the sources are read
    d = cfg.data
    # Rank 0 builds the embedded corpus and the tokenizer cache; the others then find them ready.
    for turn in ("first", "rest"):
        if (turn == "first") == env.is_main:
            if not d.sources:
                d.sources = stdlib_sources(cache_dir(d.cache_dir))
            tokenizer, tokenizer_path = prepare_tokenizer(
                d.sources, d.tokenizer, d.vocab_size, d.tokenizer_sample_mb, cache_dir(d.cache_dir)
            )
        if turn == "first" and env.world_size > 1:
            dist.barrier()
    resolve(cfg, tokenizer_vocab=tokenizer.get_vocab_size())
    micro, accum = batch_layout(cfg, max(1, env.world_size // cfg.parallel.tp))  # per data-parallel rank

    resume_from = latest_checkpoint(run_dir)
    if resume_from is not None and not cfg.checkpoint.resume:
        raise ConfigError(
            f"{run_dir} already holds checkpoints; set checkpoint.resume=true to continue it or choose another job.run_dir"
        )
    resolve_offload_ratio(cfg, env, micro, accum, run_dir if resume_from is not None else None)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml())
        (run_dir / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
    if env.world_size > 1:
        dist.barrier()  # tokenizer.json is in place for the data plane

    dtype = compute_dtype_for(cfg, env.device)
    model = build_model(cfg, env, dtype)
    optimizer = build_optimizer(model, cfg, env, dtype)

    start_step, data_state = 0, None
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer)
        start_step = state["step"]
        data_state = json.loads((resume_from / DATA_STATE).read_text())
    if start_step >= cfg.training.steps:
        if env.is_main:
            print(f"{run_dir}: already trained to step {start_step} (training.steps={cfg.training.steps})")
        return []
    data = _data_plane(cfg, env, tokenizer, micro, accum, data_state, start_step)
    try:
        return _loop(cfg, env, model, optimizer, data, start_step, micro, accum, dtype)
    finally:
        data.close(stop_plane=env.local_rank == 0)


def _loop(cfg, env, model, optimizer, data, start_step, micro, accum, dtype) -> list[dict]:
    run_dir = cfg.run_dir
    logger = None
    if env.is_main:
        logger = MetricsLogger(run_dir, cfg.training.steps, start_step, cfg.profile.tensorboard, cfg.profile.progress)
        print(
            f"holotrain: {num_params(model) / 1e6:.1f}M parameters, world size {env.world_size}, device {env.device}, "
            f"{dtype}, batch {cfg.training.batch_size} x {cfg.data.seq_len} "
            f"(micro {micro}, accumulation {accum}), steps {start_step} -> {cfg.training.steps}, run dir {run_dir}"
        )

    clock = PhaseClock(env.device) if cfg.profile.phases else None
    train_step = TrainStep(model, optimizer, cfg, env, dtype, clock)
    telemetry = _start_telemetry(cfg, env)
    tracer = StepTracer(cfg.profile.trace_steps, run_dir, env.rank, cfg.profile.trace_max_mb, env.device.type == "cuda")
    samples_log = None
    if env.is_main and cfg.data.log_samples:
        truncate_jsonl(run_dir / "samples.jsonl", start_step)
        samples_log = open(run_dir / "samples.jsonl", "a")

    try:
        with _clock_control(cfg, env):
            rows = _steps(cfg, env, data, train_step, clock, telemetry, tracer, logger, samples_log, start_step, accum)
    finally:
        tracer.close()
        if telemetry is not None:
            telemetry.stop()
        if logger is not None:
            logger.close()
        if samples_log is not None:
            samples_log.close()
    if env.is_main and cfg.profile.report:
        from holotrain.profile.report import write_report

        print(f"holotrain: report {write_report(run_dir)}")
    return rows


def _start_telemetry(cfg: Config, env: DistEnv):
    """NVML sampling of the job's GPUs. A process that sees every card of its node (the usual torchrun layout)
    makes its node's first rank sample them all; with one visible card per process, each rank samples its own."""
    if not cfg.hw.telemetry or env.device.type != "cuda":
        return None
    from holotrain.hw.telemetry import Telemetry

    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    if torch.cuda.device_count() >= local:
        if env.local_rank != 0:
            return None
        node = env.rank // local
        indices, name = list(range(local)), "telemetry.jsonl" if node == 0 else f"telemetry.node{node}.jsonl"
    else:
        indices, name = [env.device.index or 0], "telemetry.jsonl" if env.rank == 0 else f"telemetry.rank{env.rank}.jsonl"
    telemetry = Telemetry(indices, cfg.run_dir / name, cfg.hw.telemetry_hz, rank=env.rank)
    telemetry.start()
    return telemetry


def _clock_control(cfg: Config, env: DistEnv):
    """Opt-in clock lock / power limit (hw.allow_clock_control) on this node's cards, restored when training ends."""
    wanted = cfg.hw.lock_sm_clock_mhz > 0 or cfg.hw.power_limit_w > 0
    if not wanted or env.device.type != "cuda" or env.local_rank != 0:
        return contextlib.nullcontext()
    from holotrain.hw.control import ClockControl

    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    return ClockControl(cfg.hw, cuda_indices=list(range(local)))


def _host_rss_gb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _energy_fields(telemetry, env: DistEnv, steps: int, tokens_per_step: int) -> dict:
    """Per-step energy of every GPU in the job (summed over samplers) and the clock/power figures this rank sampled."""
    window = telemetry.window() if telemetry is not None else {}
    joules = window.get("energy.joules")
    if env.world_size > 1:
        # Each sampler contributes the energy of the cards it samples and a count of one, other ranks zeros; NaN
        # marks a sampler without NVML, so a partial sum is never reported as the job's energy.
        mine = [0.0, 0.0] if telemetry is None else [joules if joules is not None else math.nan, 1.0]
        value = torch.tensor(mine, dtype=torch.float64, device=env.device)
        dist.all_reduce(value)
        total, samplers = value.tolist()
        joules = total if samplers > 0 and math.isfinite(total) else None
    per_step = joules / steps if joules is not None else None
    return {
        "energy.joules": per_step,
        "energy.j_per_token": per_step / tokens_per_step if per_step is not None else None,
        **{k: window.get(k) for k in HW_FIELDS},
    }


HW_FIELDS = ("hw.sm_clock_mhz", "hw.mem_clock_mhz", "hw.power_w", "hw.temp_c", "hw.power_capped_frac", "hw.util_gpu")


def _steps(cfg, env, data, train_step, clock, telemetry, tracer, logger, samples_log, start_step, accum) -> list[dict]:
    run_dir = cfg.run_dir
    tokens_per_step = cfg.training.batch_size * cfg.data.seq_len
    flops_per_step = flops_per_token(model_args(cfg), cfg.data.seq_len) * tokens_per_step / env.world_size
    peak = peak_bf16_flops(env.device)
    log_every = cfg.training.log_every
    rows: list[dict] = []
    model, optimizer = train_step.model, train_step.optimizer

    loss_sum = torch.zeros((), device=env.device)
    interval_start = time.perf_counter()
    interval_steps = 0
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    if telemetry is not None:
        telemetry.window()  # the first interval starts now, not at sampler start

    for step in range(start_step, cfg.training.steps):
        lr = lr_at(step, cfg)
        tracer.before(step + 1)
        micro_batches, waited = data.next()
        if clock is not None:
            clock.add("data_wait", waited)
        loss, grad_norm = train_step(micro_batches.__getitem__, accum, lr)
        tracer.after(step + 1)
        loss_sum += loss
        if samples_log is not None:
            samples_log.write(json.dumps({"step": step + 1, "samples": data.samples}) + "\n")
            samples_log.flush()
        interval_steps += 1
        done = step + 1

        if done % log_every == 0 or done == cfg.training.steps:
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            loss_value = _global_mean(loss_sum, env) / interval_steps
            gn = grad_norm.item()  # synchronizes the device: the interval's time is now complete
            elapsed = time.perf_counter() - interval_start
            cuda = env.device.type == "cuda"
            if telemetry is not None:
                telemetry.mark(done)
            step_s = elapsed / interval_steps
            flops_s = flops_per_step / step_s
            row = {
                "step": done,
                "loss": loss_value,
                "lr": lr,
                "grad_norm": gn,
                "tokens_per_s": tokens_per_step / step_s,
                "tflops": flops_s / 1e12,
                "mfu": flops_s / peak if peak else None,
                "step_s": step_s,
                # time.data_wait, time.forward, time.backward, time.optimizer (+ levers' own phases)
                **(clock.collect(interval_steps) if clock is not None else {}),
                **train_step.lever_metrics(interval_steps),  # offload.* (memory.offload)
                "mem.peak_gb": torch.cuda.max_memory_allocated(env.device) / 1e9 if cuda else None,
                "mem.reserved_gb": torch.cuda.max_memory_reserved(env.device) / 1e9 if cuda else None,
                "mem.host_rss_gb": _host_rss_gb(),
                **_energy_fields(telemetry, env, interval_steps, tokens_per_step),
                "wall_time": time.time(),
                "tokens": done * tokens_per_step,
                "data.tokens_by_source": data.stats.get("tokens_by_source"),
                "data.skipped": data.stats.get("skipped"),
                "data.skip_examples": data.stats.get("skip_examples"),
                "data.padding": data.stats.get("padding"),
                "data.cost_max_over_mean": data.stats.get("cost_max_over_mean"),
                "data.workers": data.stats.get("workers"),
                "data.worker_restarts": data.stats.get("worker_restarts"),
            }
            if logger is not None:
                logger.log(row)
                rows.append(row)
            loss_sum.zero_()
            interval_steps = 0
            interval_start = time.perf_counter()

        every = cfg.checkpoint.every
        if (every and done % every == 0) or (done == cfg.training.steps and cfg.checkpoint.save_final):
            data_state = data.state(done) if env.is_main else None
            save_checkpoint(
                run_dir, done, model, optimizer, {"step": done, "world_size": env.world_size},
                keep=cfg.checkpoint.keep, extra_files={DATA_STATE: json.dumps(data_state)} if env.is_main else None,
            )
    return rows
