"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm, head_dim on its own) with a mixture
of experts in place of the feed-forward: a softmax router over num_experts, the top num_experts_per_tok, their
weights renormalized (norm_topk_prob), no shared expert. decoder_sparse_step and mlp_only_layers leave some blocks
dense (intermediate_size wide); the released models have every block MoE. A model trained from scratch may take
DeepSeek-V3's sigmoid router instead (model.router = "sigmoid": balancing by a bias, no auxiliary loss), or keep the
softmax and balance its choice by such a bias (model.router_bias); Hugging Face's Qwen3-MoE has neither, so such a
model does not export."""

from __future__ import annotations

from holotrain.errors import ConfigError
from holotrain.model.args import Family, ModelArgs
from holotrain.model.decoder import build_dense
from holotrain.model.families import hf_int, softmax_router_only


def from_hf(config: dict, where: str) -> dict:
    if config.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window = true is not supported for qwen3_moe (full causal attention)")
    bias = bool(config.get("attention_bias", False))
    experts = "num_experts" if "num_experts" in config else "num_local_experts"
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ConfigError(f"{where}: mlp_only_layers must be a list of layer indices, got {dense!r}")
    return {"qkv_bias": bias, "out_bias": bias, "n_experts": hf_int(config, experts, where),
            "n_active_experts": hf_int(config, "num_experts_per_tok", where),
            "moe_ffn_dim": hf_int(config, "moe_intermediate_size", where),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "moe_every": hf_int(config, "decoder_sparse_step", where, 1), "dense_layers": tuple(dense)}


def to_hf(args: ModelArgs) -> dict:
    softmax_router_only(args, "Qwen3MoeForCausalLM")
    return {"attention_bias": args.qkv_bias, "use_sliding_window": False, "sliding_window": None,
            "num_experts": args.n_experts, "num_experts_per_tok": args.n_active_experts,
            "moe_intermediate_size": args.moe_ffn_dim, "norm_topk_prob": args.norm_topk_prob,
            "decoder_sparse_step": args.moe_every, "mlp_only_layers": list(args.dense_layers),
            "router_aux_loss_coef": args.moe_aux_loss_coef, "output_router_logits": False}


def check(args: ModelArgs) -> str | None:
    if args.qkv_bias != args.out_bias:
        return "model.qkv_bias and model.out_bias differ: Qwen3-MoE's attention_bias covers q, k, v and o together"
    if not args.n_experts:
        return "model.n_experts must be positive for qwen3_moe (a dense Qwen3: model.family = 'qwen3')"
    return None


PRESETS = {
    "tiny": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=688, rope_theta=1e6,
                      norm_eps=1e-6, n_experts=8, n_active_experts=2, moe_ffn_dim=128, norm_topk_prob=True),
    # Qwen3-30B-A3B's shape: 30.5 B parameters, 3.3 B active per token.
    "30b-a3b": ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144,
                         vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, n_experts=128, n_active_experts=8,
                         moe_ffn_dim=768, norm_topk_prob=True),
}

FAMILY = Family(name="qwen3_moe", presets=PRESETS, hf_model_types=("qwen3_moe",), hf_architecture="Qwen3MoeForCausalLM",
                fixed={"qk_norm": True, "mlp_bias": False, "shared_ffn_dim": 0},
                allowed=("qkv_bias", "out_bias", "n_experts", "router", "router_bias"), from_hf=from_hf, to_hf=to_hf,
                build=build_dense, check=check, hf_experts=("mlp", ("gate_proj", "up_proj", "down_proj")))
