"""Name and config mapping between holotrain's decoder and Hugging Face's models of the registered families
(LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM):
parameter names, and config.json both ways: the keys every family shares here, each family's own in its module
(model/families).

A mixture-of-experts block's stacked expert weights (model/moe.py: w1, w3 [E, F, D], w2 [E, D, F]) are several
tensors in a checkpoint, each a `Piece` of one of ours. Read: per expert, as transformers saves them and the Hub's
checkpoints hold them (`<block>.experts.<e>.{gate_proj,up_proj,down_proj}.weight`, Mixtral's
`block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`, <block> mlp or block_sparse_moe), or fused as transformers 5 holds
them in memory (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]); the router is
`<block>.gate.weight`. Written: the family's per-expert layout (to_hf_state_dict with the family), else the fused
one, which transformers 5 loads for either family."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from holotrain.errors import ConfigError
from holotrain.model.args import ModelArgs
from holotrain.model.registry import family_for_hf, family_of
from holotrain.model.rope import ROPE_TYPES

_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
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
# YaRN's settings that have defaults (Hugging Face's names).
YARN_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")
_FROM_HF_LAYER = {hf: ours for ours, hf in _LAYER_NAMES.items()}
_FROM_HF_TOP = {hf: ours for ours, hf in _TOP_NAMES.items()}
# A mixture-of-experts feed-forward's tensors of one to one names (ours after "feed_forward.", theirs after the
# block's module), the shared experts as DeepSeek names them.
_MOE_NAMES = {"router.weight": "gate.weight", "expert_bias": "gate.e_score_correction_bias",
              "shared.w1.weight": "shared_experts.gate_proj.weight", "shared.w3.weight": "shared_experts.up_proj.weight",
              "shared.w2.weight": "shared_experts.down_proj.weight"}
_FROM_HF_MOE = {hf: ours for ours, hf in _MOE_NAMES.items()}
# Each expert's linears (either spelling) -> our stacked parameter.
_EXPERT_LINEARS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
FUSED = ("mlp", ("gate_up_proj", "down_proj"))  # transformers 5's in-memory layout of the experts
_HF_MOE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)")
_OUR_MOE = re.compile(r"layers\.(\d+)\.feed_forward\.(router\.weight|expert_bias|shared\.w[123]\.weight|w[123])")


@dataclass(frozen=True)
class Piece:
    """Where one of our tensors (`ours`), or part of it, lies in a checkpoint: the tensor `hf` is all of it, or (expert
    set) its [expert] slice, or (half set) rows [half * F, (half + 1) * F) of its dimension 1 (a fused gate_up tensor
    holding w1's F rows then w3's)."""

    ours: str
    hf: str
    expert: int | None = None
    half: int | None = None

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint tensor's shape for our tensor of `shape`."""
        if self.expert is not None:
            return tuple(shape[1:])
        if self.half is not None:
            return (shape[0], 2 * shape[1], *shape[2:])
        return tuple(shape)


def hf_pieces(name: str) -> list[Piece]:
    """What the checkpoint tensor `name` holds of ours (a KeyError if nothing)."""
    try:
        return [Piece(from_hf_name(name), name)]
    except KeyError:
        pass
    m = _HF_MOE.fullmatch(name)
    if m:
        prefix, rest = f"layers.{m.group(1)}.feed_forward.", m.group(2)
        if rest in _FROM_HF_MOE:
            return [Piece(prefix + _FROM_HF_MOE[rest], name)]
        e = re.fullmatch(r"experts\.(\d+)\.(\w+)\.weight", rest)
        if e and e.group(2) in _EXPERT_LINEARS:
            return [Piece(prefix + _EXPERT_LINEARS[e.group(2)], name, expert=int(e.group(1)))]
        if rest == "experts.gate_up_proj":
            return [Piece(prefix + "w1", name, half=0), Piece(prefix + "w3", name, half=1)]
        if rest == "experts.down_proj":
            return [Piece(prefix + "w2", name)]
    raise KeyError(f"unexpected Hugging Face parameter {name!r}")

def _rename(name: str, top: dict, layer: dict, source: str, target: str) -> str | None:
    """A parameter name in the other convention: top-level names by `top`, block names by `layer` (the block's
    prefix `source` becoming `target`); None if it has none."""
    if name in top:
        return top[name]
    m = re.fullmatch(rf"{re.escape(source)}(\d+)\.(.+)\.(weight|bias)", name)
    if not m or m.group(2) not in layer:
        return None
    return f"{target}{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"


def to_hf_name(name: str) -> str:
    hf = _rename(name, _TOP_NAMES, _LAYER_NAMES, "layers.", "model.layers.")
    if hf is None:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return hf


def from_hf_name(name: str) -> str:
    ours = _rename(name, _FROM_HF_TOP, _FROM_HF_LAYER, "model.layers.", "layers.")
    if ours is None:
        raise KeyError(f"unexpected Hugging Face parameter {name!r}")
    return ours


