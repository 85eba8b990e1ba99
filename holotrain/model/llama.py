"""A Llama-architecture decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Reads top to bottom. Parallelism, compilation and activation checkpointing are applied from outside;
the module layout and the rotary convention (rotate-half) match Hugging Face's LlamaForCausalLM, so
weights map one to one (see model/hf.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from holotrain.model.head import fused_linear_cross_entropy, piece as head_piece


@dataclass
class LlamaArgs:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 688
    vocab_size: int = 0  # 0: taken from the tokenizer
    max_seq_len: int = 0  # 0: taken from data.seq_len
    rope_theta: float = 10000.0
    # Context extension, as Hugging Face's rope_scaling / rope_parameters: {} (none), {"rope_type": "linear",
    # "factor": f} or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} (Llama 3.1).
    rope_scaling: dict = field(default_factory=dict)
    norm_eps: float = 1e-5
    # Variants of the architecture that pretrained checkpoints use (model/hf.py maps them): the head sharing the
    # embedding's weight (Llama 3.2 1B/3B, small Qwen2), biases on q/k/v (Qwen2), on the attention output
    # (Llama's attention_bias) and on the MLP's linears (Llama's mlp_bias).
    tie_embeddings: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS: dict[str, LlamaArgs] = {
    "tiny": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688),
    "125m": LlamaArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048, vocab_size=32000),
    "1.4b": LlamaArgs(dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, ffn_dim=5632, vocab_size=32000),
    "7b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000),
    "14b": LlamaArgs(dim=5120, n_layers=44, n_heads=40, n_kv_heads=40, ffn_dim=13824, vocab_size=32000),
}


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None,
                     device=None) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies [head_dim / 2], fp32, with the context-extension scaling applied, and the
    factor cos and sin are multiplied by (YaRN's attention temperature; 1 otherwise)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":  # positions divided by the factor
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        # Llama 3.1: long wavelengths (beyond original / low_freq_factor) slowed by the factor, short ones (below
        # original / high_freq_factor) kept, and a smooth blend between the two.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        medium = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    if kind != "default":
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    return inv_freq, 1.0


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as Hugging Face computes it: dimensions that turn fewer than beta_slow times over the
    original context are interpolated (divided by the factor), those that turn more than beta_fast times are kept,
    with a linear ramp between; attention's logits are sharpened by 0.1 ln(factor) + 1 (through cos and sin)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def temperature(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = temperature(factor, m) / temperature(factor, m_all) if m and m_all else temperature(factor)

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.get("beta_fast") or 32), dimension(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None,
                scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq_len, head_dim], fp32, in the rotate-half layout."""
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, scaling, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [T, D] (shared positions) or [B, T, D] (per-token). Rotates pairs (i, i + D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Index of each token within its document, from non-decreasing doc_ids [B, T]: [0,0,1,1,1,2] -> [0,1,0,1,2,0]."""
    idx = torch.arange(doc_ids.shape[-1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # Running maximum of the start indices seen so far = where the current document began.
    return idx - torch.where(starts, idx, 0).cummax(dim=-1).values


def doc_attn_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, 1, T, T] for SDPA, True where a query may attend: causal and in the same document."""
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


# Compiled on first CUDA use (not at import), so a CPU import compiles nothing.
_flex = _compiled_create_block_mask = None


def doc_block_mask(doc_ids: torch.Tensor) -> BlockMask:
    """The same mask as doc_attn_mask, as flex_attention's block-sparse BlockMask."""
    global _flex, _compiled_create_block_mask
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
        # Compiled, it never materializes the dense [B, T, T] mask.
        _compiled_create_block_mask = torch.compile(create_block_mask, dynamic=False)

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    B, T = doc_ids.shape
    return _compiled_create_block_mask(same_doc_causal, B, None, T, T, device=doc_ids.device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
    """Causal attention of q [B, H, T, D] over k, v [B, H_kv, T, D]: plain causal (mask None), a boolean SDPA mask
    [B, 1, T, T], or a flex_attention BlockMask."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, BlockMask):
        return _flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class SequenceAttention:
    """Attention over a sequence whose tokens are spread over several ranks (context parallelism, parallel/cp.py):
    passed to the blocks in place of a mask, and called with this rank's q [B, H, T_local, D], k and v."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32 whatever the activation dtype, as the reference implementation does.
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * weight.float()).type_as(x)


class Attention(nn.Module):
    # Linears that read one input, and the method that returns their outputs, for levers that compute them together
    # (parallel/tp.py: one all-gather and one GEMM; precision/delayed.py: one FP8 cast of the input).
    input_group = ("qkv", ("wq", "wk", "wv"))

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=args.out_bias)


    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        """mask: None (plain causal), a boolean SDPA mask [B, 1, T, T], a flex_attention BlockMask, or a
        SequenceAttention (the sequence spread over ranks)."""
        q, k, v = self.qkv(x)
        # Shapes come from the projections, heads from the weights: under tensor parallelism x holds this
        # rank's share of the tokens, the projections all tokens and this rank's share of the heads.
        B, T = q.shape[:2]
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        y = mask(q, k, v) if isinstance(mask, SequenceAttention) else attention(q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input projections (parallel/tp.py replaces this with one all-gather fused into one GEMM)."""
        return self.wq(x), self.wk(x), self.wv(x)


class FeedForward(nn.Module):
    input_group = ("gate_up", ("w1", "w3"))

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=args.mlp_bias)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=args.mlp_bias)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=args.mlp_bias)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.w2(F.silu(gate) * up)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input projections (parallel/tp.py replaces this with one all-gather fused into one GEMM)."""
        return self.w1(x), self.w3(x)


class Block(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by index keeps names stable when blocks are wrapped or pipelined.
        self.layers = nn.ModuleDict({str(i): Block(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, scaling=args.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.residual_in_autocast_dtype = True
        # How each block is run, for a lever that acts around blocks from outside their compiled code:
        # around_block(index, block, h, cos, sin, mask) (memory/activation_offload.py). None: block(h, ...).
        self.around_block = None
        # > 0: the head and the loss are fused and taken in pieces of this many tokens (see `loss`); loss_piece
        # computes one piece (compiled from outside like the blocks).
        self.loss_chunk_tokens = 0
        self.loss_piece = head_piece
        # Set by parallel/cp.py: splits each sequence over the context-parallel group (`split`). None: whole here.
        self.context_parallel = None
        # Set by parallel/pp.py on a pipeline stage, which holds some of the modules (the others None): forward
        # takes the previous stage's hidden state where it has no embedding, and returns its blocks' output (the
        # pipeline schedule applies `loss` on the last stage).
        self.pipeline_stage = False
        # Set by parallel/tp.py and cp.py: the hidden state between blocks holds 1/sequence_shards of each sequence's
        # tokens (sequence parallelism, context parallelism), as a pipeline stage without the embedding receives it.
        self.sequence_shards = 1
        if not self.output.weight.is_meta:  # a model built on "meta" is initialized after placement
            self.init_weights()

    def tie_weights(self) -> None:
        """With tie_embeddings, the head's weight is the embedding's (one parameter). Called again by levers that
        replace parameters one by one (tensor parallelism, and placement of a model built on "meta" outside FSDP2,
        whose to_empty makes each module's parameter anew)."""
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_rope(self) -> None:
        """The rotary tables (buffers not kept in checkpoints), once the model is placed."""
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope_cos.device,
                               self.args.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, 0.02); projections into the residual stream scaled by 1/sqrt(2 * n_layers).

        Values are drawn on the CPU, each parameter whole from its own generator (seeded by the run's seed and
        the parameter's name), whatever the device or sharding: a model sharded over any number of ranks starts
        from the same weights as a whole one. One generator per parameter lets the draws run on all host cores
        (a 7B is 6.7 G values: about 40 s on one core), a bounded window of them at a time.
        """
        std = 0.02
        residual_std = std / math.sqrt(2 * self.args.n_layers)

        def draw(name: str, p: torch.Tensor) -> torch.Tensor | None:
            """The parameter's values: drawn straight into a whole fp32 parameter on the host (None returned),
            else into a temporary that is returned, to be copied in."""
            in_place = type(p) is nn.Parameter and p.device.type == "cpu" and p.dtype == torch.float32
            full = p.data if in_place else torch.empty(p.shape, dtype=torch.float32)
            if name.endswith("norm.weight"):
                full.fill_(1.0)
            elif name.endswith(".bias"):
                full.zero_()
            else:
                generator = None
                if seed is not None:
                    # The plain model's name: wrappers (activation checkpointing, compile) do not change the weights.
                    plain = name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
                    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(plain.encode())) % 2**63)
                full.normal_(0.0, residual_std if name.endswith(("wo.weight", "w2.weight")) else std,
                             generator=generator)
            return None if in_place else full

        params = list(self.named_parameters())
        workers = max(1, min(torch.get_num_threads(), os.cpu_count() or 1, 32))
        with ThreadPoolExecutor(workers) as pool, _single_threaded_ops():
            pending: deque = deque()
            for name, p in params:
                pending.append((p, pool.submit(draw, name, p)))
                if len(pending) >= 2 * workers:  # bounded: at most 2 x workers whole tensors in flight
                    _copy_drawn(pending.popleft())
            while pending:
                _copy_drawn(pending.popleft())
        self.init_rope()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [B, T] int64 (on a pipeline stage without the embedding: the hidden state [B, T / sequence_shards, dim]). Returns
        logits [B, T, V], or the mean cross-entropy if targets are given (positions where targets are -100 are
        ignored); on a pipeline stage, the hidden state after its blocks.

        doc_ids: optional [B, T] int64, non-decreasing along T, the document of each token in a packed row.
        With it, positions restart at every document and no token attends across documents.
        """
        T = tokens.shape[1] * (1 if self.tok_embeddings is not None else self.sequence_shards)
        weight = None
        if self.context_parallel is not None:
            # This rank's share of the sequence, its positions, and the attention that spans the group.
            tokens, targets, pos, mask, weight = self.context_parallel.split(tokens, targets, doc_ids, T)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        elif doc_ids is None:
            cos, sin, mask = self.rope_cos[:T], self.rope_sin[:T], None
        else:
            pos = doc_positions(doc_ids)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [B, T, D]
            # Built once per forward and shared by every block.
            mask = doc_block_mask(doc_ids) if doc_ids.is_cuda else doc_attn_mask(doc_ids)
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        if self.residual_in_autocast_dtype and torch.is_autocast_enabled(h.device.type):
            # Carry the residual stream in the autocast dtype (bf16), as FSDP2's bf16 parameters do:
            # every norm and residual add then moves half the bytes.
            h = h.to(torch.get_autocast_dtype(h.device.type))
        for i, block in enumerate(self.layers.values()):
            h = block(h, cos, sin, mask) if self.around_block is None else self.around_block(i, block, h, cos, sin, mask)
        if self.pipeline_stage:
            return h
        if targets is None:
            return self.output(self.norm(h))
        loss = self.loss(h, targets)
        # Under context parallelism: this rank's mean, weighted so that the group's gradients average to the
        # sequence's mean over all its targets.
        return loss if weight is None else loss * weight

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and mean cross-entropy (in fp32) over targets other than -100.

        With `loss_chunk_tokens` > 0 and more tokens than that, the head and the cross-entropy are fused and taken
        in pieces of that many tokens (model/head.py): the fp32 logits of only one piece exist at a time, in forward
        and backward, and nothing is recomputed (a 1.4b's micro-batch of 16 x 2048 tokens: ~10 GB less). The
        result is the same mean.
        """
        h, targets = h.flatten(0, 1), targets.flatten(0, 1)
        n = self.loss_chunk_tokens
        if n <= 0 or h.shape[0] <= n:
            total, count = self.loss_sum(h, targets)
        else:
            total, count = fused_linear_cross_entropy(self.norm(h), self.output.weight, targets, n, self.loss_piece)
        # A micro-batch with no target (a chat sample whose assistant turns fall elsewhere) adds zero, not NaN.
        return total / count.clamp(min=1)

    def loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the cross-entropies, number of targets other than -100) of tokens h [N, D]: the unit that is
        compiled into few kernels."""
        logits = self.output(self.norm(h))
        total = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
        return total, (targets != -100).sum()


def _copy_drawn(item) -> None:
    param, future = item
    full = future.result()
    if full is not None:  # None: drawn in place
        _copy_full_into(param, full)


@contextlib.contextmanager
def _single_threaded_ops():
    """Intra-op threads off while a pool of threads does the parallel work (no oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole (unsharded) tensor into a parameter, which may be a DTensor shard (FSDP2)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor and keeps its own slice, no communication.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


def num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    n = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        n -= model.tok_embeddings.weight.numel()
    return n


def flops_per_token(args: LlamaArgs, seq_len: int) -> int:
    """Training (forward + backward) FLOPs per token.

    Matrix multiplies only, counted exactly from the shapes: 6 FLOPs per weight of every linear layer
    (the output head included, the embedding lookup not), plus attention's two T x T products,
    12 * n_layers * dim * seq_len, counted over the full square as PaLM and torchtitan do (the causal
    kernels skip about half of it, so MFU by this convention matches theirs).
    """
    hd = args.head_dim
    attn = args.dim * hd * (2 * args.n_heads + 2 * args.n_kv_heads)
    ffn = 3 * args.dim * args.ffn_dim
    linear = args.n_layers * (attn + ffn) + args.dim * args.vocab_size
    return 6 * linear + 12 * args.n_layers * args.dim * seq_len


def attention_pairs(doc_ids: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | int:
    """Sum over the rows of a micro-batch [B, T] of the squared lengths of their documents (B * T^2 for rows of one
    document each, doc_ids None): the T x T work by the convention of flops_per_token, each document counted as its
    own sequence. A document of n tokens holds positions 0 .. n-1, and the sum of 2 i + 1 over them is n^2."""
    if doc_ids is None:
        return shape[0] * shape[1] ** 2
    return (2 * doc_positions(doc_ids) + 1).sum()


def block_density(doc_ids: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The share of the causal triangle's `block` x `block` blocks (flex_attention's) that the document mask of a
    micro-batch of document ids [B, T] (non-decreasing along T) visits, averaged over its rows (plan/attention.py:
    doc_density's block share), as a tensor on their device: no host synchronization (the trainer reads it at log
    time)."""
    B, T = doc_ids.shape
    n = math.ceil(T / block)
    if T % block:  # padding of the last block: ids above every document's
        pad = doc_ids[:, -1:] + 1 + torch.arange(n * block - T, device=doc_ids.device)
        doc_ids = torch.cat([doc_ids, pad], dim=1)
    blocks = doc_ids.view(B, n, block)
    first, last = blocks[:, :, 0].contiguous(), blocks[:, :, -1].contiguous()
    # Key blocks up to the query block's own that hold its first document (ids never decrease: the key block's last
    # id reaches it).
    reach = torch.searchsorted(last, first)  # per query block, the first key block whose last id >= its first id
    visited = (torch.arange(n, device=doc_ids.device) - reach + 1).sum(dim=1).float()
    return (visited / (n * (n + 1) / 2)).mean()


ATTENTION_FORWARD_SHARE = 2 / 7  # of attention_flops_per_token: forward's 2 of the 7 T x T products


def attention_flops_per_token(args: LlamaArgs, seq_len: int, density: float = 1.0) -> float:
    """Training FLOPs per token of attention's T x T products as the kernels do them (the time model's, not MFU's):
    over the causal triangle only (a token meets seq_len / 2 keys on average), times `density`, the share of that
    triangle the kernel visits (1 for a row of one document; with packed documents about the sum of their squared
    lengths over seq_len squared, counted in the kernel's blocks). Forward runs 2 products (scores, then values),
    backward 5 (flash-style kernels recompute the scores): 7 of 2 * n_heads * head_dim FLOPs per (query, key) pair
    and layer."""
    return 7 * 2 * args.n_layers * args.n_heads * args.head_dim * (seq_len / 2) * density
