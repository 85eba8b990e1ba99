"""Name and config mapping between holotrain's Llama and Hugging Face's LlamaForCausalLM."""

from __future__ import annotations

import re

import torch

from holotrain.model.llama import LlamaArgs

_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def to_hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def to_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {to_hf_name(k): v for k, v in state.items()}


def from_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    inverse = {}
    for k, v in state.items():
        if k in {hf for hf in _TOP_NAMES.values()}:
            inverse[next(o for o, hf in _TOP_NAMES.items() if hf == k)] = v
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", k)
        ours = next((o for o, hf in _LAYER_NAMES.items() if m and hf == m.group(2)), None)
        if ours is None:
            raise KeyError(f"unexpected Hugging Face parameter {k!r}")
        inverse[f"layers.{m.group(1)}.{ours}.weight"] = v
    return inverse


def hf_config_dict(args: LlamaArgs, dtype: str = "float32") -> dict:
    """A config.json for transformers.LlamaForCausalLM describing the same network."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
