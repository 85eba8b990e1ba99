"""The config's [model] section: the model's family, preset and dimensions, and the checks on its own keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from holotrain.model.moe import BIAS_UPDATES
from holotrain.section import Section, need


@dataclass
class ModelConfig(Section):
    # The model family (model/registry.py): llama | qwen2 | qwen3 | mistral | qwen3_moe | mixtral. Empty:
    # model.init_from's, else llama.
    family: str = ""
    preset: str = "tiny"  # one of the family's shapes (holotrain train --help model lists them)
    # 0 / 0.0 means "take the preset's value"; the resolved config holds the real numbers.
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0  # 0: the preset's, else dim / n_heads
    ffn_dim: int = 0
    vocab_size: int = 0  # tiny preset: 0 = the tokenizer's vocabulary, rounded up to a multiple of 64
    max_seq_len: int = 0  # 0 = data.seq_len
    rope_theta: float = 0.0
    rope_scaling: dict = field(default_factory=dict)  # {} = none; {rope_type = "llama3" | "linear", factor, ...}
    norm_eps: float = 0.0
    tie_embeddings: bool = False  # the head shares the embedding's weight
    # Switches a family fixes or allows (model/families): biases on q/k/v, on the attention output and on the MLP
    # (Llama's attention_bias / mlp_bias), RMSNorm over each head's q and k (qwen3), and attention to at most the last
    # sliding_window positions (mistral; 0 = the whole causal prefix).
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int = 0
    # Mixture of experts (qwen3_moe, mixtral; model/moe.py): n_experts routed experts per MoE block (0 = dense),
    # n_active_experts of them per token, each a SwiGLU of moe_ffn_dim; a shared SwiGLU of shared_ffn_dim (0 = none);
    # router "softmax" | "sigmoid" (biased choice, DeepSeek-V3); norm_topk_prob renormalizes the k weights; blocks
    # (i + 1) % moe_every == 0 not in dense_layers are MoE (0 / [] = the preset's); the load-balancing and router
    # z-loss coefficients (0 = none) add those losses to the training gradient.
    n_experts: int = 0
    n_active_experts: int = 0
    moe_ffn_dim: int = 0
    shared_ffn_dim: int = 0
    router: str = ""
    # A softmax router also chooses by its logits + a per-expert balancing bias (the sigmoid router always has one).
    router_bias: bool = False
    # With router_bias on a softmax router: the chosen experts weighted by the softmax of the biased logits (false:
    # by the unbiased softmax's, as DeepSeek-V3 weights by its unbiased scores), so the balanced choice shapes the
    # block's output too.
    router_bias_weights: bool = False
    norm_topk_prob: bool = False
    moe_every: int = 0
    dense_layers: list = field(default_factory=list)
    moe_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # The balancing bias's rate (DeepSeek-V3's gamma, 1e-3 there): after each optimizer step the trainer moves each
    # expert's bias by this toward balance, from the step's load over all micro-batches and ranks.
    router_bias_rate: float = 1e-3
    # How the balancing bias moves: "sign" (DeepSeek-V3's, by router_bias_rate, after each step), "solve": after each
    # step, set to the bias that would have balanced that step's routing (train/routing.py), for short runs whose
    # routers' inputs shift faster than the rate follows; or "batch": solved within each training forward on its own
    # tokens, so that each micro-batch's load is balanced (a token's experts then depend on its batch, as in BASE
    # layers); evaluation and generation route with the last step's solution.
    router_bias_update: str = "sign"
    # A Hugging Face model directory or a holotrain run / checkpoint: the dimensions, weights and tokenizer come
    # from it (model/pretrained.py); a new run starts from its weights with a fresh optimizer. A relative path in a
    # TOML file is relative to the file's folder (as every input path there), on the command line to the current one.
    init_from: str = ""

    def __setattr__(self, name: str, value) -> None:
        # ModelArgs holds block indices as a tuple (hashable); the config as TOML reads them back, a list.
        if name == "dense_layers" and isinstance(value, tuple):
            value = list(value)
        super().__setattr__(name, value)

    def check(self) -> None:
        """The dimensions once filled in from the preset (config.resolve)."""
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len"):
            need(getattr(self, key) > 0, f"model.{key} must be positive, got {getattr(self, key)}")
        # 0 until the tokenizer is known (config_checks checks it against the tokenizer's vocabulary then).
        need(self.vocab_size >= 0, f"model.vocab_size must be positive, got {self.vocab_size}")
        need(self.head_dim % 2 == 0, f"model.head_dim = {self.head_dim} must be even for RoPE")
        need(self.sliding_window >= 0, f"model.sliding_window must be >= 0 (0 = none), got {self.sliding_window}")
        need(self.n_heads % self.n_kv_heads == 0,
             f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}")
        need(self.rope_theta > 0, f"model.rope_theta must be positive, got {self.rope_theta}")
        if self.rope_scaling:
            from holotrain.model.hf import rope_settings

            # Raises a ConfigError naming the key.
            rope_settings({"rope_scaling": self.rope_scaling}, "model.rope_scaling")
        need(self.norm_eps > 0, f"model.norm_eps must be positive, got {self.norm_eps}")
        need(self.router_bias_rate >= 0,
             f"model.router_bias_rate must be >= 0 (0: a fixed bias), got {self.router_bias_rate}")
        need(self.router_bias_update in BIAS_UPDATES,
             f"model.router_bias_update must be one of {', '.join(BIAS_UPDATES)}, got {self.router_bias_update!r}")
