"""`holotrain export RUN_DIR OUT_DIR`: a run's newest checkpoint as a Hugging Face model directory (safetensors,
config.json, generation_config.json, the tokenizer with its tokenizer_config.json), which transformers loads and
generates with, and `model.init_from` reads back bit for bit."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from holotrain.config import ConfigError, load_config, validate
from holotrain.data.chat import end_of_turn, run_template
from holotrain.data.corpus import (
    CHAT_TEMPLATE,
    TOKENIZER_CONFIG,
    TOKENIZER_FILES,
    begin_of_text,
    special_ids,
    tokenizer_config,
)
from holotrain.model import build
from holotrain.model.hf import hf_config_dict, hf_generation_config, to_hf_state_dict
from holotrain.train.checkpoint import latest_checkpoint, load_model_weights
from holotrain.train.trainer import model_args

SHARD_BYTES = 5 * 10**9  # as transformers' save_pretrained: files of at most 5 GB, with an index beside them


def export_hf(run_dir: str | Path, out_dir: str | Path, checkpoint: str | Path | None = None) -> Path:
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.toml)")
    cfg = load_config(config_path)
    validate(cfg)
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if ckpt is None or not ckpt.is_dir():
        raise ConfigError(f"{run_dir} holds no complete checkpoint to export")
    args = model_args(cfg)
    config = hf_config_dict(args)  # an architecture transformers lacks is refused before anything is written
    tokens = RunTokens.of(cfg, run_dir, args.vocab_size)  # and so is a special token outside the vocabulary
    config.update(tokens.config_ids())
    model = build(args)
    load_model_weights(ckpt, model)
    write_model(model, out_dir, config)
    _write_json(out_dir / "generation_config.json",
                hf_generation_config(**tokens.config_ids(), stop_ids=tokens.stop_ids()))
    for name in ("tokenizer.json", *TOKENIZER_FILES):
        if name not in (TOKENIZER_CONFIG, CHAT_TEMPLATE) and (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, out_dir / name)
    # The template goes in tokenizer_config.json; a chat_template.jinja beside it would take precedence in transformers.
    (out_dir / CHAT_TEMPLATE).unlink(missing_ok=True)
    _write_json(out_dir / TOKENIZER_CONFIG, tokens.tokenizer_config(args.max_seq_len))
    if tokens.template and tokens.end_of_turn is None:
        print("holotrain: warning: the chat template ends an assistant turn with no special token of the tokenizer, "
              "so generate() stops only at the end-of-text token", file=sys.stderr)
    return out_dir


def write_model(model: torch.nn.Module, out_dir: Path, config: dict | None = None) -> None:
    """A model as Hugging Face stores one: config.json (`config`, else the family's translation of model.args) and
    its fp32 weights under Hugging Face's names, in safetensors files as save_pretrained shards them."""
    args = model.args
    model.tie_weights()
    state = {k: v.detach().to(torch.float32).contiguous()
             for k, v in to_hf_state_dict(model.state_dict(), args.tie_embeddings).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_sharded(state, out_dir)
    _write_json(out_dir / "config.json", config or hf_config_dict(args))


@dataclass(frozen=True)
class RunTokens:
    """The special tokens a run trained with, as (text, id), and its chat template ("" for none)."""

    base_config: dict  # the tokenizer_config.json the run had (with its chat_template.jinja), {} for none
    bos: tuple[str, int] | None
    eos: tuple[str, int]
    pad: tuple[str, int]
    end_of_turn: tuple[str, int] | None
    template: str
    template_named: bool  # data.chat_template chose the template, not the tokenizer

    @classmethod
    def of(cls, cfg, run_dir: Path, vocab_size: int) -> RunTokens:
        """Read from the run's tokenizer.json and the files beside it, resolved as training resolved them; a
        ConfigError if one of the ids is outside the model's vocabulary (a model that could never emit it)."""
        from tokenizers import Tokenizer

        path = run_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{path}: not found (the run's tokenizer, which the export carries)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ConfigError(f"{path}: cannot load the run's tokenizer ({e})") from None
        eos, pad = special_ids(tokenizer, path)
        bos = begin_of_text(tokenizer, path)
        template = run_template(cfg.data.sources, cfg.data.chat_template, path)
        turn_end = end_of_turn(template, path, tokenizer) if template else None
        named = {"begin-of-text": bos, "end-of-text": eos, "padding": pad, "end-of-turn": turn_end}
        for what, i in named.items():
            if i is not None and not 0 <= i < vocab_size:
                raise ConfigError(f"{path}: the {what} token {tokenizer.id_to_token(i)!r} has id {i}, outside the "
                                  f"model's vocabulary (config.json vocab_size = {vocab_size})")

        def token(i):
            return None if i is None else (tokenizer.id_to_token(i), i)

        return cls(tokenizer_config(path), token(bos), token(eos), token(pad), token(turn_end), template,
                   bool(cfg.data.chat_template))

    def config_ids(self) -> dict:
        """config.json's special ids."""
        return {"bos_token_id": None if self.bos is None else self.bos[1], "eos_token_id": self.eos[1],
                "pad_token_id": self.pad[1]}

    def stop_ids(self) -> list[int]:
        """Where generation ends: the end of the text, and the end of an assistant turn."""
        return list(dict.fromkeys(t[1] for t in (self.eos, self.end_of_turn) if t is not None))

    def tokenizer_config(self, max_len: int) -> dict:
        """tokenizer_config.json: the run's, with the tokens it trained with and its chat template, loaded as a plain
        fast tokenizer of its tokenizer.json."""
        config = dict(self.base_config)
        # Flags that make transformers rebuild the post-processor: the tokenizer.json's own encodes as training did.
        for key in ("add_bos_token", "add_eos_token"):
            config.pop(key, None)
        config.update(tokenizer_class="PreTrainedTokenizerFast", bos_token=None if self.bos is None else self.bos[0],
                      eos_token=self.eos[0], pad_token=self.pad[0], model_max_length=max_len)
        if self.template_named:  # else the tokenizer's own, in the base config already (or none)
            config["chat_template"] = self.template
        return config


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _save_sharded(state: dict[str, torch.Tensor], out_dir: Path) -> None:
    """One model.safetensors, or shards of at most SHARD_BYTES with model.safetensors.index.json."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
