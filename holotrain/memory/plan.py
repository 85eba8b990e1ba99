"""The memory plan: which parameters' optimizer work runs on the CPU, how many bytes that puts on the GPU, in
host RAM and in pinned host RAM, before anything is allocated (memory/fit.py turns it into a verdict: a clear error
naming the keys that would make it fit).

Units. The model is cut, in forward order, into units: the parameters before the first block (embedding), each
block of `model.layers`, and the parameters after the last block (final norm, output head). A unit is the
grain of offloading: `memory.offload_ratio` puts the last units (in forward order) on the CPU, because their
gradients arrive first in backward and their weights are needed last by the next forward, which leaves the CPU
the most time to update them. Parameters of fewer than 2 dimensions (norm weights, a few thousand per block)
always stay with the GPU optimizer: they are too small to be worth a transfer.

Bytes per parameter (AdamW, fp32 master weights and moments):
  no offload, GPU      16 (fp32 weight 4, fp32 gradient 4, two moments 8; 4 with memory.adamw_moments = "bf16")
  offloaded, GPU        2 bf16 working weight (one GPU); 4 fp32 shard (FSDP2, divided over the ranks)
  offloaded, host      12 (fp32 master 4, moments 8) + the gradient staging buffer in the working dtype (pinned)
                        + 4 for the fp32 accumulator when one GPU accumulates gradients over micro-batches
Pinned memory (cudaHostAlloc) is physical RAM that cannot be paged out: it counts against host RAM, and
RLIMIT_MEMLOCK does not limit it, so the host check covers it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from holotrain.memory.activation_checkpointing import (attention_kept_blocks, checkpointed_blocks, grouped_gemms_kept,
                                                       pointwise_blocks, pointwise_kept_share, segment_inputs)
from holotrain.model.costs import (block_backward_bytes, block_saved_values, expert_params, moe_pointwise_bytes,
                                   moe_saved_bytes)
from holotrain.parallel.cost import EP_IMBALANCE
from holotrain.model.registry import model_args
from holotrain.precision.lever import FP8_ACTIVATIONS

GPU_USABLE = 0.95  # of free GPU memory: the caching allocator's fixed-size segments lose some to fragmentation
# With expandable segments, which grow in place, far less is lost: the 14B (pointwise, FP8, offload 0.5) peaked at
# 145.8 GB allocated of about 149.6 GB free on an H200, 97.5%.
GPU_USABLE_EXPANDABLE = 0.98
# The long-sequence levers (tiled feed-forwards, block inputs on the host, recompute segments) run where nothing else
# fits, so the plan's own error decides: it was 1.7% low on the 1.4b's step at 1M (an H100). Their choice keeps that
# much more in hand; by the time model one or two more blocks on the host cost nothing (their copies hide under
# backward).
GPU_USABLE_LONG_SEQUENCE = GPU_USABLE_EXPANDABLE - 0.02
HOST_USABLE = 0.90  # of available host RAM: Python, the data plane and CUDA's own host allocations need the rest


def expandable_segments_reason(cfg, environ) -> str | None:
    """Why a CUDA run should use the allocator's expandable segments, or None. A capped GPU (hw.gpu_memory_gb) or an
    offloaded run (memory.offload) works close to its memory limit, where the caching allocator's fixed-size
    segments can lose gigabytes to fragmentation; expandable segments grow in place instead. The user's own
    allocator settings (PYTORCH_CUDA_ALLOC_CONF, or PYTORCH_ALLOC_CONF) are left alone. `cfg.memory`'s
    long-sequence levers count once resolved: the memory plan's trial of each counts on expandable segments."""
    if environ.get("PYTORCH_CUDA_ALLOC_CONF") or environ.get("PYTORCH_ALLOC_CONF"):
        return None
    reasons = []
    if cfg.hw.gpu_memory_gb > 0:
        reasons.append(f"hw.gpu_memory_gb = {cfg.hw.gpu_memory_gb:g}")
    if cfg.memory.offload:
        reasons.append("memory.offload")
    if long_sequence_levers(cfg.memory):
        # The long-sequence levers: tensors of gigabytes each, allocated and freed block after block, which
        # fixed-size segments fragment.
        reasons.append("the long-sequence memory levers")
    return " and ".join(reasons) or None


