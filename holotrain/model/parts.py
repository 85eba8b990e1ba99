"""The parts every family's decoder is made of: RMSNorm, attention with grouped-query heads (optional q/k RMSNorm,
sliding window, document masks), and the SwiGLU feed-forward. Module layout and numerics follow Hugging Face's
implementations, so that weights map one to one (model/hf.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from holotrain.model.args import ModelArgs
from holotrain.model.rope import apply_rope


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Index of each token within its document, from non-decreasing doc_ids [B, T]: [0,0,1,1,1,2] -> [0,1,0,1,2,0]."""
    idx = torch.arange(doc_ids.shape[-1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # Running maximum of the start indices seen so far = where the current document began.
    return idx - torch.where(starts, idx, 0).cummax(dim=-1).values


def doc_attn_mask(doc_ids: torch.Tensor | None, window: int = 0, length: int = 0,
                  device: torch.device | None = None) -> torch.Tensor:
    """Boolean mask [B, 1, T, T] for SDPA ([1, 1, T, T] without documents), True where a query may attend: causal,
    in the same document, and (window > 0) at most window - 1 positions back."""
    T = doc_ids.shape[-1] if doc_ids is not None else length
    device = doc_ids.device if doc_ids is not None else device
    idx = torch.arange(T, device=device)
    allowed = idx[:, None] >= idx[None, :]
    if window:
        allowed &= idx[:, None] - idx[None, :] < window
    if doc_ids is None:
        return allowed[None, None]
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & allowed)[:, None]


# Compiled on first CUDA use (not at import), so a CPU import compiles nothing.
_flex = _compiled_create_block_mask = None


def doc_block_mask(doc_ids: torch.Tensor | None, window: int = 0, length: int = 0,
                   device: torch.device | None = None) -> BlockMask:
    """The same mask as doc_attn_mask, as flex_attention's block-sparse BlockMask."""
    global _flex, _compiled_create_block_mask
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
        # Compiled, it never materializes the dense [B, T, T] mask.
        _compiled_create_block_mask = torch.compile(create_block_mask, dynamic=False)

    def allowed(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if window:
            keep = keep & (q_idx - kv_idx < window)
        if doc_ids is not None:
            keep = keep & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
        return keep

    if doc_ids is None:
        return _compiled_create_block_mask(allowed, None, None, length, length, device=device)
    B, T = doc_ids.shape
    return _compiled_create_block_mask(allowed, B, None, T, T, device=doc_ids.device)


def attention_mask(doc_ids: torch.Tensor | None, window: int, length: int, device: torch.device):
    """The mask every block of one forward shares: None (plain causal: the kernels' own), a BlockMask on CUDA, a
    boolean SDPA mask elsewhere."""
    if doc_ids is None and not window:
        return None
    if device.type == "cuda":
        return doc_block_mask(doc_ids, window, length, device)
    return doc_attn_mask(doc_ids, window, length, device)


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

    def with_weight(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This norm with `weight` in place of its own (the fused loss differentiates it piece by piece)."""
        return rms_norm(x, weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32 whatever the activation dtype, as the reference implementation does.
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * weight.float()).type_as(x)


class Attention(nn.Module):
    # Linears that read one input, and the method that returns their outputs, for levers that compute them together
    # (parallel/tp.py: one all-gather and one GEMM; precision/delayed.py: one FP8 cast of the input).
    input_group = ("qkv", ("wq", "wk", "wv"))
    output_linear = "wo"  # the linear that writes back into the residual stream

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.q_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.kv_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.kv_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.q_dim, args.dim, bias=args.out_bias)
        # Qwen3: each head's q and k RMS-normalized (one weight of head_dim, shared by the heads) before the rotation.
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | SequenceAttention | None = None, cache=None) -> torch.Tensor:
        """mask: None (plain causal), a boolean SDPA mask [B, 1, T, T], a flex_attention BlockMask, or a
        SequenceAttention (the sequence spread over ranks). cache: generation's keys and values of this layer so far
        (decoder.LayerCache), which these tokens' join; the mask then covers [T, all cached positions]."""
        q, k, v = self.qkv(x)
        # Shapes come from the projections, heads from the weights: under tensor parallelism x holds this
        # rank's share of the tokens, the projections all tokens and this rank's share of the heads.
        B, T = q.shape[:2]
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        if cache is not None:
            k, v = cache.extend(k, v)
        y = mask(q, k, v) if isinstance(mask, SequenceAttention) else attention(q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input projections (parallel/tp.py replaces this with one all-gather fused into one GEMM)."""
        return self.wq(x), self.wk(x), self.wv(x)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    input_group = ("gate_up", ("w1", "w3"))
    output_linear = "w2"

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=args.mlp_bias)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=args.mlp_bias)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=args.mlp_bias)  # down

    sequence_tiles = 1  # > 1: the memory lever's sequence tiling (Decoder.tile_feed_forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_tiles > 1 and torch.is_grad_enabled() and x.shape[-2] >= self.sequence_tiles:
            # Arctic's tiled MLP: each tile of the sequence keeps only its input, and backward recomputes its gate,
            # up and product, so one tile's [tokens / tiles, ffn_dim] tensors are alive at a time, not the sequence's.
            return torch.cat([checkpoint(self.swiglu, tile, use_reentrant=False)
                              for tile in x.chunk(self.sequence_tiles, dim=-2)], dim=-2)
        return self.swiglu(x)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.w2(F.silu(gate) * up)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input projections (parallel/tp.py replaces this with one all-gather fused into one GEMM)."""
        return self.w1(x), self.w3(x)


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + feed_forward(norm(x))."""

    def __init__(self, args: ModelArgs, attention: nn.Module, feed_forward: nn.Module):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | BlockMask | SequenceAttention | None = None, cache=None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache)
        return x + self.feed_forward(self.ffn_norm(x))
