"""The training loop. Every lever is reached from here in one hop and built from its own config section:
data (data.lever), parallel (parallel.lever), memory (memory), optimizer (optim, through memory), hardware
(hw.lever), profiling (profile.lever). The config is resolved once, up front (train.resolve), and read-only after."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import uuid

import torch
import torch.distributed as dist

from holotrain.config import Config, batch_layout
from holotrain.data.corpus import TOKENIZER_FILES
from holotrain.data.lever import Layout
from holotrain.data.lever import build as build_data
from holotrain.errors import ConfigError, Interrupted, SaveFailed, TrainingStopped
from holotrain.hw import peak_bf16_flops
from holotrain.hw.lever import build as build_hardware
from holotrain.memory import Memory
from holotrain.memory import build as build_memory
from holotrain.memory import build_optimizer as _build_optimizer
from holotrain.memory.plan import expandable_segments_reason, gpu_cap_bytes, process_rss_bytes
from holotrain.model import build, flops_per_token, num_params
from holotrain.model.costs import attention_pairs, block_density
from holotrain.optim import AdamWHyper, StepOptimizer
from holotrain.precision import build as build_precision
from holotrain.parallel import DistEnv, init_distributed
from holotrain.parallel.dims import ParallelDims
from holotrain.parallel.launch import destroy_distributed
from holotrain.parallel.lever import Parallel
from holotrain.parallel.lever import build as build_parallel
from holotrain.parallel.pp_timeline import log_step as pipeline_bubble
from holotrain.profile.lever import build as build_profiler
from holotrain.train.checkpoint import RUN_ID, latest_checkpoint, load_model_weights
from holotrain.train.checkpointer import Checkpoints
from holotrain.train.interrupts import StopSignals
from holotrain.train.resolve import (
    Job,
    compute_dtype_for,
    data_parallel_size,
    model_args,
    resolve_job,
    say_schedule_change,
    with_checkpointing,
)
from holotrain.train.evaluation import build as build_evaluator
from holotrain.train.routing import Routing
from holotrain.train.step import TrainStep, lr_at

__all__ = ["TrainStep", "build_model", "build_optimizer", "compute_dtype_for", "lr_at", "model_args", "train"]

DATA_STATE = "data_state.json"


def build_model(cfg: Config, env: DistEnv, compute_dtype: torch.dtype, memory: Memory | None = None,
                par: Parallel | None = None, pretrained: bool = True) -> torch.nn.Module:
    """Builds the plain model, applies the levers from outside (tensor parallelism, FP8 linear layers, the memory
    lever's compute choices, compilation, FSDP2), then gives it its weights: seeded, or model.init_from's
    (`pretrained`: False when a checkpoint of the run will overwrite them). `cfg` must be resolved (no "auto"
    offload ratio or fp8)."""
    cfg = with_checkpointing(cfg, env)
    memory = memory or build_memory(cfg.memory, env)
    par = par or build_parallel(cfg.parallel, env)
    precision = build_precision(cfg.training, env, data_parallel_size(cfg, env))
    if cfg.parallel.pp > 1:
        model = _build_stages(cfg, env, compute_dtype, memory, par, precision, pretrained)
    else:
        # Built on "meta" (no memory), wrapped by the levers, placed (sharded, if FSDP), and only then
        # initialized: a 7B model never exists whole in host memory, and the seed alone decides the weights.
        with torch.device("meta"):
            model = build(model_args(cfg))
        # A plan that cannot fit GPU or host memory is refused now, with the numbers, not by an OOM later.
        memory.check_fit(model, cfg, *batch_layout(cfg, data_parallel_size(cfg, env)))
        _apply_levers(model, cfg, env, compute_dtype, memory, par, precision, pretrained)
    if env.is_main and par.cp_mode:
        print(f"holotrain: context parallelism over {cfg.parallel.cp} ranks ({par.cp_mode})", flush=True)
    if env.is_main and precision.describe():
        print(f"holotrain: {precision.describe()}" + (" of rank 0's pipeline stages" if cfg.parallel.pp > 1 else ""),
              flush=True)
    return model


def _apply_levers(model: torch.nn.Module, cfg: Config, env: DistEnv, compute_dtype: torch.dtype, memory: Memory,
                  par: Parallel, precision, pretrained: bool) -> None:
    """The levers on a plain model (or a pipeline stage of one) built on "meta", in order, then its weights."""
    par.apply_tp(model)
    par.apply_cp(model)
    par.apply_ep(model)
    precision.apply(model)
    memory.apply(model, vocab_parallel_loss=cfg.parallel.tp > 1)
    if cfg.training.compile:
        model.compile_regions()
    par.apply_fsdp(model, compute_dtype)
    model.to_empty(device="cpu" if memory.host_built else env.device)
    model.tie_weights()  # to_empty makes a module's parameters anew (FSDP2 keeps a tie; plain placement does not)
    if cfg.model.init_from and pretrained:
        load_pretrained(model, cfg.model.init_from, env)
    else:
        model.init_weights(seed=cfg.job.seed)
    precision.initialize(model)


def _build_stages(cfg: Config, env: DistEnv, compute_dtype: torch.dtype, memory: Memory, par: Parallel, precision,
                  pretrained: bool) -> torch.nn.Module:
    """parallel.pp > 1: this rank's pipeline stages, each a plain model pruned to its units (keeping the plain
    model's names, so each draws the same weights as the whole model would), every lever applied to each, driven
    as one model by the schedule. The memory plan, which counts whole models, is not applied: plan/cluster.py
    sizes pipeline stages."""
    from holotrain.parallel.pp import stage_model

    args = model_args(cfg)
    stage_ids, units, n_stages = par.stage_units(args, cfg.data.seq_len)
    stages = []
    for first, last in units:
        with torch.device("meta"):
            stage = stage_model(build(args), first, last)
        _apply_levers(stage, cfg, env, compute_dtype, memory, par, precision, pretrained)
        stages.append(stage)
    _, accum = batch_layout(cfg, data_parallel_size(cfg, env))
    model = par.pipeline(stages, stage_ids, n_stages, accum)
    if env.is_main:
        print(f"holotrain: pipeline over {cfg.parallel.pp} ranks, {n_stages} stages ({cfg.parallel.pp_schedule}, "
              f"{accum} micro-batches a step); this rank's units {units} of embedding, {args.n_layers} blocks, head",
              flush=True)
    return model


def load_pretrained(model: torch.nn.Module, init_from: str, env: DistEnv) -> None:
    """model.init_from's weights into the placed model (each rank its own slices), with the time and host memory
    it took on the console."""
    from holotrain.model.pretrained import describe, load_hf_weights

    t0 = time.perf_counter()
    source = describe(init_from)
    model.init_rope()
    if source.kind == "hf":
        read = load_hf_weights(model, source)
    else:
        checkpoint = source.checkpoint or latest_checkpoint(source.directory)
        if checkpoint is None:
            raise ConfigError(f"model.init_from: {source.directory} holds no intact checkpoint")
        load_model_weights(checkpoint, model)
        read = sum(p.numel() * p.element_size() for p in model.parameters())
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    if env.is_main:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        print(f"holotrain: weights from {source.directory}: {read / 1e9:.2f} GB read on rank 0 "
              f"in {time.perf_counter() - t0:.1f} s (peak host memory {rss / 1e9:.1f} GB)", flush=True)


def build_optimizer(model: torch.nn.Module, cfg: Config, env: DistEnv, dtype: torch.dtype | None = None,
                    clock=None) -> StepOptimizer:
    """The job's optimizer (AdamW on the device, or the offload engine with memory.offload)."""
    dtype = dtype or compute_dtype_for(cfg, env.device)
    return _build_optimizer(model, cfg.memory, AdamWHyper.from_section(cfg.training), cfg.training.lr, env, dtype,
                            clock)


def train(cfg: Config) -> list[dict]:
    """Runs (or resumes) the job described by cfg. Returns the rows logged by this call (rank 0). Raises
    errors.Interrupted when SIGINT or SIGTERM stopped it (after saving a checkpoint of the step it stopped at)."""
    env = init_distributed(cfg.job.device)
    rows, stopped = [], None
    try:
        try:
            with StopSignals().installed() as stop:
                rows = _train(cfg, env, stop)
        except (ConfigError, Interrupted, SaveFailed, TrainingStopped) as e:
            # Said in one line by the CLI: dropping its traceback (and any it was raised beside) lets the frames that
            # hold the model and its process groups go before the teardown.
            stopped = e.with_traceback(None)
            stopped.__context__ = stopped.__cause__ = None
    finally:
        destroy_distributed()
    if stopped is not None:
        raise stopped
    return rows


def _train(cfg: Config, env: DistEnv, stop: StopSignals) -> list[dict]:
    # Before resolve_job: the allocator's settings must precede the first CUDA allocation, and an "auto"
    # memory.offload_ratio is planned within the GPU memory cap.
    expandable = env.device.type == "cuda" and _set_up_gpu_memory(cfg, env)
    job = resolve_job(cfg, env)  # holds the run directory's lock from here on
    if env.device.type == "cuda" and not expandable:  # "auto" may have chosen the long-sequence levers
        _expandable_segments(job.cfg, env)
    try:
        return _train_locked(job, env, stop)
    finally:
        job.release()


def _train_locked(job: Job, env: DistEnv, stop: StopSignals) -> list[dict]:
    cfg, run_dir = job.cfg, job.cfg.run_dir
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml())
        (run_dir / "tokenizer.json").write_bytes(job.tokenizer_path.read_bytes())
        for name in TOKENIZER_FILES:  # a Hugging Face tokenizer's special tokens and chat template travel with it
            if job.tokenizer_path.with_name(name).is_file():
                (run_dir / name).write_bytes(job.tokenizer_path.with_name(name).read_bytes())
        if not (run_dir / RUN_ID).is_file():
            (run_dir / RUN_ID).write_text(uuid.uuid4().hex)
    if env.world_size > 1:
        dist.barrier()  # tokenizer.json is in place for the data plane

    dtype = compute_dtype_for(cfg, env.device)
    memory = build_memory(cfg.memory, env)
    profiler = build_profiler(cfg.profile, env, run_dir)
    par = build_parallel(cfg.parallel, env)
    dims = par.dims  # the layout's sizes, for the data plane, validation and MFU
    model = build_model(cfg, env, dtype, memory, par, pretrained=not job.resume)
    optimizer = memory.optimizer(model, AdamWHyper.from_section(cfg.training), cfg.training.lr, dtype,
                                 profiler.clock)
    checkpointer = Checkpoints(cfg.checkpoint, env, run_dir, cfg.training.steps)
    try:
        start_step, data_state = 0, None
        t0 = time.time()
        resumed = checkpointer.restore(optimizer) if job.resume else None
        profiler.goodput.recovery_s = time.time() - t0 if resumed is not None else 0.0
        if resumed is not None:
            _, trainer_state, files = resumed
            start_step = trainer_state["step"]
            data_state = json.loads(files[DATA_STATE])
            if env.is_main:
                say_schedule_change(job.saved, cfg, start_step)
        if start_step >= cfg.training.steps:
            if env.is_main:
                print(f"{run_dir}: already trained to step {start_step} (training.steps={cfg.training.steps})")
            return []
        holdout = cfg.eval.holdout if cfg.eval.every and not cfg.eval.sources else 0.0
        layout = Layout(cfg.training.batch_size, job.micro, job.accum, cfg.job.seed, dims, holdout)
        evaluator = build_evaluator(cfg, env, dims, job.micro, dtype, run_dir)
        data = build_data(cfg.data, env, run_dir, job.tokenizer, layout, data_state, start_step)
        try:
            rows = _loop(cfg, env, model, optimizer, data, profiler, checkpointer, start_step, job.micro, job.accum,
                         dtype, stop, dims, evaluator)
        finally:
            checkpointer.close()  # the last save's write completes before the data plane and the optimizer go
            data.close()
    finally:
        checkpointer.close()
        optimizer.close()
        profiler.close()
    checkpointer.discard_memory()  # the run is complete: its in-memory snapshots are not needed
    profiler.write_goodput(checkpointer.blocking_total_s)
    report = profiler.write_report()
    if report is not None:
        print(f"holotrain: report {report}")
    checkpointer.finish()  # names the newest intact checkpoint; SaveFailed if the final one could not be written
    return rows