def to_hf_state_dict(state: dict[str, torch.Tensor], tie_embeddings: bool = False,
                     family: str | None = None) -> dict[str, torch.Tensor]:
    """Our state dict under Hugging Face's names; a tied head is stored once, as the embedding (as transformers
    saves it). Mixture-of-experts weights: per expert as `family` names them (transformers' save_pretrained
    layout), or without a family transformers 5's fused tensors (loaded by its Qwen3-MoE and Mixtral alike). The
    per-expert tensors are copies (safetensors stores no shared memory)."""
    block, linears = (family_of(family).hf_experts or FUSED) if family else FUSED
    out = {}
    for k, v in state.items():
        if tie_embeddings and k == "output.weight":
            continue
        m = _OUR_MOE.fullmatch(k)
        if m is None:
            out[to_hf_name(k)] = v
            continue
        prefix, ours = f"model.layers.{m.group(1)}.{block}.", m.group(2)
        if ours in _MOE_NAMES:
            out[prefix + _MOE_NAMES[ours]] = v
        elif (block, linears) != FUSED:
            name = linears[("w1", "w3", "w2").index(ours)]
            out.update({f"{prefix}experts.{e}.{name}.weight": v[e].clone() for e in range(v.shape[0])})
        elif ours == "w1":
            out[prefix + "experts.gate_up_proj"] = torch.cat([v, state[k[:-2] + "w3"]], dim=1)
        elif ours == "w2":
            out[prefix + "experts.down_proj"] = v
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict under our names, per-expert or fused expert tensors stacked or split into ours."""
    out, experts = {}, {}
    for k, v in state.items():
        for piece in hf_pieces(k):
            if piece.expert is not None:
                experts.setdefault(piece.ours, {})[piece.expert] = v
            elif piece.half is not None:
                out[piece.ours] = v.chunk(2, dim=1)[piece.half]
            else:
                out[piece.ours] = v
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    return out


# --------------------------------------------------------------------------------------------------------
# config.json -> model section


def model_fields_from_hf(config: dict, where: str) -> dict:
    """The `model.*` values (ModelArgs fields) of a Hugging Face config.json, or a ConfigError naming the key that
    holotrain cannot run as it says. `where`: the file, for the message."""
    family = family_for_hf(config.get("model_type"), where)

    def need(key: str, kind=int, default=None):
        value = config.get(key, default)
        if value is None or isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(f"{where}: {key} must be {'a number' if kind is not int else 'an integer'}, "
                              f"got {value!r}")
        return value

    dim, n_heads = need("hidden_size"), need("num_attention_heads")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (SwiGLU with silu only)")
    theta, scaling = rope_settings(config, where)
    fields = {
        "family": family.name,
        "dim": dim,
        "n_layers": need("num_hidden_layers"),
        "n_heads": n_heads,
        "n_kv_heads": need("num_key_value_heads", default=n_heads),
        "head_dim": config.get("head_dim") or dim // n_heads,
        "ffn_dim": need("intermediate_size"),
        "vocab_size": need("vocab_size"),
        "max_seq_len": need("max_position_embeddings", default=2048),
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "norm_eps": float(need("rms_norm_eps", (int, float), 1e-6)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "qkv_bias": False, "out_bias": False, "mlp_bias": False, "qk_norm": False, "sliding_window": 0,
        # Dense unless the family's from_hf says otherwise (the loss coefficients are the run's, not the model's).
        "n_experts": 0, "n_active_experts": 0, "moe_ffn_dim": 0, "shared_ffn_dim": 0, "router": "softmax",
        "norm_topk_prob": False, "moe_every": 1, "dense_layers": (),
    }
    fields.update(family.from_hf(config, where))
    fields.update(family.fixed)
    return fields


def rope_settings(config: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, scaling) from either spelling: transformers 5's rope_parameters, or rope_theta + rope_scaling."""
    params = dict(config.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
    if not params:
        params = dict(config.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    keys = {"default": (), "linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[kind]
    missing = [k for k in keys if not isinstance(params.get(k), (int, float))]
    if missing:
        raise ConfigError(f"{where}: rope scaling {kind!r} needs {', '.join(missing)}")
    optional = YARN_OPTIONAL if kind == "yarn" else ()
    kept = {k: params[k] for k in keys + optional if params.get(k) is not None}
    return theta, ({"rope_type": kind, **kept} if kind != "default" else {})


# --------------------------------------------------------------------------------------------------------
# model section -> config.json


def hf_config_dict(args: ModelArgs, dtype: str = "float32") -> dict:
    """A config.json that transformers loads as the same network, of the family's architecture. Rope scaling is
    written in both spellings (transformers 4's rope_scaling, 5's rope_parameters)."""
    family = family_of(args.family)
    model_type = family.hf_model_types[0]
    scaling = dict(args.rope_scaling) if args.rope_scaling else None
    config = {
        "architectures": [family.hf_architecture],
        "model_type": model_type,
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
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": args.rope_theta},
        "hidden_act": "silu",
        "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    config.update(family.to_hf(args))
    return config


def hf_generation_config(bos_token_id: int | None, eos_token_id: int, pad_token_id: int, stop_ids: list[int]) -> dict:
    """generation_config.json: greedy decoding that ends at any of `stop_ids` (the end-of-text `eos_token_id` and a
    chat template's end of an assistant turn), so that generate() with no arguments answers one turn and stops."""
    assert eos_token_id in stop_ids
    return {
        "bos_token_id": bos_token_id,
        "eos_token_id": stop_ids[0] if len(stop_ids) == 1 else stop_ids,
        "pad_token_id": pad_token_id,
        "do_sample": False,
    }
