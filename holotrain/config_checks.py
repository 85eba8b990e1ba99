"""The config's checks: each section's own (its `check`), then the rules across sections, each a ConfigError of one
line naming the key. Called by config.resolve once the model's dimensions are filled in (and again once the tokenizer
is known)."""

from __future__ import annotations

import dataclasses

from holotrain.model.registry import model_args, parallel_problem
from holotrain.section import need

# The order the sections are checked in: the first error found is the one reported.
CHECK_ORDER = ("model", "data", "training", "job", "checkpoint", "parallel", "profile", "hw", "plan", "memory")


def validate(cfg, tokenizer_vocab: int | None = None) -> None:
    """`cfg`: a holotrain.config.Config whose model dimensions are filled in."""
    names = [f.name for f in dataclasses.fields(cfg)]
    for name in sorted(names, key=lambda n: CHECK_ORDER.index(n) if n in CHECK_ORDER else len(CHECK_ORDER)):
        getattr(cfg, name).check()
    check_across(cfg, tokenizer_vocab)


def check_across(cfg, tokenizer_vocab: int | None = None) -> None:
    """The rules that read more than one section (or the tokenizer), once every section's own keys are valid."""
    m, t, d, par, mem = cfg.model, cfg.training, cfg.data, cfg.parallel, cfg.memory
    if tokenizer_vocab is not None:
        need(m.vocab_size > 0, f"model.vocab_size must be positive, got {m.vocab_size}")
    need(d.seq_len <= m.max_seq_len, f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if tokenizer_vocab is not None:
        need(tokenizer_vocab <= m.vocab_size,
             f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer_vocab})")
    need(not (t.fp8 in ("tensorwise", "rowwise", "delayed") and cfg.job.device == "cpu" and not t.fp8_emulate),
         f"training.fp8 = {t.fp8!r} needs a GPU with FP8 (compute capability 8.9 or later); job.device is cpu")
    need(not (t.fp8 == "delayed" and par.tp > 1),
         "training.fp8 = 'delayed' does not run under parallel.tp > 1 yet; use 'tensorwise' there")
    need(not (t.fp8 in ("tensorwise", "rowwise") and par.tp > 1 and par.tp_overlap != "none"),
         f"training.fp8 = {t.fp8!r} with parallel.tp > 1 needs parallel.tp_overlap = 'none' (the overlapped "
         f"GEMMs, {par.tp_overlap!r}, have no FP8 path)")
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
        need(not getattr(mem, "offload", False),
             "parallel.tp > 1 does not combine with memory.offload yet: use one of them")
    problem = parallel_problem(model_args(m), tp=par.tp, cp=par.cp, pp=par.pp, ep=par.ep)
    need(problem is None, problem)
    need(not (mem.offload and par.ep > 1), "memory.offload does not combine with parallel.ep > 1 yet: use one of them")
    if par.pp > 1:
        # What pipeline stages do not run with yet, each in one line.
        need(not mem.offload, "parallel.pp > 1 does not combine with memory.offload: use one of them")
        need(mem.activation_offload_blocks == 0,
             "parallel.pp > 1 does not combine with memory.activation_offload_blocks > 0 yet")
        need(not m.tie_embeddings, "model.tie_embeddings shares the embedding with the head, which pipeline stages "
             "put on different ranks: set model.tie_embeddings = false or parallel.pp = 1")
        need(m.n_layers + 2 >= par.pp, f"parallel.pp={par.pp} needs at least as many units as stages (embedding, "
             f"{m.n_layers} blocks, head)")
        need(not (t.compile and par.pp_schedule in ("zb1p", "zbv")),
             f"parallel.pp_schedule = {par.pp_schedule!r} splits backward in a way torch.compile does not trace: "
             "set training.compile = false, or choose 1f1b or interleaved")
        need(t.fp8 != "delayed", "training.fp8 = 'delayed' does not run under parallel.pp > 1 yet: use 'tensorwise'")
    if par.cp > 1:
        need(d.seq_len % (2 * par.cp * par.tp) == 0, f"data.seq_len={d.seq_len} must divide by 2 x parallel.cp x "
             f"parallel.tp = {2 * par.cp * par.tp} (each rank holds two equal chunks of every sequence)")
        need(not mem.offload, "parallel.cp > 1 does not combine with memory.offload yet: use one of them")
    blocks = mem.activation_checkpointing_blocks
    need(isinstance(blocks, int) and 0 <= blocks <= m.n_layers,
         f"memory.activation_checkpointing_blocks must be between 0 and model.n_layers = {m.n_layers}, got {blocks!r}")
    need(blocks == 0 or mem.activation_checkpointing in ("full", "pointwise", "all-but-attention"),
         f'memory.activation_checkpointing_blocks = {blocks} applies to "full", "pointwise" and "all-but-attention", '
         f'not '
         f'{mem.activation_checkpointing!r} ("selective" is "full" on every other block)')
    need(0 <= mem.activation_offload_blocks <= m.n_layers, "memory.activation_offload_blocks must be between 0 and "
         f"model.n_layers = {m.n_layers}, got {mem.activation_offload_blocks}")
    # The offload engine assumes FSDP2's sharding (disjoint shards, one gradient per step); tensor parallelism
    # replicates some parameters across ranks, which its norm would count twice.
    need(not (mem.offload and par.tp > 1), "memory.offload does not combine with parallel.tp > 1 yet")
    need(not (mem.ffn_tiles > 1 and par.tp > 1), "memory.ffn_tiles > 1 does not combine with parallel.tp > 1 (the "
         "sequence-parallel feed-forward gathers the sequence inside it): set one of them to 1")
