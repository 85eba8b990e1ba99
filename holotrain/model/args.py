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

    def __post_init__(self):
        if not self.head_dim and self.n_heads:
            self.head_dim = self.dim // self.n_heads

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


# The decoder's switches a family decides (the rest of ModelArgs is shape).
SWITCHES = ("qkv_bias", "out_bias", "mlp_bias", "qk_norm", "sliding_window")
