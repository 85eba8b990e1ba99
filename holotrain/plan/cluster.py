"""The planner beyond one machine, on paper: for a model, a sequence length and a global batch on a cluster (nodes of
GPUs of one measured kind, NVLink within a node, a NIC per GPU between nodes), every layout of data (FSDP2), tensor,
context and pipeline parallelism, pipeline schedule, micro-batch and activation checkpointing, the ones that do not fit
memory rejected, each other one's step time predicted and split by where it goes, with its MFU and the checkpoint
interval its scale calls for.

The ranks are laid out as torchtitan's mesh is: [pp, dp, cp, tp], tp innermost. So tensor parallelism stays within a
node (tp divides the GPUs of a node), context parallelism too (tp x cp <= GPUs of a node), FSDP's group (dp x cp
ranks) spans nodes once tp x cp x dp exceeds a node, and neighbouring pipeline stages are on different nodes once a
stage's ranks fill one. The model is cut into the pipeline's stages (pp x the schedule's stages per rank) as
parallel/pp.py cuts it, by cost: the stage that carries the output head takes fewer blocks. The candidates are first
timed with plan/pipeline.py's closed-form bubble; the best REFINE of them are then simulated. A mixture of experts
(no tensor parallelism yet) also tries expert parallelism without cp and pp (parallel/config.py): every ep that divides
dp and the experts, its all-to-alls in the `ep` phase and its experts' grouped GEMMs in compute (plan/moe.py).

Time, per step, on the busiest rank (seconds):
  compute     each stage's GEMMs at the GPU's measured GEMM rate times the compiled-step efficiency (plan/cost.py:
              EFFICIENCY), forward 1/3 of a linear layer's 6 FLOPs per weight, backward for the input 1/3, for the
              weights 1/3; attention's T x T products at the attention kernels' rate (plan/attention.py), 2/7
              forward, 5/7 backward; what activation checkpointing recomputes (memory/activation_checkpointing.py:
              recompute_share, and the recomputed blocks' attention forward) in the backward; the host's issue time
              per micro-batch by plan/cost.py's micro_time; the output head on the last stage. Under zb1p and zbv the
              blocks run eager, at the eager efficiency and host time: torch's zero-bubble schedules refuse compiled
              stage modules (pipelining/schedules.py: _check_torch_compile_compatibility), and a compiled block's
              backward makes its input and weight gradients in one graph, which leaves nothing to split
  tp          tensor parallelism's all-gathers and reduce-scatters (parallel/cost.py: tp_bytes_per_step) at the
              node's collective rate, TP_EXPOSED of them left exposed (async-TP's measured overlap)
  cp          context parallelism's exposed ring hops or all-to-alls (plan/attention.py: cp_exposed_seconds)
  bubble      the pipeline's idle time on that rank: plan/pipeline.py's simulator run over the schedule's op order
              with each stage's F, B, W (tp and cp inside them; the stages' unequal shares included)
  pp_p2p      what the stage-to-stage sends add to the step: the simulator run again with each send's latency and
              bytes (a micro-batch's hidden states, 1/tp of them per rank under sequence parallelism) at NVLink's or
              the NIC's rate
  fsdp        FSDP2's unhidden collectives over dp x cp ranks (parallel/cost.py: fsdp_bytes_per_step): without pp,
              torchtitan's use, the weights gathered for each micro-batch's forward and backward and the gradients
              reduce-scattered after each, hidden behind compute but for the first block (plan/cost.py's rule); with
              pp, torch's stages keep the weights gathered and the gradients unreduced over the step (their memory
              counted) and reduce-scatter once after the last backward, exposed for the chunk that finishes last;
              under ep the experts' share over the expert_dp ranks that hold it (fsdp_ep_bytes_per_step)
  optimizer   the device AdamW over the rank's shard (plan/cost.py: DEVICE_ADAMW_S_PER_PARAM)
  checkpoint  a save's blocking time (train/checkpointer.py: save_blocking_s, an async save's queueing and what of its
              device-to-host copy outlasts the next step's compute, or the cluster's checkpoint_save_s) over the Young/Daly interval, which is no shorter than a node's
              background write of its ranks' state at the disk rate train/checkpointer.py measured (DISK_BYTES_S)
MFU: the model's FLOPs by the 6N + 12 L d T convention (model/llama.py: flops_per_token) over the step time and the
GPUs' bf16 peak.

Memory, per rank (the largest): fp32 weights, gradients and AdamW moments (16 bytes a parameter of the rank's stages,
1/tp of them, sharded over dp x cp); with pp the gathered bf16 weights and the unreduced fp32 gradients of the rank's
stages (6 bytes a parameter), without pp two gathered blocks (memory/plan.py's rule); one micro-batch's activations of
each stage from memory/plan.py's activation model (its fitted bytes per value, tensor parallelism's share as plan/
cost.py takes it, but 1/tp of the checkpointed blocks' inputs, which sequence parallelism shards) times the
micro-batches in flight, which the schedule's op order gives (plan/pipeline.py: peak_in_flight: p - s on stage s for
1f1b), and the larger of the loss (last stage) and one block's backward buffers. The weights are the total
parameters (a mixture of experts' every expert), a gathered block's experts its ep-th; time counts the active ones.
A layout fits where that is within the GPU memory the measured machine may use.

Failures: the job's MTBF is a node's over the nodes; the checkpoint interval is Young/Daly's sqrt(2 x save x MTBF),
and the expected share of the wall clock lost, to first order, is save / interval + (interval / 2 + restart) / MTBF."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from holotrain.config import Config
from holotrain.errors import ConfigError
from holotrain.memory.activation_checkpointing import (POLICIES, checkpointed_blocks, pointwise_blocks, recompute_share,
                                                       recomputed_blocks)
from holotrain.memory.activation_checkpointing import grouped_gemms_kept
from holotrain.memory.plan import activations
from holotrain.model.args import ModelArgs
from holotrain.parallel.dims import ParallelDims
from holotrain.model.costs import (ATTENTION_FORWARD_SHARE, block_active_params, block_params, expert_flops_per_token,
                                   expert_params, flops_per_token)
from holotrain.parallel.cost import fsdp_ep_bytes_per_step, tp_activation_share, tp_bytes_per_step
from holotrain.parallel.pp import stage_bounds, stages_per_rank, unit_costs
from holotrain.plan.attention import LINK_LATENCY_S, attention_seconds, cp_exposed_seconds
from holotrain.plan.cost import DEVICE_ADAMW_S_PER_PARAM, EFFICIENCY, HOST_S_PER_BLOCK, Machine, micro_time
from holotrain.plan.moe import MoeTerms, expert_parallel_sizes, moe_terms
from holotrain.plan.pipeline import (
    SCHEDULES,
    ZERO_BUBBLE,
    bubble_formula,
    memory_order,
    peak_in_flight,
    schedule_order,
    simulate,
    virtual_stages,
)
from holotrain.train.checkpointer import DISK_BYTES_S, save_blocking_s

# Tensor parallelism's share of its communication left exposed: async-TP's all-gather + GEMM on 2x H200 took 2.89 ms
# against 3.36 ms for the NCCL all-gather then the GEMM and 2.51 ms for the GEMM alone (shared/DESIGN.md), so it hid
# 55% of the collective.
TP_EXPOSED = 1 - (3.36 - 2.89) / (3.36 - 2.51)
# The (schedule, stages per rank) tried with pp > 1, as parallel/pp.py runs them.
SCHEDULE_CHOICES = (("1f1b", 1), ("interleaved", 2), ("zb1p", 2), ("zbv", 2))
MICRO_CHOICES = (1, 2, 4, 8, 16)  # sequences per micro-batch
REFINE = 24  # the best candidates by the closed-form bubble, simulated


@dataclass(frozen=True)
class Cluster:
    """Nodes of GPUs of one measured kind (`machine`: plan/cost.py's Machine, as hw/probe measures it) and the links
    between them."""

    name: str
    nodes: int
    gpus_per_node: int
    machine: Machine
    intra_node_busbw: float  # bytes/s a GPU reaches in a collective within a node (bus bandwidth)
    inter_node_bytes_s: float  # bytes/s of a GPU's own NIC to other nodes
    inter_node_efficiency: float  # the bus bandwidth of a collective across nodes, as a share of the NIC's rate
    nvlink_bytes_s: float = 900e9  # NVLink's nominal rate per GPU (both directions together), for the record
    intra_latency_s: float = LINK_LATENCY_S
    inter_latency_s: float = 20e-6
    node_mtbf_hours: float = 0.0  # 0: no failures modelled
    checkpoint_save_s: float | None = None  # a save's blocking seconds; None: from the rank's state (save_blocking_s)
    restart_s: float = 0.0  # seconds from a failure to training again, the state reloaded

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def inter_node_busbw(self) -> float:
        return self.inter_node_bytes_s * self.inter_node_efficiency

    @property
    def job_mtbf_hours(self) -> float:
        return self.node_mtbf_hours / self.nodes if self.node_mtbf_hours else math.inf

    def with_nodes(self, nodes: int) -> Cluster:
        return dataclasses.replace(self, nodes=nodes, name=f"{self.name} x{nodes} nodes")


_MACHINE_FIELDS = {f.name for f in dataclasses.fields(Machine)}


def _machine(spec: dict, where: Path) -> Machine:
    if "machine_json" in spec:
        path = (where.parent / spec["machine_json"]).resolve()
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: machine_json {path} cannot be read: {e}") from None
    elif "gpu" in spec:
        fields = dict(spec["gpu"])
    else:
        raise ConfigError(f"{where}: the cluster needs a [gpu] table (plan/cost.py Machine's fields, as "
                          "bench/data/plan-h200/machine.json has them) or machine_json = \"path\"")
    unknown = set(fields) - _MACHINE_FIELDS
    missing = {"device", "name", "gpu_total", "gpu_memory", "host_memory", "gemm_flops", "peak_flops",
               "adamw_params_s", "host_copy_bytes_s", "power_w", "fp8"} - set(fields)
    if unknown or missing:
        raise ConfigError(f"{where}: the GPU's description has unknown keys {sorted(unknown)} / lacks "
                          f"{sorted(missing)}")
    return Machine(**fields)


def load_cluster(path: str | Path) -> Cluster:
    """A cluster description (TOML, or JSON with the same keys): name, nodes, gpus_per_node, the GPU ([gpu] or
    machine_json), [links] intra_node_busbw_gb_s, inter_node_gbit_s, inter_node_efficiency, nvlink_gb_s,
    intra_latency_us, inter_latency_us, and [reliability] node_mtbf_hours, checkpoint_save_s, restart_s."""
    path = Path(path)
    try:
        text = path.read_text()
        spec = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cluster file {path} cannot be read: {e}") from None
    links, rel = spec.get("links", {}), spec.get("reliability", {})
    try:
        cluster = Cluster(
            name=spec.get("name", path.stem), nodes=int(spec["nodes"]), gpus_per_node=int(spec["gpus_per_node"]),
            machine=_machine(spec, path), intra_node_busbw=float(links["intra_node_busbw_gb_s"]) * 1e9,
            inter_node_bytes_s=float(links["inter_node_gbit_s"]) * 1e9 / 8,
            inter_node_efficiency=float(links.get("inter_node_efficiency", 1.0)),
            nvlink_bytes_s=float(links.get("nvlink_gb_s", 900)) * 1e9,
            intra_latency_s=float(links.get("intra_latency_us", LINK_LATENCY_S * 1e6)) * 1e-6,
            inter_latency_s=float(links.get("inter_latency_us", 20)) * 1e-6,
            node_mtbf_hours=float(rel.get("node_mtbf_hours", 0.0)),
            checkpoint_save_s=float(rel["checkpoint_save_s"]) if "checkpoint_save_s" in rel else None,
            restart_s=float(rel.get("restart_s", 0.0)))
    except KeyError as e:
        raise ConfigError(f"cluster file {path} lacks {e.args[0]}") from None
    if cluster.nodes < 1 or cluster.gpus_per_node < 1:
        raise ConfigError(f"cluster file {path}: nodes and gpus_per_node must be positive")
    return cluster


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    cp: int
    pp: int
    schedule: str  # "none" without pp
    virtual: int  # stages per rank
    micro: int  # sequences per micro-batch
    micro_batches: int  # per step and data-parallel replica: accumulated, or in flight through the pipeline
    ac: str  # activation checkpointing policy
    # A zero-bubble schedule's blocks taken as compiled, which torch cannot run: the bound a compiled split backward
    # would reach.
    what_if_compiled: bool = False
    ep: int = 1  # expert parallelism: a mixture of experts' experts split over ep of the dp ranks

    @property
    def compiled(self) -> bool:
        """Whether the blocks run compiled: not under the zero-bubble schedules, whose split backward needs them eager
        (see the module's docstring)."""
        return self.what_if_compiled or self.schedule not in ZERO_BUBBLE

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def label(self) -> str:
        parts = ([f"dp {self.dp}", f"tp {self.tp}"] + ([f"cp {self.cp}"] if self.cp > 1 else [])
                 + ([f"ep {self.ep}"] if self.ep > 1 else []))
        if self.pp > 1:
            v = f" x{self.virtual}" if self.virtual != stages_per_rank(self.schedule) else ""
            parts.append(f"pp {self.pp} {self.schedule}{v}")
        return (" x ".join(parts) + f", micro {self.micro} x {self.micro_batches}, ac {self.ac}"
                + ("" if self.compiled else ", eager")
                + (", compiled (what-if)" if self.what_if_compiled and self.schedule in ZERO_BUBBLE else ""))


@dataclass
class ClusterCandidate:
    layout: Layout
    fits: bool
    why_not: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step, see the module's docstring
    memory: dict[str, float] = field(default_factory=dict)  # bytes on the fullest GPU, by what holds them
    memory_capacity: float = 0.0
    tokens_per_step: int = 0
    flops_per_step: float = 0.0
    peak_flops: float | None = None
    bubble_share: float = 0.0  # of the pipeline's part of the step, all ranks
    simulated: bool = False  # the bubble from the simulator (else the closed form)
    save_s: float = 0.0  # what a save blocks training for
    write_s: float = 0.0  # a node's background write of its ranks' state
    checkpoint_interval_s: float = math.inf
    checkpoint_interval_steps: int = 0
    goodput_loss: float = 0.0  # expected share of the wall clock lost to saves and failures
    moe: MoeTerms | None = None  # a mixture of experts' terms of the step, the whole model's (plan/moe.py)

    @property
    def step_s(self) -> float:
        return sum(self.phases.values())

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.layout.gpus

    @property
    def mfu(self) -> float | None:
        if not self.peak_flops:
            return None
        return self.flops_per_step / self.step_s / (self.peak_flops * self.layout.gpus)

    def describe(self) -> str:
        split = " + ".join(f"{v:.3f} {k}" for k, v in self.phases.items() if v >= 0.0005)
        return f"{self.layout.label}: step {self.step_s:.3f} s = {split}"


# --------------------------------------------------------------------------------------------
# The model's shares


@functools.lru_cache(maxsize=256)
def _cut(shape: tuple, n_layers: int, seq_len: int, n_stages: int) -> tuple[tuple[int, bool, bool], ...]:
    """The stages as parallel/pp.py cuts the model (stage_bounds over unit_costs: the costliest stage as cheap as it
    can be), each as (blocks, holds the embedding, holds the head)."""
    a = dataclasses.replace(_args(shape), n_layers=n_layers)
    units = n_layers + 2  # [embedding, blocks, head]
    return tuple((sum(1 for u in range(i, j + 1) if 0 < u < units - 1), i == 0, j == units - 1)
                 for i, j in stage_bounds(unit_costs(a, seq_len), n_stages))


def _shape(a: ModelArgs) -> tuple:
    """The arguments as a hashable key (for the caches below)."""
    return tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else v) for k, v in dataclasses.asdict(a).items())


