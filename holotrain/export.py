"""`holotrain export RUN_DIR OUT_DIR`: a run's newest checkpoint as Hugging Face safetensors + config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from holotrain.config import ConfigError, load_config, validate
from holotrain.model import Llama
from holotrain.model.hf import hf_config_dict, to_hf_state_dict
from holotrain.train.checkpoint import latest_checkpoint, load_model_weights
from holotrain.train.trainer import model_args


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
    model = Llama(args)
    load_model_weights(ckpt, model)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in to_hf_state_dict(model.state_dict()).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config_dict(args), indent=2) + "\n")
    tokenizer = run_dir / "tokenizer.json"
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    return out_dir