def _set_up_gpu_memory(cfg: Config, env: DistEnv) -> bool:
    """Expandable segments where the run needs them, and the cap hw.gpu_memory_gb on this process's allocator
    (the memory plan reads the cap back through torch.cuda.get_per_process_memory_fraction). Whether the segments
    are on."""
    expandable = _expandable_segments(cfg, env)
    cap_gb = cfg.hw.gpu_memory_gb
    if cap_gb > 0:  # a negative value is left to the config check in resolve_job
        total = torch.cuda.get_device_properties(env.device).total_memory
        if cap_gb * 1e9 > total and env.is_main:
            print(f"holotrain: warning: hw.gpu_memory_gb = {cap_gb:g} is larger than the GPU ({total / 1e9:.1f} GB) "
                  "and is ignored", flush=True)
        torch.cuda.set_per_process_memory_fraction(gpu_cap_bytes(total, cap_gb) / total, env.device)
    return expandable


def _expandable_segments(cfg: Config, env: DistEnv) -> bool:
    """The allocator's expandable segments if `cfg` needs them (whether they are now on). Segments made from then on
    grow in place: called again once "auto" is resolved, before the model's and the activations' allocations."""
    reason = expandable_segments_reason(cfg, os.environ)
    if reason is None:
        return False
    # torch.cuda.memory._set_allocator_settings is deprecated in favour of the accelerator-wide setter.
    set_allocator_settings = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                              or torch.cuda.memory._set_allocator_settings)
    try:
        set_allocator_settings("expandable_segments:True")
        if env.is_main:
            print(f"holotrain: CUDA allocator: expandable segments (for {reason}, against fragmentation; "
                  "PYTORCH_CUDA_ALLOC_CONF chooses otherwise)", flush=True)
        return True
    except RuntimeError as e:
        if env.is_main:
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"holotrain: warning: CUDA allocator: expandable segments not applied ({first_line}); set "
                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting", flush=True)
        return False