def _args(shape: tuple) -> ModelArgs:
    return ModelArgs(**{k: dict(v) if k == "rope_scaling" else v for k, v in shape})


def _tp_sizes(a: ModelArgs, gpus_per_node: int) -> list[int]:
    return [tp for tp in range(1, gpus_per_node + 1) if ParallelDims.fits(gpus_per_node, tp=tp) and all(
        x % tp == 0 for x in (a.n_heads, a.n_kv_heads, a.ffn_dim, a.vocab_size)) and (tp == 1 or not a.n_experts)]


def _cp_sizes(seq_len: int, tp: int, gpus_per_node: int) -> list[int]:
    return [cp for cp in (1, 2, 4, 8, 16) if tp * cp <= gpus_per_node and seq_len % (2 * cp * tp) == 0]


def _stage_cfg(a: ModelArgs, layers: int, seq_len: int, ac: str, tp: int, cp: int, compiled: bool,
               ep: int = 1) -> Config:
    """A resolved-enough config of one pipeline stage of `layers` blocks, for memory/plan.py's activation model."""
    cfg = Config()
    shape = {k: v for k, v in dataclasses.asdict(a).items() if hasattr(cfg.model, k)}
    model = dataclasses.replace(cfg.model, **{**shape, "n_layers": layers, "max_seq_len": seq_len})
    return dataclasses.replace(
        cfg, model=model, data=dataclasses.replace(cfg.data, seq_len=seq_len),
        training=dataclasses.replace(cfg.training, compile=compiled, dtype="bf16", fp8="none"),
        memory=dataclasses.replace(cfg.memory, activation_checkpointing=ac, activation_checkpointing_blocks=0),
        parallel=dataclasses.replace(cfg.parallel, tp=tp, cp=cp, cp_mode="auto", ep=ep))


