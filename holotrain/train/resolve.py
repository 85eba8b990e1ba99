"""Config resolution, once, before anything is built: model presets, the corpus and tokenizer, the batch layout,
and every "auto" value, agreed by all ranks. The result is a read-only config (Config.freeze) that every lever
reads its own section of; nothing changes it afterwards, and it is what the run saves as config.toml."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from holotrain.config import Config, ConfigError, batch_layout, load_config, resolve
from holotrain.memory.fit import choose_offload_ratio
from holotrain.memory.plan import long_sequence_levers, plan_memory
from holotrain.model import ModelArgs, build, num_params
from holotrain.model.registry import model_args as section_args
from holotrain.parallel import DistEnv
from holotrain.parallel.dims import ParallelDims
from holotrain.precision.lever import fp8_capable, fp8_shapes
from holotrain.precision.probe import choose as choose_fp8
from holotrain.train.checkpoint import list_checkpoints
from holotrain.train.preflight import check_data, check_room, check_run_dir_owner, claim_run_dir
from holotrain.train.rundir import RunDirLock
from holotrain.train.snapshots import any_local
from holotrain.train.step import lr_at


@dataclass(frozen=True)
class Job:
    """A resolved job: the frozen config and what resolution found out on the way."""

    cfg: Config
    micro: int  # sequences per rank per forward
    accum: int  # micro-batches per optimizer step
    tokenizer: object  # tokenizers.Tokenizer of the run
    tokenizer_path: Path  # its tokenizer.json in the cache
    resume: bool  # the run continues from a checkpoint or in-memory snapshot of it
    lock: RunDirLock | None = None  # the run directory's, held by rank 0 until the run ends (release())
    saved: dict | None = None  # the run directory's config.toml before this session (rank 0; None: a new run)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def model_args(cfg: Config) -> ModelArgs:
    return section_args(cfg.model)


def compute_dtype_for(cfg: Config, device: torch.device) -> torch.dtype:
    """training.dtype with "auto" resolved: bf16 on a GPU, fp32 on the CPU."""
    choice = cfg.training.dtype
    if choice == "auto":
        choice = "bf16" if device.type == "cuda" else "fp32"
    return torch.bfloat16 if choice == "bf16" else torch.float32


def data_parallel_size(cfg: Config, env: DistEnv) -> int:
    """Ranks that read different batches: a tensor-, context- and pipeline-parallel group reads one."""
    return ParallelDims.of(cfg.parallel, env.world_size).dp


def resolve_pipeline(cfg: Config, env: DistEnv) -> None:
    """parallel.pp_schedule = "auto" and parallel.pp_microbatches = 0, in place, for parallel.pp > 1.

    The schedule: interleaved 1F1B where each rank can hold two stages and the blocks are compiled (torch.compile
    does not trace the zero-bubble schedules' split backward), else zero bubble in a V, which fills the bubble
    with the weight-gradient halves and needs no transfer at the turn of the V; 1F1B where there are too few units
    for two stages a rank. The micro-batches: as training.micro_batch_size makes them, else the fewest of at least
    2 x pp that split each replica's rows evenly (1F1B's bubble is (pp - 1) / (micro-batches + pp - 1): 2 x pp
    keeps it near a third, more costs smaller GEMMs). The schedule's micro-batches are the step's gradient
    accumulation: training.micro_batch_size is set to match."""
    par, t = cfg.parallel, cfg.training
    if par.pp == 1:
        return
    if par.pp_schedule == "auto":
        two_a_rank = cfg.model.n_layers + 2 >= 2 * par.pp
        par.pp_schedule = ("interleaved" if t.compile else "zbv") if two_a_rank else "1f1b"
    rows = t.batch_size // data_parallel_size(cfg, env)
    if rows == 0 or t.batch_size % data_parallel_size(cfg, env):
        raise ConfigError(f"training.batch_size={t.batch_size} must be a multiple of the data-parallel replicas "
                          f"({data_parallel_size(cfg, env)} with parallel.pp={par.pp})")
    if par.pp_microbatches:
        if rows % par.pp_microbatches:
            raise ConfigError(f"parallel.pp_microbatches={par.pp_microbatches} must divide each replica's "
                              f"{rows} rows of training.batch_size={t.batch_size}")
        micro = rows // par.pp_microbatches
        if t.micro_batch_size and t.micro_batch_size != micro:
            raise ConfigError(f"training.micro_batch_size={t.micro_batch_size} and parallel.pp_microbatches="
                              f"{par.pp_microbatches} disagree ({rows} rows a replica): set one of them")
        t.micro_batch_size = micro
    elif t.micro_batch_size:
        if rows % t.micro_batch_size:
            raise ConfigError(f"training.micro_batch_size={t.micro_batch_size} must divide each replica's {rows} "
                              f"rows of training.batch_size={t.batch_size}")
        par.pp_microbatches = rows // t.micro_batch_size
    else:
        n = next((n for n in range(2 * par.pp, rows + 1) if rows % n == 0), rows)
        par.pp_microbatches, t.micro_batch_size = n, rows // n
    n = par.pp_microbatches
    if n < par.pp:  # torch's 1F1B refuses it, and every schedule would idle most of each step
        raise ConfigError(f"parallel.pp={par.pp} needs at least {par.pp} micro-batches a step, got {n} ({rows} "
                          f"rows a replica, training.micro_batch_size={t.micro_batch_size}): raise "
                          "training.batch_size or lower training.micro_batch_size")
    rounds = max(1, n // par.pp)
    if par.pp_schedule == "interleaved" and n % rounds:
        raise ConfigError(f"parallel.pp_schedule = 'interleaved' runs micro-batches in rounds of parallel.pp="
                          f"{par.pp}: parallel.pp_microbatches={n} must be a multiple of {rounds}")


def resolve_job(cfg: Config, env: DistEnv) -> Job:
    """Resolves `cfg` in place for this run and freezes it, after checking every input (train/preflight.py) and
    claiming the run directory: the returned Job holds its lock (Job.release). Collective: every rank calls it."""
    resolve(cfg)  # everything but the vocabulary can be checked before the sources are read
    lock = claim_run_dir(cfg, env)  # before anything is read or written: a second process is refused at once
    try:
        return _resolve_locked(cfg, env, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _resolve_locked(cfg: Config, env: DistEnv, lock: RunDirLock | None) -> Job:
    from holotrain.data.corpus import cache_dir, prepare_tokenizer, stdlib_sources

    check_data(cfg, env)
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
    saved = check_run_dir_owner(cfg, env, tokenizer_path)
    with torch.device("meta"):
        check_room(cfg, env, num_params(build(model_args(cfg))))
    resolve_pipeline(cfg, env)
    micro, accum = batch_layout(cfg, data_parallel_size(cfg, env))

    # On disk, or this run's in-memory snapshots in any rank's RAM (some may have lost theirs with their node).
    found = torch.tensor([int(bool(list_checkpoints(cfg.run_dir)) or any_local(cfg.run_dir))])
    if env.world_size > 1:
        found = found.to(env.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    resume = bool(found.item())
    if resume and not cfg.checkpoint.resume:
        raise ConfigError(
            f"{cfg.run_dir} already holds checkpoints; set checkpoint.resume=true to continue it or choose another "
            "job.run_dir"
        )
    resolve_levers(cfg, env, micro, accum, cfg.run_dir if resume else None)
    return Job(cfg.freeze(), micro, accum, tokenizer, tokenizer_path, resume, lock, saved)


def say_schedule_change(saved: dict | None, cfg: Config, step: int) -> None:
    """On resume: the learning-rate schedule is always the current config's (training.steps, warmup_steps, lr,
    min_lr_ratio), so raising training.steps re-stretches the cosine from the resumed step on. Where the schedule
    changed, one line gives the old and the new learning rate at the resumed step."""
    if not saved or "training" not in saved:
        return
    keys = ("steps", "warmup_steps", "lr", "min_lr_ratio")
    old = dataclasses.replace(cfg.training, **{k: saved["training"][k] for k in keys if k in saved["training"]})
    changed = [f"training.{k} {getattr(old, k):g} -> {getattr(cfg.training, k):g}" for k in keys
               if getattr(old, k) != getattr(cfg.training, k)]
    if changed:
        before = lr_at(step, dataclasses.replace(cfg, training=old))
        print(f"holotrain: the learning-rate schedule changed on resume ({', '.join(changed)}): at step {step} the "
              f"learning rate is {lr_at(step, cfg):.3g} (it was {before:.3g} under the run's previous schedule)",
              flush=True)


def resolve_levers(cfg: Config, env: DistEnv, micro: int, accum: int, resumed_run: Path | None = None) -> Config:
    """The levers' "auto" values, in place (before freezing). Collective when any needs the ranks' agreement.

    memory.offload_ratio = "auto": the smallest ratio the memory plan fits, agreed by all ranks (the largest of
    their choices), or, when resuming, the run's own choice (the checkpoint's split of optimizer state between
    GPU and host follows it)."""
    fp8 = _fp8_pays(cfg, env, micro) if cfg.training.fp8 == "auto" else None
    if fp8 is not None:
        # Checkpointing is planned with the recipe FP8 will take (on one GPU the delayed one, whose kept transposes
        # need room), or without FP8: "auto" left in place would plan FP8's smaller activations where it stays off.
        cfg.training.fp8 = "delayed" if fp8[0] == "tensorwise" and env.world_size == 1 else fp8[0]
    _resolve_checkpointing(cfg, env, micro, accum)
    if fp8 is not None:
        _settle_fp8(cfg, env, micro, accum, *fp8)
    mem = cfg.memory
    if mem.offload_ratio != "auto":
        return cfg
    if not mem.offload:
        mem.offload_ratio = 1.0  # unused
        return cfg
    if resumed_run is not None:
        saved = load_config(resumed_run / "config.toml").memory.offload_ratio
        if saved != "auto":
            mem.offload_ratio = float(saved)
            return cfg
    with torch.device("meta"):
        model = build(model_args(cfg))
    ratio = choose_offload_ratio(model, cfg, env.world_size, env.device, micro, accum,
                                 local_ranks=env.local_world_size)
    if env.world_size > 1:
        agreed = torch.tensor([ratio], dtype=torch.float64, device=env.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        ratio = float(agreed.item())
    mem.offload_ratio = ratio
    if env.is_main:
        print(f"holotrain: memory.offload_ratio = auto -> {ratio:g} (the smallest share of the optimizer on the CPU "
              "that the memory plan fits)")
    return cfg


def _resolve_checkpointing(cfg: Config, env: DistEnv, micro: int, accum: int) -> None:
    if cfg.memory.activation_checkpointing == "auto":
        for key, value in checkpointing_choice(cfg, env, micro, accum).items():
            setattr(cfg.memory, key, value)


def with_checkpointing(cfg: Config, env: DistEnv) -> Config:
    """`cfg` (a copy, when it changes) with memory.activation_checkpointing = "auto" resolved: for callers that
    resolved only the config sections (the benchmarks build models straight from a preset)."""
    if cfg.memory.activation_checkpointing != "auto":
        return cfg
    chosen = checkpointing_choice(cfg, env, *batch_layout(cfg, data_parallel_size(cfg, env)))
    return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, **chosen))


def checkpointing_choice(cfg: Config, env: DistEnv, micro: int, accum: int, **capacity) -> dict:
    """memory.activation_checkpointing = "auto": of the policies (and their spreads over any number of blocks), the
    one with the least recomputation that the memory plan fits, agreed by all ranks, as the memory section's
    settings. Where even "full" does not fit, and the job left memory.ffn_tiles and memory.activation_offload_blocks
    at their defaults, the long-sequence levers in turn (activation_checkpointing.long_sequence_choices:
    feed-forwards tiled, then as few blocks' inputs on the host as fit, then recompute segments); "full" if nothing
    fits, which the memory check then refuses with the numbers. Long sequences are what make it matter: the 1.4b
    keeps every activation at T = 2048 and recomputes blocks at T = 131072. The recomputation counted: the matmuls
    run again, and the attention forward of the blocks recomputed whole, which at long sequences outweighs them
    ("all-but-attention" keeps it). `capacity`: plan_memory's, in place of this machine's."""
    mem = cfg.memory
    from holotrain.memory.activation_checkpointing import (checkpointed_blocks, checkpointing_choices,
                                                           long_sequence_choices, recompute_share)
    from holotrain.model.costs import ATTENTION_FORWARD_SHARE, attention_flops_per_token, flops_per_token

    n_layers, args = cfg.model.n_layers, model_args(cfg)
    # A block's attention forward as a share of the blocks' matmul FLOPs (recompute_share's unit)
    blocks_flops = flops_per_token(args, 0) - 6 * args.dim * args.vocab_size
    attention = ATTENTION_FORWARD_SHARE * attention_flops_per_token(args, cfg.data.seq_len) / blocks_flops

    def recomputation(choice: tuple[str, int]) -> tuple:
        policy, blocks = choice
        whole = len(checkpointed_blocks(policy, n_layers, blocks)) / n_layers
        return recompute_share(policy, n_layers, blocks=blocks) + attention * whole, choice

    choices = [{"activation_checkpointing": policy, "activation_checkpointing_blocks": blocks}
               for policy, blocks in sorted(checkpointing_choices(n_layers, every_count=True), key=recomputation)]
    full = next(i for i, c in enumerate(choices) if c["activation_checkpointing"] == "full"
                and not c["activation_checkpointing_blocks"])
    # The long-sequence levers: where the job left them to the plan, on one GPU's sequence (no TP, CP or pipeline;
    # on a CPU the host is the device memory, so its inputs have nowhere to go).
    par = cfg.parallel
    if (env.device.type == "cuda" and not long_sequence_levers(mem)
            and par.tp == par.pp == getattr(par, "cp", 1) == 1):
        choices += long_sequence_choices(n_layers, cfg.data.seq_len)
    with torch.device("meta"):
        model = build(args)
    ratio = 1.0 if mem.offload and mem.offload_ratio == "auto" else None
    pick, fitted = full, None
    for i, choice in enumerate(choices):
        trial = dataclasses.replace(cfg, memory=dataclasses.replace(mem, **choice))
        plan = plan_memory(model, trial, env.world_size, env.device, micro, accum, ratio=ratio,
                           local_ranks=env.local_world_size, **capacity)
        if plan.gpu_fits and plan.host_fits:
            pick, fitted = i, plan
            break
    if env.world_size > 1:
        agreed = torch.tensor([pick], device=env.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        pick = int(agreed.item())
    chosen = choices[pick]
    if env.is_main:
        blocks, tiles = chosen["activation_checkpointing_blocks"], chosen.get("ffn_tiles", 1)
        moved = chosen.get("activation_offload_blocks", 0)
        what = chosen["activation_checkpointing"] + (f" on {blocks} of {n_layers} blocks" if blocks else "")
        what += f", memory.ffn_tiles = {tiles}" if tiles > 1 else ""
        what += f", memory.activation_offload_blocks = {moved} (their inputs in host memory)" if moved else ""
        segment = chosen.get("activation_checkpointing_segment", 1)
        what += f", memory.activation_checkpointing_segment = {segment}" if segment > 1 else ""
        # The chosen setting's need; where nothing fits, the memory check that follows gives the numbers.
        need = (f": {fitted.gpu_need / 1e9:.1f} of {fitted.gpu_capacity / 1e9:.1f} GB"
                if fitted and fitted.gpu_capacity else "")
        print(f"holotrain: memory.activation_checkpointing = auto -> {what} (the least recomputation the memory plan "
              f"fits at {micro} x {cfg.data.seq_len} tokens per micro-batch{need})", flush=True)
    return chosen


def _fp8_pays(cfg: Config, env: DistEnv, micro: int) -> tuple[str, str]:
    """training.fp8 = "auto", before the memory is planned: ("tensorwise", why) where this GPU's FP8 GEMMs, measured
    at the job's shapes, pay (every rank measures its own GPU; FP8 goes on only if it pays on all), else ("none",
    why)."""
    reason = fp8_capable(env.device)
    choice = "none"
    if reason is None and cfg.parallel.tp > 1 and cfg.parallel.tp_overlap != "none":
        reason = f"parallel.tp_overlap = {cfg.parallel.tp_overlap!r} has no FP8 GEMMs"
    if reason is None:
        with torch.device("meta"):
            model = build(model_args(cfg))
        choice, reason = choose_fp8(fp8_shapes(model, cfg.training.fp8_skip), micro * cfg.data.seq_len, env.device)
    if env.world_size > 1:
        on = torch.tensor([int(choice != "none")], device=env.device)
        dist.all_reduce(on, op=dist.ReduceOp.MIN)
        if choice != "none" and not on.item():
            choice, reason = "none", "FP8 does not pay on another rank's GPU"
    return choice, reason


def _settle_fp8(cfg: Config, env: DistEnv, micro: int, accum: int, choice: str, reason: str) -> None:
    """training.fp8 = "auto", after the checkpointing: where FP8 pays, on one GPU the delayed recipe (its casts fused:
    the 1.4b trained about 1.05x faster than with tensorwise) if the memory plan fits it (it keeps forward's FP8
    transposes), else tensorwise. On several GPUs tensorwise: FSDP2 all-gathers its weights in FP8, and tensor
    parallelism has no delayed recipe. One line says which and why."""
    if choice == "tensorwise" and env.world_size == 1:
        with torch.device("meta"):
            model = build(model_args(cfg))
        choice, why = delayed_if_it_fits(model, cfg, env.device, micro, accum)
        reason = f"{reason}; {why}"
    cfg.training.fp8 = choice
    if env.is_main:
        print(f"holotrain: training.fp8 = auto -> {choice} ({reason})")


def delayed_if_it_fits(model: torch.nn.Module, cfg: Config, device: torch.device, micro: int, accum: int,
                       **capacity) -> tuple[str, str]:
    """("delayed" or "tensorwise", why), by the memory plan of the job on one GPU with the delayed recipe (its most
    offloaded optimizer when memory.offload_ratio is "auto"). `capacity`: plan_memory's, in place of this
    machine's."""
    trial = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, fp8="delayed"))
    ratio = 1.0 if cfg.memory.offload_ratio == "auto" else None
    plan = plan_memory(model, trial, 1, device, micro, accum, ratio=ratio, local_ranks=1, **capacity)
    if plan.gpu_fits and plan.host_fits:
        return "delayed", "delayed scaling, whose casts fuse into the kernels that make the tensors"
    need, have, where = ((plan.gpu_need, plan.gpu_capacity, "GPU") if not plan.gpu_fits
                         else (plan.host_need, plan.host_capacity, "host"))
    return "tensorwise", (f"tensorwise: delayed scaling would need {need / 1e9:.1f} GB of {where} memory, "
                          f"{have / 1e9:.1f} GB available")