def _loop(cfg, env, model, optimizer, data, profiler, checkpointer, start_step, micro, accum, dtype,
          stop: StopSignals, dims: ParallelDims, evaluator=None) -> list[dict]:
    logger = profiler.logger(cfg.training.steps, start_step)
    if env.is_main:
        print(
            f"holotrain: {_whole_model_params(model) / 1e6:.1f}M parameters, world size {env.world_size}, device {env.device}, "
            f"{dtype}, batch {cfg.training.batch_size} x {cfg.data.seq_len} "
            f"(micro {micro}, accumulation {accum}), steps {start_step} -> {cfg.training.steps}, run dir {cfg.run_dir}"
        )
    train_step = TrainStep(model, optimizer, cfg, env, dtype, profiler.clock)
    # moe.* and the sigmoid router's bias update
    routing = Routing(model, cfg.model.router_bias_rate, env, dims)
    hardware = build_hardware(cfg.hw, env, cfg.run_dir)
    try:
        hardware.start()
        return _steps(cfg, env, data, train_step, profiler, checkpointer, hardware, logger, start_step, accum, stop,
                      dims, routing, evaluator)
    finally:
        routing.close()
        hardware.close()
        if logger is not None:
            logger.close()


def _whole_model_params(model: torch.nn.Module) -> int:
    """Every parameter of the model, those on other pipeline stages included."""
    return getattr(model, "whole_model_params", None) or num_params(model)


