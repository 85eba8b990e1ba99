"""`holotrain plan`: every candidate setting of the job predicted by the cost model, the ones that cannot fit pruned,
the best few tried for a few steps through `holotrain train` (each trial recalibrating the model before the next
is chosen), and the best measured written as an overlay, plan.toml, with every candidate in plan.json.

The candidates (one process, one GPU or the CPU): micro-batch (and so gradient accumulation), activation
checkpointing, loss chunking, memory.offload and its ratio, FP8 where the GPU has it, and compilation, on a GPU;
micro-batch and activation checkpointing on a CPU. With several processes also tensor parallelism's size and, from
CP_MIN_SEQ tokens a sequence, context parallelism's size and mode (ring, all-to-all), FSDP2 over the rest, and for a
mixture of experts (no tensor parallelism) the expert-parallel sizes that divide the data-parallel ranks and the
experts (plan/moe.py). The checkpoint interval is not a candidate: it follows from
the chosen setting's save cost and job.mtbf_hours (Young/Daly). Nor is data.workers: the plane starts loaders as
training needs them, up to that many; the plan raises the cap when a trial waited for data and the chosen setting
would need more loaders at the rate they were measured."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from holotrain.config import Config, ConfigError, batch_layout, load_config, parse_overrides, resolve
from holotrain.memory.activation_checkpointing import TILE_TOKENS, checkpointing_choices, segment_size
from holotrain.memory.plan import usable_cores
from holotrain.parallel.dims import ParallelDims
from holotrain.model import build
from holotrain.plan.cost import (
    COMM_PHASES,
    EFFICIENCY,
    LINK_BYTES_S,
    Calibration,
    Machine,
    Prediction,
    describe,
    fit_compute,
    gpu_seconds,
    host_factor,
    predict,
    with_settings,
    young_daly_steps,
)
from holotrain.plan.moe import expert_parallel_sizes
from holotrain.plan.trials import Measured, run_trial
from holotrain.train.resolve import model_args

OVERLAY_KEYS = ("training", "memory", "parallel", "checkpoint", "data")  # the sections a plan sets


@dataclass
class Candidate:
    settings: dict  # "section.key" -> value
    micro: int  # per rank
    accum: int
    ranks: int = 1
    predicted: Prediction | None = None
    predicted_at_trial: dict | None = None  # the prediction when it was chosen for a trial, before its measurement
    measured: Measured | None = None
    trial: int | None = None  # its trial's number (1 first), when it was tried

    @property
    def label(self) -> str:
        s = self.settings
        blocks = s.get("memory.activation_checkpointing_blocks", 0)
        parts = [f"micro {self.micro}x{self.accum}",
                 f"ac {s['memory.activation_checkpointing']}" + (f" on {blocks} blocks" if blocks else "")]
        if self.ranks > 1:
            tp, cp = s["parallel.tp"], s.get("parallel.cp", 1)
            parts.insert(0, f"tp {tp}" + (f" ({s['parallel.tp_overlap']})" if tp > 1 else "")
                         + (f" x cp {cp} ({s['parallel.cp_mode']})" if cp > 1 else "")
                         + f" x dp {ParallelDims(world=self.ranks, cp=cp, tp=tp).dp}"
                         + (f" x ep {s['parallel.ep']}" if s.get("parallel.ep", 1) > 1 else ""))
        if s.get("memory.offload"):
            parts.append(f"offload {s['memory.offload_ratio']:g}")
        if s.get("memory.activation_offload_blocks"):
            parts.append(f"activations of {s['memory.activation_offload_blocks']} blocks on the host")
        if s.get("memory.ffn_tiles", 1) > 1:
            parts.append(f"feed-forward in {s['memory.ffn_tiles']} tiles")
        if s.get("memory.activation_checkpointing_segment", 1) > 1:
            parts.append(f"inputs of every {s['memory.activation_checkpointing_segment']}th block kept")
        if s.get("training.fp8", "none") != "none":
            parts.append("fp8")
        if s.get("memory.loss_chunk_tokens"):
            parts.append(f"chunk {s['memory.loss_chunk_tokens']}")
        parts.append("compiled" if s.get("training.compile") else "eager")
        return ", ".join(parts)


def job_config(config: str | None, overrides: list[str]) -> Config:
    """The job resolved as far as the cost model needs, without building the corpus: the vocabulary of a tokenizer
    still to be trained is taken as data.vocab_size (a pretrained model's, model.init_from, is its own)."""
    cfg = load_config(config, overrides)
    return resolve(cfg, tokenizer_vocab=None if cfg.model.vocab_size or cfg.model.init_from else cfg.data.vocab_size)


def plan_device(cfg: Config) -> torch.device:
    """The device the job would train on here (this process's GPU, by index, or the CPU)."""
    if cfg.job.device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def job_signature(cfg: Config, ranks: int = 1) -> str:
    """What a plan belongs to: the model's shape, the sequence length, the batch and the ranks."""
    m = cfg.model
    return (f"dim {m.dim}, {m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} heads, ffn {m.ffn_dim}, vocab "
            f"{m.vocab_size}" + (f", {m.n_experts} experts top-{m.n_active_experts} ffn {m.moe_ffn_dim}"
                                 if m.n_experts else "") + f", seq {cfg.data.seq_len}, batch {cfg.training.batch_size}"
            + (f", {ranks} ranks" if ranks > 1 else ""))


def _tp_sizes(cfg: Config, ranks: int) -> list[int]:
    """Tensor-parallel sizes that divide the ranks and every dimension tensor parallelism splits (1 alone for a
    mixture of experts, which tensor parallelism does not split yet)."""
    m = cfg.model
    return [tp for tp in range(1, ranks + 1) if ParallelDims.fits(ranks, tp=tp) and (tp == 1 or not m.n_experts)
            and all(x % tp == 0 for x in (m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size, cfg.data.seq_len))]


# The settings a plan chooses (a candidate's keys).
PLANNED_KEYS = ("training.micro_batch_size", "memory.activation_checkpointing",
                "memory.activation_checkpointing_blocks", "memory.offload", "memory.offload_ratio", "training.compile",
                "memory.loss_chunk_tokens", "training.fp8", "parallel.tp", "parallel.tp_overlap",
                "memory.activation_offload_blocks", "memory.ffn_tiles", "memory.activation_checkpointing_segment",
                "parallel.cp", "parallel.cp_mode", "parallel.ep")


def held_settings(cfg: Config, overrides: list[str]) -> dict:
    """The settings a plan chooses that the command line sets: the plan keeps them and chooses the rest (`holotrain
    plan --config 1.4b --memory.offload=true` chooses the offload ratio). "auto", and a micro-batch of 0, are left
    to the plan."""
    held = {}
    for section, key, _ in parse_overrides(overrides):
        name = f"{section}.{key}"
        value = getattr(getattr(cfg, section), key, None)
        if name in PLANNED_KEYS and value != "auto" and not (name == "training.micro_batch_size" and value == 0):
            held[name] = value
    return held


def _keeps(c: Candidate, held: dict) -> bool:
    # An offload ratio is held for the candidates that offload.
    return all(c.settings.get(k, v) == v for k, v in held.items()
               if k != "memory.offload_ratio" or c.settings.get("memory.offload"))


# Context parallelism is a candidate from this sequence length on, with several ranks (and where the config has it).
CP_MIN_SEQ = 8192


def _cp_layouts(cfg: Config, ranks: int, tp: int) -> list[tuple[int, str]]:
    """(cp, cp_mode) for a tensor-parallel size: 1 always; with several ranks and a long sequence, every cp > 1 that
    divides the ranks left by TP and splits the sequence into 2 x cp x tp equal chunks, with the ring, and with the
    all-to-all where a rank's heads and kv heads divide by cp."""
    out = [(1, "auto")]
    if ranks == 1 or cfg.data.seq_len < CP_MIN_SEQ or not hasattr(cfg.parallel, "cp"):
        return out
    m = cfg.model
    for cp in range(2, ranks + 1):
        if not ParallelDims.fits(ranks, cp=cp, tp=tp) or cfg.data.seq_len % (2 * cp * tp):
            continue
        out.append((cp, "ring"))
        if (m.n_heads // tp) % cp == 0 and (m.n_kv_heads // tp) % cp == 0:
            out.append((cp, "alltoall"))
    return out


MAX_MICRO = 128  # the largest micro-batch tried; every divisor of the batch up to it is one (12: 1, 2, 3, 4, 6, 12)


def enumerate_candidates(cfg: Config, machine: Machine, ranks: int = 1) -> list[Candidate]:
    t = cfg.training
    gpu = machine.device == "cuda"
    offloads = [(False, 1.0)] + ([(True, r) for r in (0.25, 0.5, 0.75, 1.0)] if gpu else [])
    # The delayed update changes the optimization, so only a job that sets it plans it; it implies offload, and on
    # one process one micro-batch per step.
    delayed = cfg.memory.offload_delayed_update
    if delayed:
        offloads = [(True, r) for r in (0.25, 0.5, 0.75, 1.0)]
    # FP8's recipes: delayed (faster, and more memory: its FP8 transposes) where there is no tensor parallelism,
    # tensorwise, and rowwise if the job names it (its time counted as tensorwise's).
    fp8s = ["none"] + (["delayed", "tensorwise"] if gpu and machine.fp8 else [])
    if gpu and machine.fp8 and t.fp8 == "rowwise":
        fp8s.append(t.fp8)
    compiles = [True, False] if gpu else [t.compile]
    # Activation offload of the first blocks, on a GPU, where the PCIe link is not the optimizer offload's: an eighth
    # or a quarter of them without activation checkpointing (all they save), up to every block with "full" (only
    # their inputs: the long-sequence lever, with the feed-forwards tiled over the sequence or not).
    n = cfg.model.n_layers
    light = {n // 8, n // 4} - {0}
    moved = [0] + (sorted(light | {n // 2, 3 * n // 4, n}) if gpu else [])
    # Expert parallelism (a mixture of experts) only without tensor and context parallelism (parallel/config.py).
    args = model_args(cfg)
    layouts = [(1, "none", 1, "auto", 1)] if ranks == 1 else [
        (tp, overlap, cp, mode, ep) for tp in _tp_sizes(cfg, ranks)
        for overlap in (("none", "fused") if gpu and tp > 1 else ("none",)) for cp, mode in _cp_layouts(cfg, ranks, tp)
        for ep in (expert_parallel_sizes(args, ParallelDims(world=ranks, cp=cp, tp=tp).dp) if tp == cp == 1 else [1])]
    out = []
    for (tp, overlap, cp, mode, ep), (ac, blocks), (offload, ratio), fp8, compiled, chunk, act_off in itertools.product(
            layouts, checkpointing_choices(cfg.model.n_layers), offloads, fp8s, compiles, (0, 8192), moved):
        if chunk and (ac != "none" or tp > 1):
            continue  # chunked already under activation checkpointing (auto); TP's vocabulary-parallel loss never is
        whole = ac == "full" and not blocks
        if act_off and (offload or tp > 1 or cp > 1 or not (whole or (ac == "none" and act_off in light))):
            continue
        if tp > 1 and (offload or fp8 == "delayed" or (fp8 != "none" and overlap != "none")):
            continue  # combinations the trainer refuses (config.validate)
        if (cp > 1 or ep > 1) and offload:
            continue
        dp = ParallelDims(world=ranks, cp=cp, tp=tp).dp
        if t.batch_size % dp:
            continue
        per_rank = t.batch_size // dp
        tiles = [1] + ([math.ceil(cfg.data.seq_len / cp / TILE_TOKENS)] if whole and tp == 1 and gpu
                       and cfg.data.seq_len / cp > TILE_TOKENS else [])
        # Recompute segments with tiled feed-forwards and no block inputs on the host (as the trainer's "auto").
        segments = [1] + ([segment_size(n)] if len(tiles) > 1 and not act_off and cp == 1 else [])
        for micro, tile, segment in ((m, k, g) for m in range(1, min(per_rank, MAX_MICRO) + 1) if per_rank % m == 0
                                     for k in tiles for g in segments if g == 1 or k > 1):
            if chunk and micro * cfg.data.seq_len // cp <= chunk:
                continue  # a micro-batch of one piece: the same step as the unchunked loss
            if delayed and dp == 1 and micro != per_rank:
                continue
            settings = {"training.micro_batch_size": micro, "memory.activation_checkpointing": ac,
                        "memory.activation_checkpointing_blocks": blocks, "memory.offload": offload,
                        "memory.offload_ratio": ratio, "training.compile": compiled, "memory.loss_chunk_tokens": chunk,
                        "memory.activation_offload_blocks": act_off, "memory.ffn_tiles": tile,
                        "memory.activation_checkpointing_segment": segment}
            if gpu:
                settings["training.fp8"] = fp8
            if ranks > 1:
                settings.update({"parallel.tp": tp, "parallel.tp_overlap": overlap})
                if hasattr(cfg.parallel, "cp"):
                    settings.update({"parallel.cp": cp, "parallel.cp_mode": mode})
                if args.n_experts:
                    settings["parallel.ep"] = ep
            out.append(Candidate(settings, micro, per_rank // micro, ranks))
    return out


def _objective(cfg: Config):
    if cfg.plan.objective == "j_per_token":
        return lambda p: -(p.j_per_token if p.j_per_token is not None else float("inf"))
    return lambda p: p.tokens_per_s


def _measured_score(cfg: Config, m: Measured) -> float:
    if cfg.plan.objective == "j_per_token":
        return -(m.j_per_token if m.j_per_token is not None else float("inf"))
    return m.tokens_per_s or 0.0


def _others(p: Prediction, *skip: str) -> float:
    """The predicted seconds of the phases other than `skip` and the wait for data (measured apart)."""
    return sum(v for k, v in p.phases.items() if k not in skip and k != "data")


def calibrate(calib: Calibration, c: Candidate, machine: Machine, repredict) -> None:
    """Folds a trial's measurements into the calibration. With offload: the CPU AdamW rate from its CPU step, and
    how much of that step was exposed against the model's overlap rule (its step time less the other phases as
    predicted). Without: the GEMM efficiency and the host's seconds per micro-batch of its (device, compiled),
    fitted over all its trials with attention's seconds apart (cost.fit_compute), or FP8's gain where bf16 trials
    measured the efficiency already and the trial's GPU work outlasts its host time, or, where attention outlasts
    the GEMMs (a long sequence), the attention kernels' rate (Calibration.attention_scale)."""
    m = c.measured
    if m.step_s is None:
        return
    step_s = m.step_s - (m.data_wait_s or 0.0)  # the step without its wait for data: what the other terms took
    if m.data_wait_s and m.data_wait_s > 0.02 * m.step_s and m.loaders:
        # The plane set the pace: its loaders made the step's tokens in the step's time.
        calib.loader_tokens_s = c.predicted.tokens_per_step / m.step_s / m.loaders
    if c.predicted.offloaded:
        if m.cpu_step_s:
            calib.adamw_params_s = c.predicted.offloaded / m.cpu_step_s
        p = repredict(c)
        modeled = p.phases.get("offload", 0.0) / (calib.offload_scale or 1.0)
        exposed = step_s - _others(p, "offload")
        if modeled > 0:
            calib.offload_scale = max(0.0, exposed) / modeled
        return
    p = repredict(c)
    key = (machine.device, bool(c.settings.get("training.compile")))
    comm = sum(p.phases.get(k, 0.0) for k in COMM_PHASES)
    if comm > 0 and key in calib.efficiency:
        # Compute known from one process: the rest is the collectives, at the rate they really ran.
        exposed = step_s - _others(p, *COMM_PHASES)
        if exposed > 0:
            calib.link_bytes_s = (calib.link_bytes_s or LINK_BYTES_S[machine.device]) * comm / exposed
        return
    fp8 = c.settings.get("training.fp8", "none")
    # What the GPU's work and the issuing of its micro-batches took: the step less the other phases.
    measured = step_s - _others(p, "compute", "micro")
    if measured <= 0:
        return
    host = p.host_s * host_factor(fp8)
    gpu = gpu_seconds(measured / c.accum, host, machine.device) * c.accum  # the GPU's seconds of the step
    if p.attention_total_s > p.gemm_total_s:
        # Attention sets this trial's pace (a long sequence): it measures the attention kernels' rate, the GEMMs
        # taken at their efficiency as calibrated so far.
        if gpu > p.gemm_total_s:
            calib.attention_scale = (calib.attention_scale or 1.0) * (gpu - p.gemm_total_s) / p.attention_total_s
        return
    # bf16 trials set the efficiency: an FP8 one measures FP8's gain, where its GPU work, not the host, sets its pace.
    bf16_fitted = any(obs[3] == 1.0 for obs in calib.steps.get(key, []))
    if fp8 != "none" and bf16_fitted and gpu / c.accum >= host and gpu > p.attention_total_s:
        calib.fp8_gain = (calib.fp8_gain or 1.0) * p.gemm_total_s / (gpu - p.attention_total_s)
        return
    # The step's GEMM seconds at the full GEMM rate (FP8's over its gain, before any bf16 trial); attention apart, at
    # its predicted seconds, unless those leave the GEMMs under half the time the trial's overall ratio gives them:
    # then the attention prior is off too, and is scaled by that ratio first.
    attention = p.attention_total_s
    ratio = gpu / (p.gemm_total_s + attention)
    if attention and gpu - attention < 0.5 * ratio * p.gemm_total_s:
        calib.attention_scale = (calib.attention_scale or 1.0) * ratio
        attention *= ratio
    work = p.gemm_total_s * calib.efficiency.get(key, EFFICIENCY[key])
    fit_compute(calib, key, work, c.accum, measured, host_factor(fp8), p.host_s, attention + p.routing_s)


@dataclass
class PlanResult:
    chosen: Candidate
    candidates: list[Candidate]
    checkpoint_every: int
    blocking_s: float
    machine: Machine
    signature: str
    seconds: float
    calibration: Calibration | None = None  # what the trials measured
    data_workers: int | None = None  # data.workers raised: the loaders the chosen setting needs


def prepare(config: str | None, overrides: list[str], machine: Machine | None = None,
            fp8_gain: float | None = None):
    """What predicting the job takes: (its resolved config, its model on the meta device, this machine's rates
    (measured, or cached), the calibration before any trial: FP8's gain from the GEMM probe where there is FP8, or
    as given)."""
    cfg = job_config(config, overrides)
    device = plan_device(cfg)
    if machine is None:
        from holotrain.data.corpus import cache_dir
        from holotrain.plan.machine import measure_machine

        machine = measure_machine(device, cfg.hw.gpu_memory_gb, cache_dir(cfg.data.cache_dir))
    with torch.device("meta"):
        model = build(model_args(cfg))
    calib = Calibration(fp8_gain=fp8_gain)
    if fp8_gain is None and machine.device == "cuda" and machine.fp8:
        from holotrain.precision.lever import fp8_shapes
        from holotrain.precision.probe import predict as fp8_predict

        micro, _ = batch_layout(cfg, 1)
        rows = fp8_predict(fp8_shapes(model, cfg.training.fp8_skip), micro * cfg.data.seq_len, device)
        bf16 = sum(r["bf16_s"] * r["layers"] for r in rows)
        calib.fp8_gain = bf16 / max(1e-9, sum((r["fp8_s"] + r["cast_s"]) * r["layers"] for r in rows))
    return cfg, model, machine, calib


def make_plan(config: str | None, overrides: list[str], out_dir: Path, machine: Machine | None = None,
              log=print, ranks: int = 1) -> PlanResult:
    """Plans the job for `ranks` processes of this machine (one GPU each) and writes out_dir/plan.toml and
    out_dir/plan.json."""
    t0 = time.perf_counter()
    cfg, model, machine, calib = prepare(config, overrides, machine)
    candidates = enumerate_candidates(cfg, machine, ranks)
    if not candidates:
        raise ConfigError(f"training.batch_size = {cfg.training.batch_size} does not split over {ranks} ranks")
    held = held_settings(cfg, overrides)
    candidates = [c for c in candidates if _keeps(c, held)]
    given = ", ".join(f"{k}={v}" for k, v in held.items())
    if not candidates:
        raise ConfigError(f"no setting of this job keeps {given} on this machine ({machine.name}): leave one of them "
                          "to the plan")
    if held:
        log(f"holotrain: plan: keeps {given} (given on the command line) and chooses the rest")
    score = _objective(cfg)

    def repredict(c: Candidate) -> Prediction:
        return predict(model, with_settings(cfg, c.settings), machine, calib, c.micro, c.accum, c.ranks)

    def predict_all():
        for c in candidates:
            c.predicted = repredict(c)

    predict_all()
    fitting = [c for c in candidates if c.predicted.fits]
    if not fitting:
        raise ConfigError(_nothing_fits(cfg, candidates, ranks))
    tried: list[Candidate] = []
    last_trial_s = 0.0
    for i in range(cfg.plan.trials):
        left = [c for c in fitting if c.measured is None]
        if not left:
            break
        if tried and time.perf_counter() - t0 + last_trial_s > cfg.plan.seconds:
            log(f"holotrain: plan: {i} of {cfg.plan.trials} trials: another would pass plan.seconds = "
                f"{cfg.plan.seconds:g}")
            break
        started = time.perf_counter()
        best = max(left, key=lambda c: score(c.predicted))
        best.predicted_at_trial, best.trial = prediction_dict(best.predicted), i + 1
        log(f"holotrain: plan: trial {i + 1}/{cfg.plan.trials}: {best.label} (predicted "
            f"{best.predicted.tokens_per_s:,.0f} tokens/s)")
        best.measured = run_trial(config, overrides, best.settings, cfg.plan.trial_steps,
                                  out_dir / f"trial-{i + 1}", timeout_s=600, ranks=ranks)
        last_trial_s = time.perf_counter() - started
        tried.append(best)
        if best.measured.error:
            log(f"holotrain: plan: trial {i + 1} failed: {best.measured.error}")
            continue
        calibrate(calib, best, machine, repredict)
        predict_all()
    ran = [c for c in tried if not c.measured.error]
    failed = [c for c in tried if c.measured.error]
    if ran:
        chosen = max(ran, key=lambda c: _measured_score(cfg, c.measured))
    elif len(failed) < len(fitting):
        # A setting whose trial failed (out of memory, say) is not chosen on its prediction.
        chosen = max((c for c in fitting if c not in failed), key=lambda c: score(c.predicted))
    else:
        raise ConfigError(f"every trial failed; the last: {failed[-1].label}: {failed[-1].measured.error}")
    blocking = chosen.predicted.save_s
    step_s = chosen.measured.step_s if chosen.measured and chosen.measured.step_s else chosen.predicted.step_s
    every = young_daly_steps(blocking, cfg.job.mtbf_hours, step_s)
    result = PlanResult(chosen, candidates, every, blocking, machine, job_signature(cfg, ranks),
                        time.perf_counter() - t0, calib, loaders_needed(cfg, chosen.predicted, calib))
    write_plan(result, cfg, out_dir)
    return result


def loaders_needed(cfg: Config, p: Prediction, calib: Calibration, cores: int | None = None) -> int | None:
    """More loaders than data.workers when the setting would wait for data at the measured rate per loader (at
    most one per core of this machine), else None."""
    if not calib.loader_tokens_s or p.phases.get("data", 0.0) <= 0:
        return None
    if cores is None:
        cores = usable_cores()
    busy = p.step_s - p.phases["data"]
    need = min(math.ceil(p.tokens_per_step / (calib.loader_tokens_s * busy) - 1e-9), cores)
    return need if need > cfg.data.workers else None


def _nothing_fits(cfg: Config, candidates: list[Candidate], ranks: int) -> str:
    def need(c):
        p = c.predicted
        return (p.gpu_bytes if p.gpu_bytes is not None else p.host_bytes)

    closest = min(candidates, key=need)
    return (f"nothing fits: of {len(candidates)} settings of this job ({job_signature(cfg, ranks)}), the smallest "
            f"needs {need(closest) / 1e9:.1f} GB per rank ({closest.label}: {closest.predicted.why_not}). Use a "
            "smaller training.batch_size or model, more GPUs (holotrain plan --nproc N), or a machine with more "
            "memory (hw.gpu_memory_gb caps it)")


def prediction_dict(p: Prediction) -> dict:
    return {"step_s": p.step_s, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu, "j_per_token": p.j_per_token,
            "gpu_gb": None if p.gpu_bytes is None else p.gpu_bytes / 1e9, "host_gb": p.host_bytes / 1e9,
            "phases_s": dict(p.phases), "parts_s": p.parts, "fits": p.fits, "why_not": p.why_not,
            "memory_gb": {k: v / 1e9 for k, v in p.memory.items()},
            "activations_gb": {k: v / 1e9 for k, v in p.activations.items()}, "moe": p.moe.as_dict() if p.moe else None}


def _overlay(result: PlanResult) -> dict:
    out: dict = {}
    for name, value in result.chosen.settings.items():
        section, key = name.split(".")
        out.setdefault(section, {})[key] = value
    out.setdefault("checkpoint", {})["every"] = result.checkpoint_every
    if result.data_workers:
        out["data"] = {"workers": result.data_workers}
    return out


def write_plan(result: PlanResult, cfg: Config, out_dir: Path) -> None:
    import tomli_w

    out_dir.mkdir(parents=True, exist_ok=True)
    c = result.chosen
    planned = {"machine": result.machine.fingerprint, "job": result.signature, "objective": cfg.plan.objective,
               "predicted_tokens_per_s": round(c.predicted.tokens_per_s, 1),
               "checkpoint_interval": f"Young/Daly: {result.blocking_s:.3f} s per save, job.mtbf_hours = "
                                      f"{cfg.job.mtbf_hours:g}"}
    if c.measured and c.measured.tokens_per_s:
        planned["measured_tokens_per_s"] = round(c.measured.tokens_per_s, 1)
    doc = {"planned": planned, **_overlay(result)}
    (out_dir / "plan.toml").write_text("# holotrain plan: an overlay for `holotrain train --plan plan.toml`\n"
                                       + tomli_w.dumps(doc))
    rows = []
    for cand in sorted(result.candidates, key=lambda x: -x.predicted.tokens_per_s):
        rows.append({"label": cand.label, "settings": cand.settings, "micro": cand.micro, "accum": cand.accum,
                     "predicted": prediction_dict(cand.predicted),
                     "trial": cand.trial, "predicted_at_trial": cand.predicted_at_trial,
                     "measured": dataclasses.asdict(cand.measured) if cand.measured else None,
                     "chosen": cand is c})
    (out_dir / "plan.json").write_text(json.dumps({
        "planned": planned, "overlay": _overlay(result), "machine": dataclasses.asdict(result.machine),
        "seconds": round(result.seconds, 1), "calibration": _calibration_dict(result.calibration),
        "moe": c.predicted.moe.as_dict() if c.predicted.moe else None, "candidates": rows}, indent=1))


def _calibration_dict(calib: Calibration | None) -> dict | None:
    if calib is None:
        return None
    out = dataclasses.asdict(calib)
    for name in ("efficiency", "micro_s", "steps"):
        out[name] = {f"{device}, {'compiled' if compiled else 'eager'}": v
                     for (device, compiled), v in getattr(calib, name).items()}
    return out


def print_table(result: PlanResult, limit: int = 12) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"holotrain plan: {result.signature} on {result.machine.name}")
    for col in ("setting", "fits", "pred. tokens/s", "pred. step s", "pred. GB", "meas. tokens/s", "meas. GB"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    fitting = sorted((c for c in result.candidates if c.predicted.fits), key=lambda c: -c.predicted.tokens_per_s)
    shown = [c for c in result.candidates if c.measured] + [c for c in fitting if not c.measured][:limit]
    for c in shown:
        p, m = c.predicted, c.measured
        gb = p.gpu_bytes if p.gpu_bytes is not None else p.host_bytes
        table.add_row(("* " if c is result.chosen else "  ") + c.label, "yes" if p.fits else "no",
                      f"{p.tokens_per_s:,.0f}", f"{p.step_s:.3f}", f"{gb / 1e9:.1f}",
                      f"{m.tokens_per_s:,.0f}" if m and m.tokens_per_s else (m.error[:30] if m else ""),
                      f"{m.peak_gb:.1f}" if m and m.peak_gb else "")
    console = Console()
    if not console.is_terminal:  # a log file: no wrapping of the settings column
        console = Console(width=150)
    console.print(table)
    loaders = (f"; data.workers = {result.data_workers} (the trials waited for data)" if result.data_workers
               else "")
    console.print(f"chosen: {result.chosen.label}; checkpoint.every = {result.checkpoint_every} (Young/Daly, "
                  f"{result.blocking_s:.3f} s per save){loaders}; planned in {result.seconds:.0f} s")
    for line in describe(result.chosen.predicted):
        console.print(f"predicted for it: {line}", soft_wrap=True)


# --------------------------------------------------------------------------------------------------------
# Taking a plan


def read_overlay(path: Path) -> tuple[dict, dict]:
    """(the [planned] facts, the overlay's sections) of a plan.toml."""
    import tomllib

    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--plan {path}: cannot read it ({e})") from None
    planned = doc.pop("planned", None)
    if not isinstance(planned, dict) or "machine" not in planned or "job" not in planned:
        raise ConfigError(f"--plan {path}: not a holotrain plan (no [planned] machine and job)")
    unknown = [s for s in doc if s not in OVERLAY_KEYS]
    if unknown:
        raise ConfigError(f"--plan {path}: a plan sets only {', '.join(OVERLAY_KEYS)}, not {', '.join(unknown)}")
    return planned, doc


def plan_overrides(path: Path, config: str | None, overrides: list[str], machine_fingerprint: str) -> list[str]:
    """The plan's settings as overrides to put between the job's config and its command line; a plan made for
    another machine or another job is refused in one line."""
    from holotrain.plan.trials import as_override

    planned, sections = read_overlay(path)
    cfg = job_config(config, overrides)
    here = job_signature(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if planned["job"] != here:
        raise ConfigError(f"--plan {path} was made for another job ({planned['job']}); this one is {here}. Plan it "
                          "again: holotrain plan (--nproc N for N processes)")
    if planned["machine"] != machine_fingerprint:
        raise ConfigError(f"--plan {path} was made on another machine ({planned['machine']}); this one is "
                          f"{machine_fingerprint}. Plan it again: holotrain plan")
    return [as_override(f"{s}.{k}", v) for s, kv in sections.items() for k, v in kv.items()]
