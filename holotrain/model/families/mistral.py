"""Mistral: Llama's decoder where each token attends to at most the last `sliding_window` positions (Mistral 7B
v0.1: 4096; later releases set none), through the block mask every layer shares."""

from __future__ import annotations

from holotrain.errors import ConfigError
from holotrain.model.args import Family, ModelArgs
from holotrain.model.decoder import build_dense


def from_hf(config: dict, where: str) -> dict:
    window = config.get("sliding_window") or 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ConfigError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    return {"sliding_window": window}


def to_hf(args: ModelArgs) -> dict:
    return {"sliding_window": args.sliding_window or None}


PRESETS = {
    "tiny": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, sliding_window=64),
    # Mistral 7B v0.1's shape.
    "7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                    sliding_window=4096),
}

FAMILY = Family(name="mistral", presets=PRESETS, hf_model_types=("mistral",), hf_architecture="MistralForCausalLM",
                fixed={"qkv_bias": False, "out_bias": False, "mlp_bias": False, "qk_norm": False},
                allowed=("sliding_window",), from_hf=from_hf, to_hf=to_hf, build=build_dense)
