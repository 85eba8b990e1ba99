"""Small Hugging Face models made locally with transformers (random weights) and saved as a model directory would
be downloaded: config.json, safetensors (sharded where asked), tokenizer.json and tokenizer_config.json."""

import json
from pathlib import Path

import torch

# Models of the four families, small enough for the CPU.
KINDS = {
    # Llama with Llama 3.1's rope scaling, multi-head attention, untied head; saved in shards.
    "llama": dict(model_type="llama", num_key_value_heads=4, tie_word_embeddings=False, rope_theta=50000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    # Grouped-query attention with the head tied to the embedding (Llama 3.2 1B/3B's layout), linear rope scaling.
    "gqa_tied": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True, rope_theta=10000.0,
                     rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # Qwen2: biases on q/k/v, tied head, rope_theta 1e6, YaRN (Qwen2.5's long-context setting).
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    # Llama 3.2 1B/3B's layout: grouped-query attention, the head tied to the embedding, Llama 3's rope scaling.
    "llama3.2": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=256,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # Qwen2.5: biases on q/k/v, grouped-query attention, untied head.
    "qwen2.5": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6,
                    max_position_embeddings=256),
    # Qwen3: q/k RMSNorm, head_dim 64 set on its own (8 heads of 64 in a width of 256), tied head.
    "qwen3": dict(model_type="qwen3", hidden_size=256, num_attention_heads=8, head_dim=64, num_key_value_heads=4,
                  tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=256),
    # Mistral: attention to the last 64 positions only (seen at T = 256).
    "mistral": dict(model_type="mistral", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                    sliding_window=64, max_position_embeddings=256),
}
VOCAB = 320


def make_tokenizer(directory: Path) -> None:
    """A byte-level BPE with a Llama-style begin/end of text, and its tokenizer_config.json (a chatml template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n", "the quick brown fox jumps over the lazy dog"] * 20,
                            trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(directory / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}))


def make_hf_model(directory: Path, kind: str, seed: int = 0, shard: bool = False):
    """Saves a random model of `kind` into `directory`; returns the transformers model (fp32, eval mode)."""
    import transformers

    spec = dict(KINDS[kind])
    model_type = spec.pop("model_type")
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[model_type]
    shape = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                 max_position_embeddings=64, rms_norm_eps=1e-5)
    config = config_class(**{**shape, **spec})
    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                   "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM}[model_type]
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():  # random non-trivial norms and biases, so a missed one shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, max_shard_size="100KB" if shard else "1GB")
    make_tokenizer(directory)
    return model
