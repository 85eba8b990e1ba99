"""The arguments every family's model is built from, and what a family declares (model/registry.py holds them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable



@dataclass
class ModelArgs:
    family: str = "llama"
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 0  # 0: dim / n_heads (Qwen3 and Mistral-Nemo set it on its own)
    ffn_dim: int = 688
    vocab_size: int = 0  # 0: taken from the tokenizer
    max_seq_len: int = 0  # 0: taken from data.seq_len
    rope_theta: float = 10000.0
    # Context extension, as Hugging Face's rope_scaling / rope_parameters: {} (none), {"rope_type": "linear",
    # "factor": f}, {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} (Llama 3.1) or {"rope_type": "yarn", ...}.
    rope_scaling: dict = field(default_factory=dict)
    norm_eps: float = 1e-5
    # Switches of the shared decoder that families set (model/families): the head sharing the embedding's weight
    # (Llama 3.2 1B/3B, small Qwen), biases on q/k/v (Qwen2), on the attention output (Llama's attention_bias) and on
    # the MLP's linears (mlp_bias), RMSNorm over each head's q and k (Qwen3), and attention to at most the last
    # sliding_window positions (Mistral; 0: the whole causal prefix).
    tie_embeddings: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0
    # Mixture of experts (model/moe.py), in place of the SwiGLU feed-forward of the blocks moe_layer() names:
    # n_experts routed experts (0: every block dense), n_active_experts of them per token (top-k), each a SwiGLU of
    # moe_ffn_dim; a shared SwiGLU of shared_ffn_dim added to every token's routed output (0: none). router:
    # "softmax" (probabilities over all experts, their top k; norm_topk_prob renormalizes the k weights to sum to 1)
    # or "sigmoid" (DeepSeek-V3: independent scores, the top k chosen by score + a per-expert bias that balances the
    # load without a loss, weighted by the scores). router_bias: a softmax router chooses by its logits + such a bias
    # too (the weights still the softmax's, or with router_bias_weights the softmax of the biased logits: the
    # balanced choice weighted as chosen). router_bias_update: how that bias moves ("sign", "solve" after each
    # step by the trainer; "batch": solved within each training forward, model/moe.py). Blocks
    # (i + 1) % moe_every == 0 and not in dense_layers are MoE (Hugging Face's decoder_sparse_step and
    # mlp_only_layers); the others keep the dense ffn_dim.
    # moe_aux_loss_coef: the load-balancing loss (E * sum_e f_e * P_e per MoE block) and router_z_loss_coef: the
    # router z-loss (mean squared logsumexp of the logits), summed over the blocks, in the training loss's gradient.
    n_experts: int = 0
    n_active_experts: int = 0
    moe_ffn_dim: int = 0
    shared_ffn_dim: int = 0
    router: str = "softmax"
    router_bias: bool = False
    router_bias_update: str = "sign"
    router_bias_weights: bool = False
    norm_topk_prob: bool = False
    moe_every: int = 1
    dense_layers: tuple = ()
    moe_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        if not self.head_dim and self.n_heads:
            self.head_dim = self.dim // self.n_heads
        # A config section (or a run saved before these keys) gives 0 / "" / a list.
        self.router = self.router or "softmax"
        self.router_bias_update = self.router_bias_update or "sign"
        self.moe_every = self.moe_every or 1
        self.dense_layers = tuple(self.dense_layers or ())

    def moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has the mixture-of-experts feed-forward."""
        return bool(self.n_experts) and (layer + 1) % self.moe_every == 0 and layer not in self.dense_layers

    @property
    def moe_layers(self) -> int:
        """How many blocks are mixture-of-experts."""
        return sum(self.moe_layer(i) for i in range(self.n_layers))

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention's output) over all heads."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


FIELDS = tuple(f.name for f in dataclasses.fields(ModelArgs))


@dataclass(frozen=True)
class Family:
    """One model family: what the registry knows of it.

    presets: named shapes (ModelArgs without family and vocabulary where the tokenizer gives it).
    fixed: switches of the decoder this family always has (qwen3: {"qk_norm": True}); a config giving another value
      is refused. allowed: the other switches a model of this family may turn on (a Llama with attention_bias).
    hf_model_types: config.json model_type values imported as this family; hf_architecture: the class transformers
      builds for an export.
    from_hf: config.json -> the family's ModelArgs fields beyond the common ones (model/hf.py reads those).
    to_hf: ModelArgs -> config.json keys beyond the common ones.
    """

    name: str
    presets: dict[str, ModelArgs]
    hf_model_types: tuple[str, ...]
    hf_architecture: str
    fixed: dict = field(default_factory=dict)
    allowed: tuple[str, ...] = ()
    from_hf: Callable[[dict, str], dict] = lambda config, where: {}
    to_hf: Callable[[ModelArgs], dict] = lambda args: {}
    # ModelArgs -> the model (model/decoder.py's Decoder with this family's blocks).
    build: Callable[[ModelArgs], object] = None
    # ModelArgs -> what is wrong with them for this family beyond its switches (one line), or None.
    check: Callable[[ModelArgs], str | None] = lambda args: None
    # A mixture-of-experts family's Hugging Face names in a block (model/hf.py): the feed-forward's module ("mlp",
    # Mixtral's "block_sparse_moe") and each expert's gate, up and down linears, as transformers saves them
    # (per expert: <block>.experts.<e>.<gate>.weight).
    hf_experts: tuple[str, tuple[str, str, str]] | None = None


# The decoder's switches a family decides (the rest of ModelArgs is shape).
SWITCHES = ("qkv_bias", "out_bias", "mlp_bias", "qk_norm", "sliding_window", "n_experts", "shared_ffn_dim",
            "router_bias")
