"""Qwen3: Llama's decoder with each head's q and k RMS-normalized before the rotation (q_norm, k_norm over head_dim),
and head_dim set on its own (Qwen3-1.7B: 16 heads of 128 in a width of 2048). attention_bias, off in the released
models, puts biases on q, k, v and o. Qwen3's optional sliding window (use_sliding_window) is not supported."""

from __future__ import annotations

from holotrain.errors import ConfigError
from holotrain.model.args import Family, ModelArgs
from holotrain.model.decoder import build_dense


def from_hf(config: dict, where: str) -> dict:
    if config.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window = true is not supported for qwen3 (full causal attention)")
    bias = bool(config.get("attention_bias", False))
    return {"qkv_bias": bias, "out_bias": bias}


def to_hf(args: ModelArgs) -> dict:
    return {"attention_bias": args.qkv_bias, "use_sliding_window": False, "sliding_window": None}


def check(args: ModelArgs) -> str | None:
    if args.qkv_bias != args.out_bias:
        return "model.qkv_bias and model.out_bias differ: Qwen3's attention_bias covers q, k, v and o together"
    return None


PRESETS = {
    "tiny": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=688, rope_theta=1e6,
                      norm_eps=1e-6, tie_embeddings=True),
    # Qwen3-0.6B's, -1.7B's and -8B's shapes.
    "0.6b": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                      vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True),
    "1.7b": ModelArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144,
                      vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True),
    "8b": ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288,
                    vocab_size=151936, rope_theta=1e6, norm_eps=1e-6),
}

FAMILY = Family(name="qwen3", presets=PRESETS, hf_model_types=("qwen3",), hf_architecture="Qwen3ForCausalLM",
                fixed={"qk_norm": True, "mlp_bias": False}, allowed=("qkv_bias", "out_bias"), from_hf=from_hf,
                to_hf=to_hf, build=build_dense, check=check)