def gpu_usable_share(cfg, environ=None) -> float:
    """The share of free GPU memory a run of cfg can use: more with expandable segments (holotrain's choice, or the
    user's allocator settings) than with the caching allocator's fixed-size segments, less again with the
    long-sequence levers (GPU_USABLE_LONG_SEQUENCE)."""
    environ = os.environ if environ is None else environ
    conf = environ.get("PYTORCH_CUDA_ALLOC_CONF") or environ.get("PYTORCH_ALLOC_CONF")
    if conf:
        expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
    else:
        expandable = expandable_segments_reason(cfg, environ) is not None
    if not expandable:
        return GPU_USABLE
    return GPU_USABLE_LONG_SEQUENCE if long_sequence_levers(cfg.memory) else GPU_USABLE_EXPANDABLE


def long_sequence_levers(mem) -> bool:
    """Whether the memory section uses a long-sequence lever: feed-forwards tiled, block inputs on the host or
    recompute segments."""
    return mem.ffn_tiles > 1 or mem.activation_offload_blocks > 0 or mem.activation_checkpointing_segment > 1


@dataclass
class Unit:
    """A run of parameters that the next forward needs together; gated as one before its first use."""

    name: str  # "pre", "layers.<i>" or "post"
    index: int  # position in forward order
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)


def model_units(model: nn.Module) -> list[Unit]:
    """The model's parameters in forward order: before the blocks, each block, after the blocks."""
    block_of = {}
    for i, (name, block) in enumerate(model.layers.items()):
        for p in block.parameters():
            block_of[id(p)] = i
    n_blocks = len(model.layers)
    pre = Unit("pre", 0)
    blocks = [Unit(f"layers.{name}", i + 1) for i, name in enumerate(model.layers.keys())]
    post = Unit("post", n_blocks + 1)
    seen_block = False
    for name, p in model.named_parameters():
        if id(p) in block_of:
            blocks[block_of[id(p)]].params.append((name, p))
            seen_block = True
        else:
            (post if seen_block else pre).params.append((name, p))
    return [u for u in [pre, *blocks, post] if u.params]


def offloadable(p: torch.Tensor) -> bool:
    return p.ndim >= 2


def offloaded_units(units: list[Unit], ratio: float) -> set[str]:
    """Names of the units whose optimizer step runs on the CPU: the last ones in forward order, as many as
    come closest to `ratio` of all parameters."""
    total = sum(p.numel() for u in units for _, p in u.params)
    target = ratio * total
    chosen, taken = set(), 0
    for u in reversed(units):
        n = sum(p.numel() for _, p in u.params if offloadable(p))
        if taken + n / 2 > target:
            break
        chosen.add(u.name)
        taken += n
    return chosen


# --------------------------------------------------------------------------------------------
# What is available


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity: a container or taskset may allow fewer than the host has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def process_rss_bytes() -> int | None:
    """Resident memory of this process, or None where /proc cannot say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def host_available_bytes() -> int:
    """RAM this process may still take: MemAvailable, lowered by a cgroup (container) limit if there is one."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            avail = min(avail, int(limit) - usage)
        break
    return max(0, avail)


def gpu_cap_bytes(total_bytes: int, cap_gb: float) -> int:
    """The GPU memory a run may use under hw.gpu_memory_gb = cap_gb (0 = the whole card): never more than the card."""
    if cap_gb <= 0:
        return total_bytes
    return min(total_bytes, int(cap_gb * 1e9))


def gpu_available_bytes(device: torch.device) -> int:
    """Free memory on the GPU, lowered by torch.cuda.set_per_process_memory_fraction where torch reports it."""
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        free = min(free, int(total * fraction(device)) - torch.cuda.memory_reserved(device))
    return max(0, free)


# --------------------------------------------------------------------------------------------
# What is needed


def chunk_tokens(section) -> int:
    """memory.loss_chunk_tokens with auto (0) resolved: 8192 under activation checkpointing (memory first), else 0
    (the whole micro-batch at once). A checkpointing policy still "auto" (chosen when the run starts,
    train/resolve.py) counts as none."""
    n = section.loss_chunk_tokens
    if n == 0 and section.activation_checkpointing not in ("none", "auto"):
        n = 8192
    return n


