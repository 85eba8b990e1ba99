"""The cost model: for one candidate setting of a job, the peak GPU and host memory, the step time split by phase,
tokens/s, MFU and J/token, from the model's shapes and this machine's measured rates. Each lever states its own
terms; this module sums them.

Memory is the memory plan's (memory/plan.py: weights, gradients, optimizer state, activations with FP8's share,
pinned buffers, at the step's peak moment). Time is summed from phases:

  compute     the GPU's work (Prediction.parts splits it): the linear layers' GEMMs at this machine's measured GEMM
              rate times an efficiency that trials calibrate (the rest of a step beside them: norms, launches),
              divided by FP8's measured gain (precision/lever.py: matmul_time); attention's T x T products as the
              kernels do them, causal and masked per document, at the attention kernels' own rate
              (plan/attention.py); and what activation checkpointing recomputes of both
              (memory/activation_checkpointing.py: recompute_share; the recomputed blocks' attention forward)
  micro       what issuing the micro-batches adds: on a GPU the host issues one micro-batch's kernels while the
              GPU runs the one before (a smooth maximum of the two, micro_time), on a CPU a fixed cost each; the
              host's time is fitted with the efficiency once two trials' micro-batch counts are 4x apart
              (fit_compute)
  offload     the CPU step's exposed part by the engine's overlap rule (memory/offload/cost.py), its measured
              share calibrated by trials
  optimizer   on a GPU, the device AdamW step of the parameters it updates (memory-bound; measured on an H200)
  tp, fsdp    with several ranks: tensor parallelism's exposed collectives and FSDP2's unhidden part, the bytes
              from parallel/cost.py at the node's link rate (calibrated by trials)
  ep          a mixture of experts under expert parallelism: the all-to-alls' exposed part (plan/moe.py); the experts'
              grouped GEMMs are in compute's linear GEMMs at their efficiency, and the routing's memory traffic in
              compute too (Prediction.routing_s), all at the active parameters' FLOPs
  cp          context parallelism's exposed communication: the ring's hops beyond the attention that hides them, or
              the all-to-alls (plan/attention.py)
  checkpoint  a save's blocking time (train/checkpointer.py: save_blocking_s), spread over the save interval
  data        the wait for the data plane where its loaders (data.workers of them at most) cannot keep up, at the
              tokens/s per loader a trial measured when it waited; none before one did

Calibration: each trial's measured step time (and CPU step, with offload) rescales the term it depends on (the GEMM
efficiency, or the attention rate where attention outlasts the GEMMs), so the candidates not tried are predicted
with what the tried ones measured."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from holotrain.memory.activation_checkpointing import (checkpointed_blocks, pointwise_blocks, recompute_share,
                                                       recomputed_blocks, segment_recompute_share)
from holotrain.memory.activation_offload import OUT_BYTES_S, exposed_copy_s
from holotrain.memory.offload.cost import ADAMW_IN_TRAINING, exposed_cpu_step
from holotrain.memory.plan import (
    GPU_USABLE,
    OFFLOADED_ACTIVATIONS,
    Plan,
    cp_mode,
    cp_size,
    ep_size,
    gpu_usable_share,
    grouped_gemms_kept,
    plan_memory,
)
from holotrain.parallel.dims import ParallelDims
from holotrain.model.costs import ATTENTION_FORWARD_SHARE, expert_flops_per_token, expert_params, flops_per_token
from holotrain.plan.attention import ATTENTION_SHARE, attention_seconds, cp_exposed_seconds
from holotrain.plan.moe import describe_moe, moe_terms
from holotrain.parallel.cost import fsdp_ep_bytes_per_step, tp_activation_share, tp_bytes_per_step
from holotrain.precision.lever import FP8_HOST, matmul_time
from holotrain.train.checkpointer import save_blocking_s
from holotrain.train.resolve import model_args

# Priors until a trial measures them. The GEMM efficiency: the share of the machine's GEMM rate the linear layers'
# GEMMs reach in a step, with what runs beside them (norms, rotary, launches); attention and the optimizer's step are
# terms of their own. Compiled, it keeps the 1.4b's step on an H200 (B=8, T=2048: 0.27 s, of which about 29 ms of
# attention and 13 ms of AdamW) where the model that counted all of it at 0.84 of the GEMM rate had it; eager steps
# launch more, smaller kernels.
EFFICIENCY = {("cuda", True): 0.86, ("cuda", False): 0.70, ("cpu", True): 0.5, ("cpu", False): 0.5}
# The device AdamW's seconds per parameter on an H200: the 1.4b's (1.364B parameters) fused step took 12.9 ms, with
# memory.adamw_moments = "bf16" 7.0 ms (bench/RESULTS.md); it is bound by memory bandwidth, about 28 and 20 bytes a
# parameter. On a CPU it is left in the compute's efficiency.
DEVICE_ADAMW_S_PER_PARAM = {"fp32": 12.9e-3 / 1.364e9, "bf16": 7.0e-3 / 1.364e9}
COMM_PHASES = ("tp", "fsdp", "cp", "ep")  # the phases of collectives between ranks
# The host's seconds to issue one micro-batch's kernels, per block: on an H200, compiled, 2.3 ms with the 125m and
# with the 1.4b alike, at micro-batches small enough for it to set the pace (bench/RESULTS.md); eager issues several
# times more (not measured). A GPU runs one micro-batch while the host issues the next, so a micro-batch takes about
# the larger of the two (micro_time); on a CPU the same cores do both, and a micro-batch adds MICRO_S.
HOST_S_PER_BLOCK = {("cuda", True): 2.3e-3, ("cuda", False): 7e-3}
MICRO_S = {"cpu": 0.002}
_OVERLAP_P = 2.5  # the smooth maximum's exponent: fitted to the 1.4b at micro-batches 1-8 on an H200
# Bytes per second a rank moves in collectives between the ranks of one node: NVLink on H100/H200 (the all-gather
# bus bandwidth measured on the H200s: 222 GB/s); gloo over loopback on a CPU. Trials calibrate it.
LINK_BYTES_S = {"cuda": 222e9, "cpu": 1e9}


@dataclass
class Machine:
    """What the cost model needs of this machine, measured (hw/probe.py, cached) or read from the device."""

    device: str  # "cuda" | "cpu"
    name: str  # the GPU's name, or the CPU model
    gpu_total: float | None  # bytes of the GPU, or hw.gpu_memory_gb when set; None without a GPU
    gpu_memory: float | None  # bytes a run may use of it now (free, less the allocator's losses)
    host_memory: float  # bytes of host RAM available
    gemm_flops: float  # sustained dense GEMM FLOP/s (bf16 on a GPU, fp32 on a CPU) at large shapes
    peak_flops: float | None  # the bf16 peak that MFU is quoted against
    adamw_params_s: float  # CPU AdamW, parameters per second (the offload engine's step)
    host_copy_bytes_s: float  # a host-to-host copy (a save of host-resident state, on a CPU)
    power_w: float | None  # the GPU's power limit: J/token when the run draws it
    fp8: bool  # FP8 matmuls available (sm_89+)
    runtime_bytes: float = 0.0  # host memory a training process holds before its model (torch, CUDA context)
    attention_flops: float = 0.0  # a causal SDPA's forward + backward FLOP/s at a long sequence (0: not measured)

    @property
    def attention_rate(self) -> float:
        """The dense causal attention kernel's FLOP/s: measured, or ATTENTION_SHARE of the GEMM rate."""
        return self.attention_flops or ATTENTION_SHARE[self.device] * self.gemm_flops

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.device, self.name, self.gpu_total)


