"""Mixtral (8x7B, 8x22B): Mistral's decoder (an optional sliding window; the released models set none) with a
mixture of experts in every block: a router over num_local_experts, the top num_experts_per_tok (2) of the logits,
a softmax over those (the softmax over all experts renormalized over the top k), each expert a SwiGLU of
intermediate_size. Router jitter noise (training-time only in transformers) is not applied."""

from __future__ import annotations

from holotrain.model.args import Family, ModelArgs
from holotrain.model.decoder import build_dense
from holotrain.model.families.mistral import from_hf as mistral_from_hf
from holotrain.model.families import hf_int, softmax_router_only


def from_hf(config: dict, where: str) -> dict:
    width = hf_int(config, "intermediate_size", where)
    return {**mistral_from_hf(config, where), "n_experts": hf_int(config, "num_local_experts", where),
            "n_active_experts": hf_int(config, "num_experts_per_tok", where), "moe_ffn_dim": width}


def to_hf(args: ModelArgs) -> dict:
    softmax_router_only(args, "MixtralForCausalLM")
    return {"sliding_window": args.sliding_window or None, "intermediate_size": args.moe_ffn_dim,
            "num_local_experts": args.n_experts, "num_experts_per_tok": args.n_active_experts,
            "router_aux_loss_coef": args.moe_aux_loss_coef, "output_router_logits": False, "router_jitter_noise": 0.0}


def check(args: ModelArgs) -> str | None:
    if not args.n_experts:
        return "model.n_experts must be positive for mixtral (a dense Mistral: model.family = 'mistral')"
    if args.moe_ffn_dim != args.ffn_dim:
        return (f"model.moe_ffn_dim = {args.moe_ffn_dim} differs from model.ffn_dim = {args.ffn_dim}: Mixtral's "
                "intermediate_size is its experts' width (set both)")
    if args.moe_every != 1 or args.dense_layers:
        return "model.moe_every / model.dense_layers: every Mixtral block is a mixture of experts"
    return None


PRESETS = {
    "tiny": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=256, rope_theta=1e6, n_experts=8,
                      n_active_experts=2, moe_ffn_dim=256),
    # Mixtral-8x7B's shape: 46.7 B parameters, 12.9 B active per token.
    "8x7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                      rope_theta=1e6, n_experts=8, n_active_experts=2, moe_ffn_dim=14336),
}

FAMILY = Family(name="mixtral", presets=PRESETS, hf_model_types=("mixtral",), hf_architecture="MixtralForCausalLM",
                fixed={"qkv_bias": False, "out_bias": False, "mlp_bias": False, "qk_norm": False, "router": "softmax",
                       "norm_topk_prob": True, "shared_ffn_dim": 0},
                allowed=("sliding_window", "n_experts", "router_bias"), from_hf=from_hf, to_hf=to_hf, build=build_dense,
                check=check, hf_experts=("block_sparse_moe", ("w1", "w3", "w2")))