def _host_rss_gb() -> float | None:
    rss = process_rss_bytes()
    return None if rss is None else rss / 1e9


def _global_mean(value: torch.Tensor, env: DistEnv) -> float:
    if env.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value.item()


def _steps(cfg, env, data, train_step, profiler, checkpointer, hardware, logger, start_step, accum,
           stop: StopSignals, dims: ParallelDims, routing: Routing, evaluator=None) -> list[dict]:
    tokens_per_step = cfg.training.batch_size * cfg.data.seq_len
    args = model_args(cfg)
    # FLOPs for MFU: the linear layers' per token, and attention's from the documents the rows really hold (packed
    # documents attend only within themselves), 12 * n_layers * q_dim per (token, key) pair of the full square, as
    # flops_per_token counts one sequence. A tensor-, context- or pipeline-parallel group shares its rows.
    linear_per_step = flops_per_token(args, 0) * tokens_per_step / env.world_size
    attention_per_pair = 12 * args.n_layers * args.q_dim / dims.model_ranks
    pairs = torch.zeros((), dtype=torch.float64, device=env.device)  # this rank's, over the interval
    # The document-masked micro-batches' share of the causal triangle that flex_attention visits, summed over the
    # interval (the time model's attention density, plan/attention.py), and their count: read at log time only.
    visited = torch.zeros((), dtype=torch.float64, device=env.device)
    masked_count = 0
    peak = peak_bf16_flops(env.device)
    log_every = cfg.training.log_every
    rows: list[dict] = []
    optimizer = train_step.optimizer
    cuda = env.device.type == "cuda"

    loss_sum = torch.zeros((), device=env.device)
    # Steps skipped for a non-finite gradient norm (the optimizer leaves weights and state untouched), counted on
    # the device so that no step waits for the host; read at logged steps and before a save.
    nonfinite = torch.zeros((), dtype=torch.int64, device=env.device)  # since this process started
    nonfinite_run = torch.zeros((), dtype=torch.int64, device=env.device)  # consecutive, up to the last step
    nonfinite_logged = 0
    interval_start = time.perf_counter()
    interval_steps = 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(env.device)
    hardware.begin_interval()
    goodput = profiler.goodput
    goodput.steps_begin()
    first_interval = True
    stop.start_loop(env.world_size)

    for step in range(start_step, cfg.training.steps):
        done = step + 1
        lr = lr_at(step, cfg)
        profiler.before(done)
        micro_batches, waited = data.next(done)
        for batch in micro_batches:
            pairs += attention_pairs(batch[2], batch[0].shape)
            if batch[2] is not None:
                visited += block_density(batch[2])
                masked_count += 1
        profiler.add("data_wait", waited)
        goodput.data_wait_s += waited
        t_step = time.perf_counter()
        routing.begin_step()
        loss, grad_norm = train_step(micro_batches.__getitem__, accum, lr)
        routing.end_step()  # the sigmoid router's bias update
        if step == start_step:
            # The first step compiles and warms up: timed on its own (one synchronization) for the goodput account.
            if cuda:
                torch.cuda.synchronize(env.device)
            goodput.first_step_s = time.perf_counter() - t_step
            if env.is_main:  # a large model's first step can take minutes: say where the time went at once
                print(f"holotrain: step {done} took {goodput.first_step_s:.1f} s (compilation and warm-up)", flush=True)
            checkpointer.prepare(optimizer)  # the optimizer's state exists now
            profiler.first_step_done()
        profiler.after(done)
        loss_sum += loss
        interval_steps += 1
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        bad = (~torch.isfinite(grad_norm)).long()
        nonfinite += bad
        nonfinite_run.add_(bad).mul_(bad)

        scores = None
        if evaluator is not None and (done % cfg.eval.every == 0 or done == cfg.training.steps):
            scores = evaluator(train_step.model)  # eval.*: logged in this step's row
            interval_start += scores["time.eval"]  # not training time: the step rate leaves it out

        if done % log_every == 0 or done == cfg.training.steps or scores is not None:
            loss_value = _global_mean(loss_sum, env) / interval_steps
            gn = grad_norm.item()  # synchronizes the device: the interval's time is now complete
            elapsed = time.perf_counter() - interval_start
            hardware.mark(done)
            step_s = elapsed / interval_steps
            attention_per_step = _global_mean(pairs, env) * attention_per_pair / interval_steps
            flops_s = (linear_per_step + attention_per_step) / step_s
            if not first_interval:
                goodput.step_s.append(step_s)
            first_interval = False
            skipped_total = int(nonfinite.item())
            goodput.useful_tokens += (interval_steps - (skipped_total - nonfinite_logged)) * tokens_per_step
            row = {
                "step": done,
                "loss": loss_value,
                "lr": lr,
                "grad_norm": gn,
                "tokens_per_s": tokens_per_step / step_s,
                "tflops": flops_s / 1e12,
                "mfu": flops_s / peak if peak else None,
                "attention_flops_share": attention_per_step / (linear_per_step + attention_per_step),
                "attention_block_density": visited.item() / masked_count if masked_count else None,
                "step_s": step_s,
                # time.data_wait, time.forward, time.backward, time.optimizer (+ levers' own phases)
                **profiler.metrics(interval_steps),
                **checkpointer.metrics(interval_steps),  # time.checkpoint (blocking), checkpoint.write_s
                **optimizer.metrics(interval_steps),  # offload.* (memory.offload)
                "mem.peak_gb": torch.cuda.max_memory_allocated(env.device) / 1e9 if cuda else None,
                "mem.reserved_gb": torch.cuda.max_memory_reserved(env.device) / 1e9 if cuda else None,
                "mem.host_rss_gb": _host_rss_gb(),
                **hardware.metrics(interval_steps, tokens_per_step),  # energy.*, hw.*
                "wall_time": time.time(),
                "tokens": done * tokens_per_step,
                **data.metrics(interval_steps),  # data.*
                **pipeline_bubble(train_step.model, cfg.run_dir, done),  # pp.* (parallel.pp > 1)
                **routing.metrics(),  # moe.* (a mixture-of-experts model; collective)
                "train.nonfinite_steps": skipped_total,
                **(scores or {}),
            }
            if done == cfg.training.steps:  # the last row: goodput so far (RUN_DIR/goodput.json: after teardown)
                row.update(goodput.summary(checkpointer.blocking_total_s))
            row.update(profiler.stragglers(row, cfg.parallel.pp))  # collective: straggler.*, rank.* (rank 0's row)
            if logger is not None:
                logger.log(row)
                rows.append(row)
            skipped, run = row["train.nonfinite_steps"] - nonfinite_logged, int(nonfinite_run.item())
            nonfinite_logged = row["train.nonfinite_steps"]
            if skipped and env.is_main:
                print(f"holotrain: warning: {skipped} of the last {interval_steps} steps had a non-finite gradient "
                      "norm and were skipped (weights and optimizer state unchanged)", flush=True)
            if run >= cfg.training.max_nonfinite_steps:
                raise TrainingStopped(
                    f"{run} consecutive steps (up to step {done}) had a non-finite gradient norm "
                    f"(training.max_nonfinite_steps = {cfg.training.max_nonfinite_steps}); the last good checkpoint "
                    f"is kept in {cfg.run_dir / 'checkpoints'}. Lower training.lr or check the data."
                )
            loss_sum.zero_()
            pairs.zero_()
            visited.zero_()
            masked_count = 0
            interval_steps = 0
            interval_start = time.perf_counter()

        which = checkpointer.due(done)  # a disk checkpoint, an in-memory snapshot, or none
        signum = stop.requested()
        if signum and which is not checkpointer.disk:
            which = checkpointer.disk  # an interrupt's checkpoint: of this step, on disk
        if which is not None:
            if int(nonfinite_run.item()):
                # The weights are those of the last good step; a checkpoint now would only push good ones out.
                if env.is_main:
                    print(f"holotrain: warning: no checkpoint at step {done}: the last steps were skipped as "
                          "non-finite", flush=True)
            else:
                data_state = data.state(done)
                checkpointer.save(which, done, optimizer,
                                  extra_files={DATA_STATE: json.dumps(data_state)} if env.is_main else None)
                if which is checkpointer.disk and scores is not None and scores["eval.loss"] is not None:
                    checkpointer.consider_best(done, scores["eval.loss"])
        if signum:
            saved, in_time = checkpointer.wait_saved(done, cfg.checkpoint.interrupt_grace_s)
            if not in_time:  # the writer would hold the process past its grace period: leave without it
                print(f"holotrain: the checkpoint of step {done} was not written within checkpoint.interrupt_grace_s "
                      f"= {cfg.checkpoint.interrupt_grace_s:g} s; exiting without it", file=sys.stderr, flush=True)
                os._exit(128 + signum)
            raise Interrupted(signum, done, saved)
    goodput.steps_end()
    return rows
