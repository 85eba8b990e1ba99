"""Llama (2, 3, 3.1 with its rope scaling, 3.2 with the head tied to the embedding): the plain pre-norm decoder with
grouped-query attention, rotary positions and a SwiGLU feed-forward. Some checkpoints carry biases on the attention
(attention_bias: q, k, v and o) or the MLP (mlp_bias)."""

from __future__ import annotations

from holotrain.model.args import Family, ModelArgs
from holotrain.model.decoder import build_dense


def from_hf(config: dict, where: str) -> dict:
    bias = bool(config.get("attention_bias", False))
    return {"qkv_bias": bias, "out_bias": bias, "mlp_bias": bool(config.get("mlp_bias", False))}


def to_hf(args: ModelArgs) -> dict:
    return {"attention_bias": args.qkv_bias, "mlp_bias": args.mlp_bias}


def check(args: ModelArgs) -> str | None:
    if args.qkv_bias != args.out_bias:
        return ("model.qkv_bias and model.out_bias differ: a Llama's attention_bias covers q, k, v and o together "
                "(biases on q, k and v alone: model.family = 'qwen2')")
    return None


PRESETS = {
    "tiny": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688),
    "125m": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048, vocab_size=32000),
    "1.4b": ModelArgs(dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, ffn_dim=5632, vocab_size=32000),
    "7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000),
    "14b": ModelArgs(dim=5120, n_layers=44, n_heads=40, n_kv_heads=40, ffn_dim=13824, vocab_size=32000),
    # Llama 3 8B's shape.
    "8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                    rope_theta=500000.0),
}

FAMILY = Family(name="llama", presets=PRESETS, hf_model_types=("llama",), hf_architecture="LlamaForCausalLM",
                allowed=("qkv_bias", "out_bias", "mlp_bias"), from_hf=from_hf, to_hf=to_hf, build=build_dense,
                check=check)