def loss_chunk_tokens(cfg) -> int:
    return chunk_tokens(cfg.memory)


# The activation model's constants, fitted to peaks measured through `holotrain train` on an H200 (125m, 1.4b, 7B and
# 14B; micro-batches 1-32; every checkpointing policy, on all or some blocks; whole and chunked loss; FP8; offload
# ratios 0-1): tests/test_plan.py holds all 26 within 10%.
SAVED_BYTES = 1.30  # per value a block keeps (7*dim + 2*ffn a token) and element byte: with its backward's buffers
WEIGHT_CAST_BYTES = 2  # per weight of a block that is not recomputed: the bf16 cast of its fp32 weight, kept
LOSS_BYTES = 2.3  # per token and vocabulary entry, the compiled whole loss: bf16 logits kept for backward
EAGER_LOSS_BYTES = 10  # the same in eager mode (or fp32): the logits, their fp32 upcast and its gradient
PIECE_BYTES = 7  # per token and vocabulary entry of one piece of the chunked loss (model/head.py), in fp32
OFFLOADED_ACTIVATIONS = "saved activations of the first blocks (pinned)"  # the host's entry for activation offload


# Terms that grow with the sequence length, not fitted (at T = 2048 they are under 1% of any measured peak) but read off
# the model (model/llama.py) and its kernels:
LSE_BYTES = 4  # per token, head and kept block: the attention kernel's fp32 logsumexp (flash, cuDNN and flex alike)
ROPE_GATHER_BYTES = 8  # per token and head_dim entry: cos and sin gathered per token (fp32) for packed documents
MASK_BLOCK = 128  # flex_attention's block: the BlockMask holds ~4 int32 tensors of [B, T / 128, T / 128]
MASK_TENSORS = 4  # kv_indices, full_kv_indices and their transposes for backward (q_indices, full_q_indices)
RING_GRAD_BYTES = 4  # context parallelism's ring (parallel/cp.py): its dQ and travelling dK/dV are fp32


@dataclass
class Activations:
    """The activation memory of one micro-batch, by when it is held (bytes)."""

    saved: float  # kept from forward to backward: the blocks' activations and weight casts, checkpoints' inputs
    loss: float  # at the loss: the logits (of one piece when chunked) and what the loss keeps for its backward
    recompute: float  # in backward: a block's gradients, one checkpointed block recomputed, and context
    # parallelism's buffers in flight (a ring's K/V and dK/dV, or the all-to-all's head-sharded q/k/v)
    offloaded: float = 0.0  # saved tensors of the first blocks held in host memory instead (activation offload)
    held: float = 0.0  # shared by every block until the end of backward: gathered cos/sin, the document mask
    # Late in backward, beside the recomputed block: the inputs still on the GPU, its own and, with inputs on the host,
    # the copies fetched ahead of it (as many as the blocks the GPU kept, at least one)
    late_inputs: float = 0.0

    @property
    def peak(self) -> float:
        """The most held at once: everything saved, then the larger of the loss (at the end of forward) and the first
        recomputed block (at the start of backward, once the loss's own tensors are freed)."""
        return self.saved + self.held + max(self.loss, self.recompute)


def cp_size(cfg) -> int:
    """parallel.cp: the ranks that split each sequence (1 where the config has no such key)."""
    return max(1, int(getattr(cfg.parallel, "cp", 1) or 1))


