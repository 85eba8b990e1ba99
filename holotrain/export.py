"""`holotrain export RUN_DIR OUT_DIR`: a run's newest checkpoint as a Hugging Face model directory (safetensors,
config.json, the tokenizer), which transformers loads and `model.init_from` reads back bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from holotrain.config import ConfigError, load_config, validate
from holotrain.data.corpus import TOKENIZER_FILES
from holotrain.model import Llama
from holotrain.model.hf import hf_config_dict, to_hf_state_dict
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
    model = Llama(args)
    load_model_weights(ckpt, model)
    model.tie_weights()
    state = {k: v.detach().to(torch.float32).contiguous()
             for k, v in to_hf_state_dict(model.state_dict(), args.tie_embeddings).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_sharded(state, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", *TOKENIZER_FILES):
        if (run_dir / name).is_file():
            shutil.copyfile(run_dir / name, out_dir / name)
    return out_dir


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
