"""Rotary position embeddings in the rotate-half layout of Hugging Face's models, with the context extensions they
use (linear, Llama 3.1's, YaRN), shared by every family."""

from __future__ import annotations

import math

import torch


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
