"""`holotrain generate`: text from a trained run (its newest intact checkpoint, or a named one) or from a Hugging Face
model directory, continued token by token with a KV cache (model/decoder.py `decode`).

The prompt is encoded as training encoded text (the tokenizer's own special tokens, a pretrained model's
begin-of-text), or, with --chat or --messages, rendered with the model's chat template up to the assistant's turn.
Generation stops at the end-of-text token, at the chat template's end of turn, at --max-new-tokens, or at the model's
context length. Temperature 0 is greedy decoding; otherwise top-k and top-p (nucleus) filtering, then sampling.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from holotrain.errors import ConfigError


@dataclass
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be positive, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")


@dataclass
class Generator:
    """A model ready to continue text, with what encoding and stopping need."""

    model: torch.nn.Module
    tokenizer: object  # tokenizers.Tokenizer
    tokenizer_path: Path
    template: str  # the chat template's source, "" for none
    stop_ids: list[int]
    device: torch.device

    @torch.no_grad()
    def continue_ids(self, ids: list[int], sampling: Sampling) -> list[int]:
        """The new token ids after `ids` (stop token excluded)."""
        from holotrain.model.kvcache import KVCache, TokenSteps, graphable

        sampling.check()
        model, limit = self.model, self.model.args.max_seq_len
        if not ids:
            raise ConfigError("the prompt encodes to no tokens")
        if len(ids) >= limit:
            raise ConfigError(f"the prompt is {len(ids)} tokens; the model's context is {limit}")
        rng = torch.Generator(device="cpu").manual_seed(sampling.seed)
        budget = min(sampling.max_new_tokens, limit - len(ids))
        cache = KVCache(model.args, batch=1, length=len(ids) + budget, device=self.device,
                        dtype=next(model.parameters()).dtype)
        logits = model.decode(torch.tensor([ids], device=self.device), cache)
        steps = TokenSteps(model, cache, graph=graphable(model))
        out: list[int] = []
        for _ in range(budget):
            token = pick(logits[0, -1], sampling, rng)
            if token in self.stop_ids:
                break
            out.append(token)
            if len(out) == budget:
                break
            logits = steps.step(torch.tensor([[token]], device=self.device))
        if steps.fallback:
            print(f"holotrain: generate: {steps.fallback}", file=sys.stderr, flush=True)  # stdout: the text only
        return out

    def encode(self, prompt: str, chat: bool = False, messages: list[dict] | None = None,
               system: str = "") -> list[int]:
        if not chat and messages is None:
            return self.tokenizer.encode(prompt).ids
        if not self.template:
            raise ConfigError("--chat / --messages need a chat template, and this model has none (a run on chat "
                              "data, data.chat_template, or a tokenizer_config.json with chat_template has one)")
        from holotrain.data.chat import ChatTemplate, special_tokens

        if messages is None:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user",
                                                                                        "content": prompt}]
        text = ChatTemplate(self.template, special_tokens(self.tokenizer_path)).render(messages,
                                                                                    add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def __call__(self, prompt: str, sampling: Sampling, **how) -> str:
        return self.tokenizer.decode(self.continue_ids(self.encode(prompt, **how), sampling))


def pick(logits: torch.Tensor, sampling: Sampling, rng: torch.Generator) -> int:
    """The next token from one position's logits [V] (on any device): the argmax at temperature 0 (taken where the
    logits are), else a sample after top-k and top-p filtering of the tempered distribution (on the host, whose
    generator the seed sets)."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits.float().cpu() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.numel():
        kth = logits.topk(sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        drop = probs.cumsum(-1) - probs >= sampling.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=rng))


def load(path: str | Path, checkpoint: str | Path | None = None, device: str = "auto") -> Generator:
    """A Generator of a run directory (its newest intact checkpoint, or `checkpoint`), a checkpoint directory inside
    one, or a Hugging Face model directory."""
    from tokenizers import Tokenizer

    from holotrain.model.pretrained import describe

    directory = Path(path).expanduser()
    if not directory.exists():
        raise ConfigError(f"{path}: no such run or model directory")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    source = describe(directory)
    if source.kind == "hf":
        model = _hf_model(source, dev)
        tokenizer_path = source.tokenizer
        template, stop_ids = _hf_tokens(directory, tokenizer_path)
    else:
        model, tokenizer_path, template, stop_ids = _run_model(source, checkpoint, dev)
    if not Path(tokenizer_path).is_file():
        raise ConfigError(f"{tokenizer_path}: not found (the model's tokenizer)")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    if template:
        from holotrain.data.chat import end_of_turn

        turn_end = end_of_turn(template, tokenizer_path, tokenizer)
        stop_ids = list(dict.fromkeys(stop_ids + ([turn_end] if turn_end is not None else [])))
    return Generator(model.eval(), tokenizer, Path(tokenizer_path), template, stop_ids, dev)


def _placed(args, device: torch.device) -> torch.nn.Module:
    """The model built on "meta" and placed, weights uninitialized (they are read next)."""
    from holotrain.model import build

    with torch.device("meta"):
        model = build(args)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_rope()
    return model


def _hf_model(source, device: torch.device) -> torch.nn.Module:
    from holotrain.model import ModelArgs
    from holotrain.model.pretrained import load_hf_weights

    model = _placed(ModelArgs(**source.fields), device)
    load_hf_weights(model, source)
    return model.to(torch.bfloat16) if device.type == "cuda" else model


def _hf_tokens(directory: Path, tokenizer_path: Path) -> tuple[str, list[int]]:
    """The chat template (tokenizer_config.json's) and the stop ids (generation_config.json's eos_token_id, else
    config.json's) of a Hugging Face directory."""
    from holotrain.data.chat import template_source
    from holotrain.data.corpus import tokenizer_config

    template = template_source("", tokenizer_path) if "chat_template" in tokenizer_config(tokenizer_path) else ""
    stop = None
    for name in ("generation_config.json", "config.json"):
        if (directory / name).is_file():
            stop = json.loads((directory / name).read_text()).get("eos_token_id")
            if stop is not None:
                break
    return template, [stop] if isinstance(stop, int) else list(stop or [])


def _run_model(source, checkpoint, device: torch.device):
    from holotrain.config import load_config
    from holotrain.export import RunTokens
    from holotrain.model import model_args
    from holotrain.train.checkpoint import latest_checkpoint, load_model_weights

    run_dir = source.directory
    cfg = load_config(run_dir / "config.toml")
    args = model_args(cfg.model)
    ckpt = Path(checkpoint) if checkpoint else (source.checkpoint or latest_checkpoint(run_dir))
    if ckpt is None or not Path(ckpt).is_dir():
        raise ConfigError(f"{run_dir} holds no intact checkpoint to generate from")
    model = _placed(args, device)
    load_model_weights(ckpt, model)
    model.tie_weights()
    tokens = RunTokens.of(cfg, run_dir, args.vocab_size)
    model = model.to(torch.bfloat16) if device.type == "cuda" else model
    return model, run_dir / "tokenizer.json", tokens.template, [tokens.eos[1]]