def fingerprint(device: str, name: str, gpu_total: float | None) -> str:
    """What a plan is only valid on: the device's name and the GPU memory a run may use, to the GB."""
    mem = f"{gpu_total / 1e9:.0f}GB" if gpu_total else "cpu"
    return f"{device}:{name}:{mem}"


@dataclass
class Calibration:
    """What trials measured, as corrections of the priors."""

    efficiency: dict = field(default_factory=dict)  # (device, compiled) -> measured GEMM efficiency
    micro_s: dict = field(default_factory=dict)  # (device, compiled) -> measured host seconds per micro-batch (bf16)
    # (device, compiled) -> [(the step's matmul seconds at the full GEMM rate, micro-batches, measured seconds less
    # the other phases, the host time's factor)]: the trials that efficiency and micro_s are fitted to
    steps: dict = field(default_factory=dict)
    adamw_params_s: float | None = None  # measured offload CPU rate
    fp8_gain: float | None = None  # measured step-time gain of FP8, or the GEMM probe's prediction
    offload_scale: float | None = None  # measured exposed CPU step against the overlap rule's
    link_bytes_s: float | None = None  # measured collective rate between ranks
    power_w: float | None = None  # measured average power under load
    loader_tokens_s: float | None = None  # the data plane's tokens/s per loader, measured by a trial that waited
    attention_scale: float | None = None  # measured attention seconds against the model's (an attention-bound trial)
    # The job's documents: the share of micro-batches with a document boundary (flex_attention) and the share of the
    # causal triangle their mask leaves (plan/attention.py: doc_density). The defaults, 0 and 1, are long documents:
    # every row one document's piece, on the dense causal kernel.
    masked_share: float = 0.0
    attention_density: float = 1.0