@functools.lru_cache(maxsize=4096)
def _activations(shape: tuple, layers: int, seq_len: int, ac: str, tp: int, cp: int, compiled: bool, micro: int,
                 block_weights: float, ep: int = 1):
    a = dataclasses.replace(_args(shape), n_layers=layers)
    return activations(_stage_cfg(a, layers, seq_len, ac, tp, cp, compiled, ep), micro, 2, block_weights)


@dataclass
class _Stage:
    """One pipeline stage's per-micro-batch seconds and bytes on one of its ranks."""

    layers: int
    params: int  # all of the stage's parameters (not divided by tp)
    forward: float
    backward_input: float
    backward_weight: float
    tp_s: float  # of the three above, tensor parallelism's exposed collectives
    cp_s: float  # and context parallelism's
    ep_s: float  # and expert parallelism's all-to-alls
    saved: float  # activations one micro-batch leaves on it until its backward
    transient: float  # the larger of the loss (last stage) and one block's backward buffers


def _stage(a: ModelArgs, cluster: Cluster, seq_len: int, lay: Layout, layers: int, first: bool, last: bool,
           n_f: int) -> _Stage:
    mach, tp, cp, b = cluster.machine, lay.tp, lay.cp, lay.micro
    tokens = b * seq_len / cp  # of a micro-batch, on one rank
    head_w = a.dim * a.vocab_size
    params = layers * block_params(a) + (head_w if first else 0) + ((head_w + a.dim) if last else 0)
    key = ("cuda", lay.compiled)
    rate = mach.gemm_flops * EFFICIENCY[key]
    # The blocks' GEMMs at their active weights; a mixture of experts' routed experts apart, as plan/moe.py times them.
    experts = expert_flops_per_token(a) * layers / a.n_layers
    blocks_gemm = (6 * layers * (block_active_params(a) - 2 * a.dim) - experts) * tokens / tp / rate
    head_gemm = 6 * head_w * tokens / tp / rate if last else 0.0
    recompute = blocks_gemm * recompute_share(lay.ac, layers, 1.0) if layers else 0.0
    whole = len(checkpointed_blocks(lay.ac, layers)) / layers if layers else 0.0
    sargs = dataclasses.replace(a, n_layers=layers)
    moe = moe_terms(sargs, tokens, 1, lay.ep, 2, rate, _ep_link(cluster, lay), _expert_recompute(lay.ac, layers))
    ring = cp > 1 and ((a.n_heads // tp) % cp or (a.n_kv_heads // tp) % cp)
    attn = attention_seconds(sargs, seq_len, tokens, mach.attention_rate, 1.0, 0.0, ring=bool(ring)) / tp
    attn_f, attn_b = attn * ATTENTION_FORWARD_SHARE, attn * (1 - ATTENTION_FORWARD_SHARE)
    gemm = blocks_gemm + head_gemm + (moe.expert_s if moe else 0.0)
    routing = moe.routing_s if moe else 0.0
    f = gemm / 3 + attn_f + routing / 3
    bi = gemm / 3 + attn_b + recompute + attn * whole * ATTENTION_FORWARD_SHARE + 2 * routing / 3
    bi += moe.recompute_s if moe else 0.0
    bw = gemm / 3
    # The host issues a micro-batch's kernels while the GPU runs the previous one's (plan/cost.py: micro_time).
    gpu = f + bi + bw
    if gpu > 0:
        scale = micro_time(gpu, HOST_S_PER_BLOCK[key] * max(layers, 1), "cuda") / gpu
        f, bi, bw = f * scale, bi * scale, bw * scale
    tp_s = tp_bytes_per_step(int(tokens), a.dim, layers, tp, 1) / cluster.intra_node_busbw * TP_EXPOSED
    cp_s = cp_exposed_seconds(sargs, "ring" if ring else "alltoall", cp, tp, b, seq_len, 1, 2, attn, whole,
                              cluster.intra_node_busbw) if cp > 1 and layers else 0.0
    ep_s = moe.exposed_s if moe else 0.0
    f += tp_s / 2 + cp_s * ATTENTION_FORWARD_SHARE + ep_s / 2
    bi += tp_s / 2 + cp_s * (1 - ATTENTION_FORWARD_SHARE) + ep_s / 2
    acts = _activations(_shape(a), max(layers, 1), seq_len, lay.ac,
                        tp, cp, lay.compiled, b, layers * block_params(a) / (tp * n_f), lay.ep)
    # Tensor parallelism's share (plan/cost.py's), but for the checkpointed blocks' inputs: sequence-parallel between
    # blocks, each rank keeps 1/tp of them.
    share = tp_activation_share(tp)
    inputs = len(recomputed_blocks(lay.ac, layers)) * tokens * 2 * a.dim if layers else 0.0
    saved = ((acts.saved - inputs) * share + inputs / tp + acts.held) if layers else 0.0
    transient = max(acts.loss if last else 0.0, acts.recompute * share if layers else 0.0)
    return _Stage(layers, params, f, bi, bw, tp_s, cp_s, ep_s, saved, transient)


def _expert_recompute(ac: str, layers: int) -> float:
    """The share of the blocks whose routed experts run again in backward: those recomputed (whole or but their
    attention), and "pointwise" ones where the grouped GEMMs are not kept (memory/plan.py: grouped_gemms_kept)."""
    lean = 0 if grouped_gemms_kept(True) else len(pointwise_blocks(ac, layers))
    return (len(recomputed_blocks(ac, layers)) + lean) / max(layers, 1)


def _ep_link(cluster: Cluster, lay: Layout) -> float:
    """The rate of an expert-parallel group's all-to-all: adjacent data-parallel ranks, within a node up to its GPUs."""
    return cluster.intra_node_busbw if lay.ep * lay.cp * lay.tp <= cluster.gpus_per_node else cluster.inter_node_busbw


# --------------------------------------------------------------------------------------------
# One layout


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that loses the least to saving and to recomputing after failures: sqrt(2 x save x
    MTBF) (Young 1974; Daly 2006's first-order optimum)."""
    if not math.isfinite(mtbf_s):
        return math.inf
    return math.sqrt(2 * max(save_s, 1e-3) * mtbf_s)


def expected_loss_share(save_s: float, interval_s: float, mtbf_s: float, restart_s: float) -> float:
    """The share of the wall clock lost, to first order: the saves, and per failure half an interval of work done
    again and the restart."""
    if not math.isfinite(mtbf_s):
        return 0.0
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def _memory(a: ModelArgs, lay: Layout, stages: list[_Stage], order, n_f: int) -> dict[str, float]:
    """The fullest rank's bytes, by what holds them (`order`: the schedule's, for the activations in flight)."""
    tp, block = lay.tp, block_params(a) - expert_params(a) / a.n_layers * (1 - 1 / lay.ep)  # a gathered block's
    ranks = [[s for s in range(len(stages)) if (order.rank_of[s] if order else 0) == r] for r in range(lay.pp)]
    in_flight = peak_in_flight(order, [st.saved for st in stages]) if order else [stages[0].saved]
    best: dict[str, float] = {}
    for r, mine in enumerate(ranks):
        params = sum(stages[s].params for s in mine) / tp
        mem = {"fp32 weights, gradients and AdamW moments (sharded)": 16 * params / n_f}
        if n_f > 1:
            if lay.pp > 1:
                mem["gathered bf16 weights and unreduced fp32 gradients (the step's)"] = 6 * params
            else:
                mem["two gathered blocks (FSDP2)"] = 2 * 2 * block / tp
        mem["activations in flight"] = in_flight[r]
        mem["loss or a block's backward buffers"] = max(stages[s].transient for s in mine)
        if sum(mem.values()) > sum(best.values()):
            best = mem
    return best


def evaluate(a: ModelArgs, cluster: Cluster, seq_len: int, lay: Layout, simulate_bubble: bool = True
             ) -> ClusterCandidate:
    """The predicted step (or why it does not fit) of one layout."""
    mach = cluster.machine
    n_f = lay.dp * lay.cp  # FSDP2's group
    v = lay.virtual if lay.pp > 1 else 1
    cut = _cut(_shape(a), a.n_layers, seq_len, lay.pp * v)
    stages = [_stage(a, cluster, seq_len, lay, n, first, last, n_f) for n, first, last in cut]
    short = memory_order(lay.schedule, lay.pp, lay.micro_batches, v) if lay.pp > 1 else None
    tokens = lay.dp * lay.micro * lay.micro_batches * seq_len
    out = ClusterCandidate(lay, True, tokens_per_step=tokens, flops_per_step=flops_per_token(a, seq_len) * tokens,
                           peak_flops=mach.peak_flops, memory_capacity=mach.gpu_memory or 0.0)
    out.memory = _memory(a, lay, stages, short, n_f)
    rate = mach.gemm_flops * EFFICIENCY[("cuda", lay.compiled)]  # the step's, for the record (the stages' their own)
    out.moe = moe_terms(a, lay.micro * seq_len / lay.cp, lay.micro_batches, lay.ep, 2, rate, _ep_link(cluster, lay),
                        _expert_recompute(lay.ac, a.n_layers))
    if mach.gpu_memory and out.memory_bytes > mach.gpu_memory:
        out.fits = False
        out.why_not = f"needs {out.memory_bytes / 1e9:.0f} GB of {mach.gpu_memory / 1e9:.0f} GB a GPU"
        return out

    m = lay.micro_batches
    rank_stages = [[s for s in range(len(stages)) if (short.rank_of[s] if short else 0) == r] for r in range(lay.pp)]
    per_rank = [sum(stages[s].forward + stages[s].backward_input + stages[s].backward_weight for s in mine) * m
                for mine in rank_stages]
    busiest = max(range(lay.pp), key=lambda r: per_rank[r])
    comm = {k: sum(getattr(stages[s], f"{k}_s") for s in rank_stages[busiest]) * m for k in ("tp", "cp", "ep")}
    busy = per_rank[busiest]
    bubble = p2p = 0.0
    if short is not None:
        spans = (lay.dp * lay.cp * lay.tp) >= cluster.gpus_per_node  # a stage's ranks fill a node
        bw, lat = ((cluster.inter_node_bytes_s, cluster.inter_latency_s) if spans
                   else (cluster.intra_node_busbw, cluster.intra_latency_s))
        p2p_s = lat + lay.micro * seq_len / lay.cp * a.dim * 2 / lay.tp / bw
        f, bi, bw_ = ([getattr(st, k) for st in stages] for k in ("forward", "backward_input", "backward_weight"))
        if simulate_bubble:
            order = schedule_order(lay.schedule, lay.pp, m, v)
            free = simulate(order, f, bi, bw_)
            timed = simulate(order, f, bi, bw_, p2p_s)
            bubble, p2p = free.step_s - busy, timed.step_s - free.step_s
            out.bubble_share, out.simulated = free.bubble_share, True
        else:
            mid = stages[len(stages) // 2]  # a middle stage's times, a rank's worth
            est = bubble_formula(lay.schedule, lay.pp, m, mid.forward * v, mid.backward_input * v,
                                 mid.backward_weight * v, v)
            if est is None:  # zbv with unequal F, B, W: zb1p's with two stages a rank, close above it
                est = bubble_formula("zb1p", lay.pp, m, mid.forward * v, mid.backward_input * v,
                                     mid.backward_weight * v, 2)
            bubble = est + (busy - per_rank[len(per_rank) // 2])  # the head's stage makes the others wait
            p2p = 2 * (lay.pp * v - 1) * p2p_s
            out.bubble_share = bubble / (busy + bubble)
    params_rank = sum(stages[s].params for s in rank_stages[busiest]) / lay.tp
    link = cluster.inter_node_busbw if lay.dp * lay.cp * lay.tp > cluster.gpus_per_node else cluster.intra_node_busbw
    if lay.pp == 1:
        dims = ParallelDims(world=lay.gpus, cp=lay.cp, tp=lay.tp, ep=lay.ep)
        n_expert, expert_dp = (expert_params(a), dims.expert_dp) if lay.ep > 1 else (0, 1)
        per_micro = fsdp_ep_bytes_per_step(int(params_rank * lay.tp), n_expert, n_f, lay.ep, expert_dp, lay.tp) / link
        fsdp = m * (per_micro / (a.n_layers + 1) + max(0.0, per_micro - busy / m))
    else:
        share = (n_f - 1) / n_f
        gather = 2 * params_rank * share / link
        reduce = 4 * params_rank * share / link
        first_forward = sum(stages[s].forward for s in rank_stages[busiest])
        layers_rank = sum(stages[s].layers for s in rank_stages[busiest])
        fsdp = gather / (layers_rank + 1) + max(0.0, gather - first_forward) + reduce / v
    out.phases = {"compute": busy - sum(comm.values()), **comm, "bubble": bubble, "pp_p2p": p2p, "fsdp": fsdp,
                  "optimizer": params_rank / n_f * DEVICE_ADAMW_S_PER_PARAM["fp32"]}
    out.save_s = (cluster.checkpoint_save_s if cluster.checkpoint_save_s is not None
                  else save_blocking_s(int(params_rank / n_f), 0, False, None, overlap_s=busy))
    mtbf_s = cluster.job_mtbf_hours * 3600
    step = out.step_s
    # One background write at a time (train/checkpointer.py): no interval shorter than a node's write.
    out.write_s = cluster.gpus_per_node * params_rank / n_f * 12 / DISK_BYTES_S
    out.checkpoint_interval_s = max(young_daly_interval_s(out.save_s, mtbf_s), out.write_s)
    if math.isfinite(out.checkpoint_interval_s):
        out.checkpoint_interval_steps = max(1, round(out.checkpoint_interval_s / step))
        out.phases["checkpoint"] = out.save_s / out.checkpoint_interval_steps
        out.goodput_loss = expected_loss_share(out.save_s, out.checkpoint_interval_steps * step, mtbf_s,
                                               cluster.restart_s)
    return out


# --------------------------------------------------------------------------------------------
# The plan


def layouts(a: ModelArgs, cluster: Cluster, seq_len: int, global_batch_tokens: int,
            schedules=SCHEDULE_CHOICES, micro_choices=MICRO_CHOICES, ac_policies=POLICIES) -> list[Layout]:
    """Every layout of the cluster's GPUs for the job: tp within a node, cp within what tp leaves of it, pp with each
    schedule where every stage holds a block, dp the rest; micro-batches that divide a replica's sequences."""
    if global_batch_tokens % seq_len:
        raise ConfigError(f"the global batch ({global_batch_tokens} tokens) is not a whole number of sequences of "
                          f"{seq_len}")
    seqs = global_batch_tokens // seq_len
    n = cluster.gpus
    out = []
    for tp in _tp_sizes(a, cluster.gpus_per_node):
        for cp in _cp_sizes(seq_len, tp, cluster.gpus_per_node):
            for pp in (p for p in range(1, n + 1) if ParallelDims.fits(n, pp=p, cp=cp, tp=tp)):
                dp = ParallelDims(world=n, pp=pp, cp=cp, tp=tp).dp
                if seqs % dp:
                    continue
                per_replica = seqs // dp
                scheds = [("none", 1)] if pp == 1 else [(s, v) for s, v in schedules if pp * v <= a.n_layers]
                eps = expert_parallel_sizes(a, dp) if tp == cp == pp == 1 else [1]
                for (sched, v), micro, ac, ep in itertools.product(scheds, micro_choices, ac_policies, eps):
                    if per_replica % micro:
                        continue
                    m = per_replica // micro
                    if pp > 1:
                        virtual_stages(sched, v)
                        rounds = max(1, m // pp)
                        if m < pp or (sched in ("interleaved", "zb1p") and m % rounds):
                            continue
                    out.append(Layout(dp, tp, cp, pp, sched, v, micro, m, ac, ep=ep))
    return out


def plan_cluster(model_args: ModelArgs, cluster: Cluster | str | Path, seq_len: int, global_batch_tokens: int, *,
                 schedules=SCHEDULE_CHOICES, micro_choices=MICRO_CHOICES, ac_policies=POLICIES, refine: int = REFINE,
                 include_rejected: bool = False) -> list[ClusterCandidate]:
    """Every layout of the job on the cluster (a Cluster, or a cluster file's path) predicted, sorted by step time.
    Each is first timed with the closed-form bubble; the best `refine` are then run through the schedule simulator
    (unequal stages, sends) and the list sorted again. With include_rejected, the layouts that do not fit follow,
    each with why."""
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster)
    if model_args.vocab_size <= 0:
        raise ConfigError("model_args.vocab_size must be set for a cluster plan")
    for sched, v in schedules:
        if sched not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {sched!r} (known: {', '.join(SCHEDULES)})")
    fits, rejected = [], []
    for lay in layouts(model_args, cluster, seq_len, global_batch_tokens, schedules, micro_choices, ac_policies):
        c = evaluate(model_args, cluster, seq_len, lay, simulate_bubble=False)
        (fits if c.fits else rejected).append(c)
    fits.sort(key=lambda c: c.step_s)
    head = [evaluate(model_args, cluster, seq_len, c.layout) if c.layout.pp > 1 else c for c in fits[:refine]]
    fits = sorted(head, key=lambda c: c.step_s) + fits[refine:]
    if include_rejected:
        rejected.sort(key=lambda c: c.memory_bytes)
        return fits + rejected
    return fits
