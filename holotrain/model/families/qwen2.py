"""Qwen2 and Qwen2.5: Llama's decoder with biases on the q, k and v projections (none on o or the MLP), rope theta
1e6, and YaRN for long context. Qwen2's optional sliding window (use_sliding_window) is not supported."""

from __future__ import annotations

from holotrain.errors import ConfigError
from holotrain.model.args import Family, ModelArgs
from holotrain.model.decoder import build_dense


def from_hf(config: dict, where: str) -> dict:
    if config.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window = true is not supported for qwen2 (full causal attention)")
    return {}


def to_hf(args: ModelArgs) -> dict:
    return {"use_sliding_window": False, "sliding_window": None}


PRESETS = {
    "tiny": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, rope_theta=1e6,
                      tie_embeddings=True),
    # Qwen2.5-0.5B's and -1.5B's shapes.
    "0.5b": ModelArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, vocab_size=151936,
                      rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True),
    "1.5b": ModelArgs(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960, vocab_size=151936,
                      rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True),
}

FAMILY = Family(name="qwen2", presets=PRESETS, hf_model_types=("qwen2",), hf_architecture="Qwen2ForCausalLM",
                fixed={"qkv_bias": True, "out_bias": False, "mlp_bias": False}, from_hf=from_hf, to_hf=to_hf,
                build=build_dense)