def cp_mode(cfg) -> str:
    """parallel.cp_mode with "auto" resolved as the trainer does: all-to-all where the heads of a TP rank (and its kv
    heads) divide by cp, else the ring."""
    mode = getattr(cfg.parallel, "cp_mode", "auto")
    if mode != "auto":
        return mode
    m, cp, tp = cfg.model, cp_size(cfg), cfg.parallel.tp
    return "alltoall" if (m.n_heads // tp) % cp == 0 and (m.n_kv_heads // tp) % cp == 0 else "ring"


def ep_size(cfg) -> int:
    """parallel.ep: the ranks each mixture-of-experts layer's experts are split over (1: none, or no such key)."""
    return max(1, int(getattr(cfg.parallel, "ep", 1) or 1))


def activations(cfg, micro: int, elem_bytes: int, block_weights: int, attention_probs: bool = False) -> Activations:
    """Estimate of one micro-batch's activations on one rank. A block keeps the values per token its family's
    description counts (model/costs.py block_saved_values: 7*dim + 2*ffn for a Llama of equal heads; SAVED_BYTES with
    its backward's buffers), its attention's fp32 logsumexp (heads per token) and the bf16 casts of
    its weights (`block_weights`: the device-resident fp32 weights of all blocks; a bf16 working copy needs no cast); a
    checkpointed block keeps only its input ("all-but-attention": and its attention's output and logsumexp) and one
    at a time is recomputed. FP8 blocks keep FP8_ACTIVATIONS of that
    and no weight casts. With `attention_probs` (a CPU, where the attention is not one fused kernel) a block also keeps
    its attention's probabilities, heads x seq_len values per token, and the micro-batch its dense [B, T, T] document
    mask (the default job's host RSS on 2 cores: within 0.07 GB at six settings); on a GPU the document mask is
    flex_attention's block-sparse one. Under context parallelism (parallel.cp = N) a rank holds T / N tokens of each
    sequence, and its attention has the buffers of its mode in flight. A mixture of experts keeps model/costs.py's
    moe_saved_bytes (counted exactly: no SAVED_BYTES; no FP8), its experts' rows x EP_IMBALANCE under parallel.ep."""
    m, compiled = cfg.model, cfg.training.compile
    seq, cp = cfg.data.seq_len, cp_size(cfg)
    tokens = micro * seq / cp  # this rank's
    args = model_args(m)
    head_dim = args.head_dim
    ac, blocks = cfg.memory.activation_checkpointing, cfg.memory.activation_checkpointing_blocks
    per_block = tokens * elem_bytes * block_saved_values(args) * SAVED_BYTES
    imbalance = EP_IMBALANCE if ep_size(cfg) > 1 else 1.0
    moe = tokens * moe_saved_bytes(args, elem_bytes, compiled, imbalance)
    moe_lean = tokens * moe_pointwise_bytes(args, elem_bytes, grouped_gemms_kept(not attention_probs))
    ffn = m.ffn_dim * (1 - args.moe_layers / m.n_layers)  # the dense feed-forwards' width, over all blocks
    lse = tokens * m.n_heads * LSE_BYTES
    probs = tokens * elem_bytes * m.n_heads * seq if attention_probs else 0.0
    attention_at = set(attention_kept_blocks(ac, m.n_layers, blocks))
    recomputed_at = set(checkpointed_blocks(ac, m.n_layers, blocks)) | attention_at
    lean_at = set(pointwise_blocks(ac, m.n_layers, blocks))
    recomputed, lean = len(recomputed_at), len(lean_at)
    plain = m.n_layers - recomputed - lean
    # Activation offload moves what the first blocks save to the host: all of a plain block's, a checkpointed block's
    # input. A "pointwise" or "all-but-attention" block's kept outputs are its checkpoint's own (eager), which the
    # hooks do not see: kept.
    off_at = set(range(cfg.memory.activation_offload_blocks))
    plain_off, inputs_off = len(off_at - recomputed_at - lean_at), len(off_at & recomputed_at)
    tiles = getattr(cfg.memory, "ffn_tiles", 1)
    tiled = 0.0  # sequence-tiled feed-forwards: per block, the tiles' inputs kept in place of gate and up; backward
    if tiles > 1:  # recomputes one tile's gate, up and product, and makes one tile's gradients of them
        dense = 1 - args.moe_layers / m.n_layers
        per_block -= tokens * elem_bytes * (2 * ffn * SAVED_BYTES - dense * m.dim)
        tiled = tokens * elem_bytes * ffn * (3 / tiles - 2 * (1 - 1 / tiles))
    fp8_on = cfg.training.fp8 != "none"
    # FP8 linears keep their inputs cast; a "pointwise" block recomputes those casts, and the matmuls' outputs it
    # keeps are in the compute dtype: the 14B's peak, FP8 with "pointwise" and with selective, decided it.
    fp8 = FP8_ACTIVATIONS if fp8_on else 1.0
    lean_share = pointwise_kept_share(m.dim, args.q_dim, args.kv_dim, ffn)
    cast = 0 if fp8_on or elem_bytes == 4 else WEIGHT_CAST_BYTES * block_weights / m.n_layers  # one block's
    # The delayed recipe also keeps forward's FP8 transposes for backward: of each distinct linear input (the
    # attention's and the FFN's inputs, the attention output, the SwiGLU product) and of each weight, one byte a
    # value (the 1.4b at micro-batch 8: 5.86 GB of 42.3 measured).
    if cfg.training.fp8 == "delayed":
        cast = tokens * (2 * m.dim + args.q_dim + ffn) + block_weights / m.n_layers

    def kept(n_plain: int, n_lean: int) -> float:
        return (n_plain * ((per_block + probs) * fp8 + moe + lse)
                + n_lean * (per_block * lean_share + moe_lean + probs + lse) + (n_plain + n_lean) * cast)

    offloaded = kept(plain_off, 0) + inputs_off * tokens * elem_bytes * m.dim
    # Segments (memory.activation_checkpointing_segment): every k-th input kept, k - 1 more in flight in backward.
    inputs, in_flight = segment_inputs(recomputed, getattr(cfg.memory, "activation_checkpointing_segment", 1))
    saved = (kept(plain, lean) - offloaded + inputs * tokens * elem_bytes * m.dim
             + len(attention_at) * (tokens * elem_bytes * args.q_dim + lse))
    # Held by every block until the end of backward: cos and sin gathered per token (positions restart per document),
    # and the whole row's document mask, dense on a CPU, block-sparse on a GPU.
    held = tokens * head_dim * ROPE_GATHER_BYTES
    if cp == 1 or cp_mode(cfg) == "alltoall":  # the ring masks each block pair as it comes (cp_buffers)
        held += micro * seq * seq if attention_probs else (
            MASK_TENSORS * 4 * micro * math.ceil(seq / MASK_BLOCK) ** 2)
    chunk = loss_chunk_tokens(cfg)
    if chunk and chunk < tokens:
        # One piece's fp32 logits and their gradient; for the whole micro-batch the gradient of the hidden states
        # (model/head.py computes it in forward, the final norm's included, piece by piece).
        loss = chunk * m.vocab_size * PIECE_BYTES + tokens * m.dim * elem_bytes
    else:
        loss = tokens * m.vocab_size * (LOSS_BYTES if compiled and elem_bytes == 2 else EAGER_LOSS_BYTES)
    # In backward, once the loss's tensors are freed: the gradients a block's backward makes besides what it keeps
    # (of its output, and the FFN's gate and up), on top of one recomputed block when blocks are checkpointed.
    recompute = ((per_block + probs) * fp8 + moe + lse) if recomputed else 0.0
    recompute += (tokens * block_backward_bytes(args, elem_bytes, imbalance) + tiled + cp_buffers(cfg, micro, elem_bytes)
                  + in_flight * tokens * elem_bytes * m.dim)
    late = 0.0
    if recomputed:
        fetched = len(off_at & recomputed_at)
        late = (max(1, min(fetched, m.n_layers - fetched)) if fetched else 1) * tokens * elem_bytes * m.dim
    return Activations(saved, loss, recompute, offloaded, held, late)


def cp_buffers(cfg, micro: int, elem_bytes: int) -> float:
    """Context parallelism's attention buffers in flight during one layer's backward, bytes per rank, as
    parallel/cp.py allocates them. Ring: the stacked K/V of the block at hand and the one arriving, the fp32 dQ, the
    fp32 dK/dV of the block at hand, the one arriving and the one leaving, one block pair's fp32 gradients, and with
    packed documents the pair's dense mask and additive bias ([B, 1, c, c], c = T / 2N). All-to-all: q, k, v and the
    output re-laid as [B, heads / N, T, head_dim] (the whole sequence, 1/N of the heads), each copied twice on the
    way (the send and the receive buffer)."""
    cp = cp_size(cfg)
    if cp == 1:
        return 0.0
    m, tp = cfg.model, cfg.parallel.tp
    head_dim = model_args(m).head_dim
    local = micro * cfg.data.seq_len / cp  # tokens of the micro-batch on this rank
    q = local * m.n_heads / tp * head_dim  # values of this rank's q (or the attention's output)
    kv = local * m.n_kv_heads / tp * head_dim  # values of one of its K, V
    if cp_mode(cfg) == "ring":
        chunk = cfg.data.seq_len / (2 * cp)
        pair = (q + 2 * kv) / 2 * RING_GRAD_BYTES  # one (query chunk, key chunk) pair's gradients, fp32
        masks = micro * chunk * chunk * (1 + elem_bytes)
        return 4 * kv * elem_bytes + q * RING_GRAD_BYTES + 3 * 2 * kv * RING_GRAD_BYTES + pair + masks
    return 2 * (2 * q + 2 * kv) * elem_bytes


@dataclass
class Plan:
    n_params: int
    n_offloaded: int  # parameters whose optimizer step runs on the CPU (all ranks together)
    ratio: float
    gpu: dict[str, float]  # component -> bytes per rank (empty without a GPU)
    host: dict[str, float]  # component -> bytes per rank
    pinned: float
    host_per_param: dict[str, int]  # bytes per offloaded parameter in host memory, by what they hold
    gpu_capacity: float | None
    host_capacity: float
    activations: dict[str, float] = field(default_factory=dict)  # what "activations (estimate)" holds, by part

    @property
    def host_bytes_per_param(self) -> int:
        return sum(self.host_per_param.values())

    @property
    def gpu_need(self) -> float:
        return sum(self.gpu.values())

    @property
    def host_need(self) -> float:
        return sum(self.host.values())

    @property
    def gpu_fits(self) -> bool:
        return self.gpu_capacity is None or self.gpu_need <= self.gpu_capacity

    @property
    def host_fits(self) -> bool:
        return self.host_need <= self.host_capacity


def plan_memory(model: nn.Module, cfg, world_size: int, device: torch.device, micro: int, accum: int,
                ratio: float | None = None, gpu_capacity: float | None = None,
                host_capacity: float | None = None, local_ranks: int | None = None) -> Plan:
    """Bytes per rank that training `model` (built on "meta" is fine) under `cfg` needs, and what is available.
    `local_ranks` (default: all ranks on one node) share the host's memory."""
    mem = cfg.memory
    ratio = mem.offload_ratio if ratio is None else ratio
    units = model_units(model)
    cpu_units = offloaded_units(units, ratio) if mem.offload else set()
    n_total = sum(p.numel() for u in units for _, p in u.params)
    n_cpu = sum(p.numel() for u in units if u.name in cpu_units for _, p in u.params if offloadable(p))
    n_dev = n_total - n_cpu
    # The largest unit FSDP2 gathers (under expert parallelism, of a block's experts this rank's share only).
    experts = {u.name: expert_params(model_args(cfg.model), int(u.name[7:])) for u in units if u.name[:7] == "layers."}
    biggest = max((sum(p.numel() for _, p in u.params) - (1 - 1 / ep_size(cfg)) * experts.get(u.name, 0)
                   for u in units), default=0)
    cuda = device.type == "cuda"
    bf16 = cfg.training.dtype == "bf16" or (cfg.training.dtype == "auto" and cuda)
    elem = 2 if bf16 else 4
    working = 2 if (cuda and world_size == 1 and bf16) else 4  # bytes of an offloaded parameter's working copy
    per_rank = 1 / world_size
    moments = 4 if mem.adamw_moments == "bf16" else 8  # bytes of a device parameter's two AdamW moments
    local_ranks = local_ranks or world_size
    block_weights = sum(p.numel() for u in units if u.name.startswith("layers.") and u.name not in cpu_units
                        for _, p in u.params) * per_rank
    if cuda and bf16 and world_size == 1 and not mem.offload and cfg.training.expert_weight_copies:
        # The experts run on bf16 copies made once a step (model/moe.py ExpertCopies), whose gradients take the
        # place of the fp32 ones while the micro-batches accumulate: no cast of theirs kept per block (the 4-layer
        # Qwen3-30B-A3B shape on an H200: 58.7 GB peak with the copies, 63.5 without).
        block_weights -= sum(experts.values())
    acts = activations(cfg, micro, elem, block_weights, attention_probs=not cuda)
    gathered = 2 * biggest * elem if world_size > 1 else 0  # FSDP2 keeps about two blocks unsharded
    m = cfg.model
    rope = 2 * (m.max_seq_len or cfg.data.seq_len) * model_args(m).head_dim * 4  # the fp32 cos and sin buffers

    host_per_param = {"fp32 master": 4, "AdamW moments": 8, "gradient staging (pinned)" if cuda else "gradient staging": working}
    if accum > 1 and world_size == 1:
        host_per_param["fp32 gradient accumulator"] = 4
    offloaded_host = n_cpu * per_rank * sum(host_per_param.values())
    upload_slots = 2 * biggest * working if mem.offload else 0
    gpu: dict[str, float] = {}
    host: dict[str, float] = {}
    if cuda:
        if n_cpu:
            gpu["working weights of offloaded parameters"] = n_cpu * per_rank * (working if world_size == 1 else 8)
        gpu["fp32 weights and AdamW moments kept on the GPU"] = n_dev * per_rank * (4 + moments)
        # The peak comes at one of two moments: at the loss, with every activation held (and the gradients of
        # the micro-batches before when they accumulate), or at the end of backward, with every gradient.
        grads = n_dev * per_rank * 4
        at_loss = (grads if accum > 1 else 0.0) + acts.peak
        at_end = grads + acts.recompute + acts.held + acts.late_inputs
        if at_loss >= at_end:
            if accum > 1 and grads:
                gpu["fp32 gradients (accumulating)"] = grads
            gpu["activations (estimate)"] = acts.peak
            parts = {"saved by the blocks": acts.saved, "cos/sin and document mask": acts.held}
            parts.update({"the loss": acts.loss} if acts.loss >= acts.recompute else
                         {"recomputed block and attention buffers": acts.recompute})
        else:
            gpu["fp32 gradients"] = grads
            gpu["activations (estimate)"] = acts.recompute + acts.held + acts.late_inputs
            parts = {"recomputed block and attention buffers": acts.recompute, "cos/sin and document mask": acts.held}
            if acts.late_inputs:
                parts["block inputs late in backward"] = acts.late_inputs
        gpu["rotary tables"] = rope
        if gathered:
            gpu["gathered blocks (FSDP2)"] = gathered
        if acts.offloaded:
            host[OFFLOADED_ACTIVATIONS] = acts.offloaded
        if mem.offload:
            gpu["gradients in flight to the host"] = 2 * biggest * working
            host["offloaded masters, moments and staging"] = offloaded_host
            host["upload buffers"] = upload_slots
            if world_size == 1:
                # The model is built in fp32 on the host and handed to the GPU unit by unit: at the start it is
                # all there at once.
                build_peak = 4 * n_total
                if build_peak > offloaded_host + upload_slots:
                    host["model built in fp32 on the host (start-up peak)"] = build_peak - offloaded_host - upload_slots
    else:
        host["weights, gradients and AdamW"] = n_dev * per_rank * (8 + moments)
        host["activations (estimate)"] = acts.peak + acts.offloaded
        host["rotary tables"] = rope
        parts = {"saved by the blocks": acts.saved + acts.offloaded, "cos/sin and document mask": acts.held,
                 "the loss" if acts.loss >= acts.recompute else "recomputed block and attention buffers":
                 max(acts.loss, acts.recompute)}
        if mem.offload:
            host_per_param["working weight"] = working
            host["offloaded masters, moments and staging"] = n_cpu * per_rank * sum(host_per_param.values())
    pinned = 0.0
    if cuda:
        pinned = acts.offloaded + ((n_cpu * per_rank * working + upload_slots) if mem.offload else 0.0)
    if gpu_capacity is None and cuda:
        gpu_capacity = gpu_available_bytes(device) * gpu_usable_share(cfg)
    if host_capacity is None:
        host_capacity = host_available_bytes() / max(1, local_ranks) * HOST_USABLE
    return Plan(n_total, n_cpu, ratio, gpu, host, pinned, host_per_param, gpu_capacity if cuda else None,
                host_capacity, parts)


# --------------------------------------------------------------------------------------------
# The check
