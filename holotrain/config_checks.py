"""The config's checks: every key's range and the rules across sections, each a ConfigError of one line naming the
key. Called by config.resolve once the model's dimensions are filled in (and again once the tokenizer is known)."""

from __future__ import annotations

from holotrain.errors import ConfigError

PP_SCHEDULES = ("auto", "1f1b", "interleaved", "zb1p", "zbv")


def validate(cfg, tokenizer_vocab: int | None = None) -> None:
    """`cfg`: a holotrain.config.Config whose model dimensions are filled in."""
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
    need(0 <= d.max_skip_fraction <= 1, f"data.max_skip_fraction must be in [0, 1], got {d.max_skip_fraction}")
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
    need(c.interrupt_grace_s > 0, f"checkpoint.interrupt_grace_s must be positive, got {c.interrupt_grace_s}")
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