@dataclass
class Prediction:
    gpu_bytes: float | None
    host_bytes: float
    fits: bool
    why_not: str  # "" when it fits
    phases: dict[str, float]  # seconds per step: compute, micro, optimizer, offload, tp, fsdp, cp, checkpoint, data
    tokens_per_step: int
    flops_per_step: float
    peak_flops: float | None
    power_w: float | None
    offloaded: int = 0  # parameters whose AdamW runs on the CPU
    save_s: float = 0.0  # what one checkpoint save blocks for
    ranks: int = 1  # processes (GPUs) of the step: MFU is per GPU
    memory: dict[str, float] = field(default_factory=dict)  # component -> bytes (GPU, or host on a CPU)
    host_s: float = 0.0  # the host's seconds per micro-batch (bf16's: FP8's are FP8_HOST times more)
    # phases["compute"] by what runs: the linear layers' GEMMs (the head's included), attention's T x T products, and
    # what activation checkpointing runs again of each
    linear_s: float = 0.0
    attention_s: float = 0.0
    recompute_gemm_s: float = 0.0
    recompute_attention_s: float = 0.0
    activations: dict[str, float] = field(default_factory=dict)  # the activations' bytes by part (memory/plan.py)
    routing_s: float = 0.0  # of compute: a mixture of experts' routing (memory traffic, plan/moe.py)
    moe: object = None  # a mixture of experts' terms (plan/moe.py: MoeTerms), None for a dense model

    @property
    def gemm_total_s(self) -> float:
        return self.linear_s + self.recompute_gemm_s

    @property
    def attention_total_s(self) -> float:
        return self.attention_s + self.recompute_attention_s

    @property
    def parts(self) -> dict[str, float]:
        """Where the step's seconds go: the linear layers' GEMMs, attention, recomputation, the optimizer, the
        communication between ranks, the host's issuing beyond the GPU's work, then the other phases."""
        ph = self.phases
        out = {"linear GEMMs": self.linear_s, "attention": self.attention_s,
               "recompute": self.recompute_gemm_s + self.recompute_attention_s, "optimizer": ph.get("optimizer", 0.0),
               "communication": sum(ph.get(k, 0.0) for k in COMM_PHASES), "host issue": ph.get("micro", 0.0)}
        if self.routing_s:
            out["MoE routing"] = self.routing_s
        out.update({k: v for k, v in ph.items() if k not in ("compute", "micro", "optimizer", *COMM_PHASES)})
        return out

    @property
    def step_s(self) -> float:
        return sum(self.phases.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float | None:
        return self.flops_per_step / self.step_s / (self.peak_flops * self.ranks) if self.peak_flops else None

    @property
    def j_per_token(self) -> float | None:
        return self.power_w * self.ranks * self.step_s / self.tokens_per_step if self.power_w else None


def _memory(model, cfg, machine: Machine, micro: int, accum: int, ranks: int) -> Plan:
    """Per rank: the memory plan (FSDP2 shards over all ranks, TP's shards included), with tensor parallelism's
    share of the activations."""
    device = torch.device(machine.device)
    # The machine's figure is GPU_USABLE of the free memory; a setting that trains with expandable segments (offload,
    # a capped GPU) can use more of it.
    gpu = machine.gpu_memory * gpu_usable_share(cfg) / GPU_USABLE if machine.gpu_memory else machine.gpu_memory
    plan = plan_memory(model, cfg, ranks, device, micro, accum, gpu_capacity=gpu,
                       host_capacity=machine.host_memory / ranks, local_ranks=ranks)
    key, share = "activations (estimate)", tp_activation_share(cfg.parallel.tp)
    for parts in (plan.gpu, plan.host):
        if key in parts:
            parts[key] *= share
    plan.activations = {k: v * share for k, v in plan.activations.items()}
    if machine.runtime_bytes:
        plan.host["runtime (measured)"] = machine.runtime_bytes
    return plan


def predict(model, cfg, machine: Machine, calib: Calibration, micro: int, accum: int, ranks: int = 1) -> Prediction:
    """The candidate `cfg` (resolved; per rank micro-batch `micro` x `accum` per step, on `ranks` processes of this
    machine, cfg.parallel.tp of them per model replica) on `machine`."""
    t, m = cfg.training, cfg.model
    tp, cp, ep = cfg.parallel.tp, cp_size(cfg), ep_size(cfg)
    dims = ParallelDims(world=ranks, cp=cp, tp=tp, ep=ep)
    dp = dims.dp
    plan = _memory(model, cfg, machine, micro, accum, ranks)
    why = []
    if not plan.gpu_fits:
        why.append(f"GPU needs {plan.gpu_need / 1e9:.1f} GB of {plan.gpu_capacity / 1e9:.1f}")
    if not plan.host_fits:
        why.append(f"host needs {plan.host_need / 1e9:.1f} GB of {plan.host_capacity / 1e9:.1f}")

    seq = cfg.data.seq_len
    tokens = micro * accum * dp * seq
    args = model_args(cfg)
    flops = flops_per_token(args, seq) * tokens  # MFU's count (attention over the full square)
    # The linear layers' FLOPs per token (6 per active weight), less a mixture of experts' grouped GEMMs (plan/moe.py)
    linear = flops_per_token(args, 0) - expert_flops_per_token(args)
    blocks_share = 1 - 6 * m.dim * m.vocab_size / linear  # the head's 6 FLOPs per weight are not recomputed
    ac, ac_blocks = cfg.memory.activation_checkpointing, cfg.memory.activation_checkpointing_blocks
    key = (machine.device, t.compile)
    eff = calib.efficiency.get(key, EFFICIENCY[key])
    gemm_s = linear * tokens / ranks / (machine.gemm_flops * eff)
    linear_s = matmul_time(gemm_s, t.fp8, calib.fp8_gain)
    # Activation checkpointing's recomputation: the GEMMs of a third of the recomputed blocks' FLOPs ("pointwise":
    # its memory-bound share), and the forward of the attention of those recomputed whole ("all-but-attention" keeps
    # it).
    recompute_gemm_s = matmul_time(gemm_s * recompute_share(ac, m.n_layers, blocks_share, ac_blocks), t.fp8,
                                   calib.fp8_gain)
    if cfg.memory.ffn_tiles > 1:  # each tile's gate and up run again in its backward: 2 * 2 * dim * ffn a token
        tiled = 4 * m.dim * m.ffn_dim * (m.n_layers - args.moe_layers) / linear
        recompute_gemm_s += matmul_time(gemm_s * tiled, t.fp8, calib.fp8_gain)
    # Segments run their blocks' forward once more (memory.activation_checkpointing_segment): a third of their
    # matmul FLOPs again, and their attention's forward below.
    again_share = segment_recompute_share(m.n_layers, getattr(cfg.memory, "activation_checkpointing_segment", 1))
    recompute_gemm_s += matmul_time(gemm_s * blocks_share * again_share / 3, t.fp8, calib.fp8_gain)
    whole = len(checkpointed_blocks(ac, m.n_layers, ac_blocks)) / m.n_layers
    mode = cp_mode(cfg) if cp > 1 else ""
    attention_s = attention_seconds(args, seq, tokens / ranks, machine.attention_rate, calib.attention_density,
                                    calib.masked_share, ring=mode == "ring") * (calib.attention_scale or 1.0)
    recompute_attention_s = attention_s * (whole + again_share) * ATTENTION_FORWARD_SHARE
    link = calib.link_bytes_s or LINK_BYTES_S[machine.device]
    lean = 0.0 if grouped_gemms_kept(machine.device == "cuda") else len(pointwise_blocks(ac, m.n_layers, ac_blocks))
    bf16 = t.dtype == "bf16" or (t.dtype == "auto" and machine.device == "cuda")  # memory/plan.py's rule
    again = len(recomputed_blocks(ac, m.n_layers, ac_blocks)) / m.n_layers  # blocks whose experts run again
    moe = moe_terms(args, micro * seq / cp, accum, ep, 2 if bf16 else 4, machine.gemm_flops * eff, link,
                    again + again_share + lean / m.n_layers, machine.device)
    routing_s = 0.0
    if moe:  # the experts are not FP8 linears: at the bf16 rate
        linear_s, recompute_gemm_s, routing_s = (linear_s + moe.expert_s, recompute_gemm_s + moe.recompute_s,
                                                 moe.routing_s)
    compute = linear_s + recompute_gemm_s + attention_s + recompute_attention_s + routing_s
    host = host_seconds(calib, key, m.n_layers)
    # "micro": what issuing the micro-batches adds to their GPU work.
    phases = {"compute": compute,
              "micro": micro_time(compute / accum, host * host_factor(t.fp8), machine.device) * accum - compute}
    if machine.device == "cuda":  # on a CPU the optimizer's step is in the compute's efficiency
        per_param = DEVICE_ADAMW_S_PER_PARAM[cfg.memory.adamw_moments]
        phases["optimizer"] = (plan.n_params - (plan.n_offloaded if cfg.memory.offload else 0)) / ranks * per_param
    if ranks > 1:
        # TP's collectives without overlap are exposed; FSDP2's (over dp and cp; an expert's over the ranks sharing
        # its ep share) hide behind compute but for the first gather; context parallelism's as its mode hides them
        # (plan/attention.py); expert parallelism's all-to-alls but for what plan/moe.py hides.
        phases["tp"] = tp_bytes_per_step(micro * seq // cp, m.dim, m.n_layers, tp, accum) / link
        n_expert = expert_params(args) if ep > 1 else 0
        fsdp = fsdp_ep_bytes_per_step(plan.n_params, n_expert, dp * cp, ep, dims.expert_dp if ep > 1 else 1, tp) / link
        if moe and ep > 1:
            phases["ep"] = moe.exposed_s
        phases["fsdp"] = fsdp / (m.n_layers + 1) + max(0.0, fsdp - compute)
        if cp > 1:
            elem = 4 if t.dtype == "fp32" else 2
            phases["cp"] = cp_exposed_seconds(args, mode, cp, tp, micro, seq, accum, elem, attention_s, whole, link)
    moved = plan.host.get(OFFLOADED_ACTIVATIONS, 0.0)  # activation offload: one micro-batch's saved tensors
    if moved:
        forward = compute / accum / 3
        if machine.device == "cuda" and moved / OUT_BYTES_S > forward * (1 - cfg.memory.activation_offload_blocks
                                                                         / m.n_layers):
            why.append("activation offload's copies outlast the forward: the memory would not be free at its peak")
        phases["activation_offload"] = accum * exposed_copy_s(moved, cfg.memory.activation_offload_blocks,
                                                              m.n_layers, forward, 2 * forward)
    offloaded = plan.n_offloaded if cfg.memory.offload else 0
    if offloaded:
        adamw = calib.adamw_params_s or machine.adamw_params_s * ADAMW_IN_TRAINING
        phases["offload"] = exposed_cpu_step(offloaded, adamw,
                                             compute / 3, compute * 2 / 3, t.grad_clip > 0,
                                             m.n_layers + 2, cfg.memory.offload_delayed_update
                                             ) * (calib.offload_scale or 1.0)
    # The engine holds its state for a save where the host has room for a second set of masters and moments
    # (memory/offload/state.py: allocate_spares); a delayed update's never is.
    delayed = cfg.memory.offload_delayed_update
    held = not delayed and plan.host_need + 12 * offloaded / ranks <= plan.host_capacity
    save_s = save_blocking_s((plan.n_params - offloaded) // ranks, offloaded // ranks, held,
                             None if machine.device == "cuda" else machine.host_copy_bytes_s, 16 if delayed else 14,
                             overlap_s=compute)
    if cfg.checkpoint.every:
        phases["checkpoint"] = save_s / cfg.checkpoint.every
    if calib.loader_tokens_s:
        # Loaders run beside the step: only what they take beyond it is waited for.
        plane_s = tokens / (calib.loader_tokens_s * cfg.data.workers)
        phases["data"] = max(0.0, plane_s - sum(phases.values()))
    memory = plan.gpu if machine.device == "cuda" else plan.host
    return Prediction(plan.gpu_need if machine.device == "cuda" else None, plan.host_need, not why, "; ".join(why),
                      phases, tokens, flops, machine.peak_flops, calib.power_w or machine.power_w, offloaded,
                      save_s, ranks, dict(memory), host, linear_s, attention_s, recompute_gemm_s,
                      recompute_attention_s, dict(plan.activations), routing_s, moe)


def describe(p: Prediction) -> list[str]:
    """Two lines: the predicted step time by where it goes, and the predicted peak memory by what holds it."""
    parts = [f"{v:.3f} {k}" for k, v in p.parts.items() if v >= 0.0005]
    gb = p.gpu_bytes if p.gpu_bytes is not None else p.host_bytes
    held = []
    for k, v in p.memory.items():
        if k == "activations (estimate)" and p.activations:
            inner = ", ".join(f"{w / 1e9:.2f} {name}" for name, w in p.activations.items() if w >= 0.005e9)
            held.append(f"{v / 1e9:.2f} activations ({inner})")
        elif v >= 0.005e9:
            held.append(f"{v / 1e9:.2f} {k}")
    return [f"step {p.step_s:.3f} s = " + " + ".join(parts),
            f"peak {'GPU' if p.gpu_bytes is not None else 'host'} memory {gb / 1e9:.2f} GB = " + " + ".join(held)
            ] + ([describe_moe(p.moe)] if p.moe else [])


def host_seconds(calib: Calibration, key: tuple, n_layers: int) -> float:
    """The host's seconds per micro-batch (bf16) for `key` = (device, compiled): measured, or the prior."""
    if key in calib.micro_s:
        return calib.micro_s[key]
    return HOST_S_PER_BLOCK[key] * n_layers if key[0] == "cuda" else MICRO_S[key[0]]


def host_factor(fp8: str) -> float:
    return FP8_HOST if fp8 != "none" else 1.0


def micro_time(gpu_s, host_s, device: str):
    """One micro-batch's seconds from its matmuls' and its host's: the smooth maximum on a GPU (the host issues the
    next micro-batch while the GPU runs this one), the sum on a CPU. Elementwise on numpy arrays too."""
    if device == "cuda":
        return (gpu_s ** _OVERLAP_P + host_s ** _OVERLAP_P) ** (1 / _OVERLAP_P)
    return gpu_s + host_s


def gpu_seconds(measured_s, host_s, device: str):
    """The inverse of micro_time: the matmul seconds of a micro-batch that took `measured_s`."""
    if device == "cuda":
        return np.maximum(0.0, measured_s ** _OVERLAP_P - host_s ** _OVERLAP_P) ** (1 / _OVERLAP_P)
    return np.maximum(0.0, measured_s - host_s)


def fit_compute(calib: Calibration, key: tuple, work_s: float, micros: int, measured_s: float,
                factor: float = 1.0, prior_host_s: float | None = None, fixed_s: float = 0.0) -> None:
    """Adds a trial (its GEMM seconds at the full GEMM rate, its micro-batches per step, its step time less the
    other phases, its host time's factor: FP8_HOST with FP8, its GPU seconds that do not scale with the GEMM
    efficiency: attention) and refits `key` = (device, compiled) over all of them: the GEMM efficiency by least
    squares, for the host's seconds per micro-batch that fit the trials best (a golden-section search); that is fitted
    only once the trials' micro-batches per step differ by 4x or more (closer, the difference of two step times is
    mostly noise), and kept as it was where the best fit would be none at all."""
    obs = calib.steps.setdefault(key, [])
    obs.append((work_s, micros, measured_s, factor, fixed_s))
    w, n, y, f, a = (np.array(column, dtype=np.float64) for column in zip(*obs))
    device = key[0]

    def efficiency_for(host: float) -> float:
        g = n * gpu_seconds(y / n, host * f, device) - a  # the GEMMs' measured seconds, given the host's
        return float(g @ w / (w @ w))  # 1 / efficiency

    def misfit(host: float) -> float:
        return float((((n * micro_time((w * efficiency_for(host) + a) / n, host * f, device)) / y - 1) ** 2).sum())

    host = calib.micro_s.get(key, MICRO_S.get(device, 0.0) if prior_host_s is None else prior_host_s)
    if n.max() >= 4 * n.min():
        lo, hi = 0.0, float((y / n / f).min())
        for _ in range(80):
            a_, b_ = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
            lo, hi = (lo, b_) if misfit(a_) <= misfit(b_) else (a_, hi)
        if lo > 1e-9:  # else the best fit is no host time at all: noise, keep the one it had
            host = (lo + hi) / 2
    inv_eff = efficiency_for(host)
    if inv_eff > 0:
        calib.efficiency[key], calib.micro_s[key] = 1 / inv_eff, host


def young_daly_steps(blocking_s: float, mtbf_hours: float, step_s: float) -> int:
    """The checkpoint interval that loses the least time to saving and to recomputing after a failure (Young/Daly:
    sqrt(2 x save cost x MTBF)), in steps."""
    interval = math.sqrt(2 * max(blocking_s, 1e-3) * mtbf_hours * 3600)
    return max(1, round(interval / step_s))


def with_settings(cfg, settings: dict):
    """A copy of the resolved `cfg` with `settings` ("section.key" -> value) applied (the config is frozen)."""
    sections = {}
    for name, value in settings.items():
        section, key = name.split(".")
        sections.setdefault(section, {})[key] = value
    changes = {s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()}
    return dataclasses.replace(cfg, **changes)
