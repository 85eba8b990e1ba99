"""Starting from pretrained weights: `model.init_from = DIR`.

DIR is a Hugging Face model directory (config.json, model.safetensors or shards with model.safetensors.index.json,
tokenizer.json) of a model of a registered family (model/registry.py), or one of our own runs (a run directory, or one checkpoint in it,
checkpoints/step-N). The model's dimensions come from DIR; the weights are read into the model after it is placed
(sharded by FSDP2 and/or split by tensor parallelism), each rank reading only its own slice of each tensor from the
memory-mapped safetensors files, so that no rank holds a whole 7B-14B model in host memory.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from holotrain.errors import ConfigError
from holotrain.model.args import FIELDS
from holotrain.model.hf import from_hf_name, model_fields_from_hf, to_hf_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Context-extension settings a run may change from the checkpoint's (the given value wins); every other model
# dimension given beside init_from must equal the checkpoint's.
OVERRIDABLE = ("max_seq_len", "rope_theta", "rope_scaling")


@dataclass
class Pretrained:
    """What init_from names: where its weights and tokenizer are, and the model fields it implies."""

    kind: str  # "hf" | "run" (a DCP checkpoint of ours)
    directory: Path
    fields: dict  # ModelArgs fields
    tokenizer: Path  # tokenizer.json
    weight_files: dict[str, Path] = field(default_factory=dict)  # hf: our parameter name -> safetensors file
    checkpoint: Path | None = None  # run: the checkpoint directory (None: the run's newest intact one)


def describe(init_from: str | Path) -> Pretrained:
    """Reads DIR's config (not its weights), or raises one ConfigError naming the file or key at fault."""
    directory = Path(init_from).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"model.init_from: not a directory: {init_from}")
    if (directory / CONFIG).is_file():
        return _describe_hf(directory)
    return _describe_run(directory)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value


def _describe_hf(directory: Path) -> Pretrained:
    config_path = directory / CONFIG
    fields = model_fields_from_hf(_read_json(config_path), str(config_path))
    names = _weight_map(directory)
    wanted = set(expected_names(fields))
    missing = sorted(wanted - set(names), key=_natural)
    if missing:
        raise ConfigError(f"{directory}: the weights lack {missing[0]}"
                          f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} (for {CONFIG}'s shape)")
    files = {ours: names[ours] for ours in wanted}
    return Pretrained("hf", directory, fields, directory / "tokenizer.json", weight_files=files)


def _weight_map(directory: Path) -> dict[str, Path]:
    """Our parameter name -> the safetensors file that holds it (a tied head's lm_head, if stored, is left out)."""
    from safetensors import safe_open

    index = directory / INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{index}: no weight_map")
        hf_files = {name: directory / file for name, file in weight_map.items()}
        for path in sorted(set(hf_files.values())):
            if not path.is_file():
                raise ConfigError(f"{index} names {path.name}, which is missing")
    elif (directory / SINGLE).is_file():
        try:
            with safe_open(str(directory / SINGLE), framework="pt") as f:
                hf_files = {name: directory / SINGLE for name in f.keys()}
        except Exception as e:  # safetensors raises its own error type on a damaged header
            raise ConfigError(f"{directory / SINGLE}: not a readable safetensors file ({e})") from None
    else:
        raise ConfigError(f"{directory}: no {SINGLE} or {INDEX} (only safetensors weights are read)")
    out = {}
    for name, path in hf_files.items():
        if name.endswith("rotary_emb.inv_freq"):  # older exports keep the rotary buffer; it is recomputed
            continue
        try:
            out[from_hf_name(name)] = path
        except KeyError:
            raise ConfigError(f"{path}: unexpected tensor {name!r} for this model family") from None
    return out


def expected_names(fields: dict) -> list[str]:
    """Our parameter names for a model of these fields (a tied head shares the embedding)."""
    names = ["tok_embeddings.weight", "norm.weight"] + ([] if fields["tie_embeddings"] else ["output.weight"])
    for i in range(fields["n_layers"]):
        p = f"layers.{i}."
        names += [p + "attention_norm.weight", p + "ffn_norm.weight"]
        if fields.get("qk_norm"):
            names += [p + "attention.q_norm.weight", p + "attention.k_norm.weight"]
        for lin, bias in (("wq", "qkv_bias"), ("wk", "qkv_bias"), ("wv", "qkv_bias"), ("wo", "out_bias")):
            names += [f"{p}attention.{lin}.weight"] + ([f"{p}attention.{lin}.bias"] if fields[bias] else [])
        for lin in ("w1", "w2", "w3"):
            names += [f"{p}feed_forward.{lin}.weight"] + ([f"{p}feed_forward.{lin}.bias"] if fields["mlp_bias"] else [])
    return names


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _describe_run(directory: Path) -> Pretrained:
    """One of our runs: the run directory (checkpoint None: its newest intact one, which the trainer's checkpoint
    code picks) or a checkpoint directory inside it."""
    run_dir, checkpoint = directory, None
    if re.fullmatch(r"step-\d+", directory.name) and directory.parent.name == "checkpoints":
        run_dir, checkpoint = directory.parent.parent, directory
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise ConfigError(f"model.init_from: {directory} holds neither a Hugging Face {CONFIG} nor a holotrain run "
                          "(config.toml)")
    if checkpoint is None and not any((run_dir / "checkpoints").glob("step-*")):
        raise ConfigError(f"model.init_from: {run_dir} holds no checkpoint")
    try:
        model = tomllib.loads(config_path.read_text()).get("model", {})
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{config_path}: not valid TOML ({e})") from None
    fields = {k: model[k] for k in FIELDS if k in model}
    return Pretrained("run", run_dir, fields, run_dir / "tokenizer.json", checkpoint=checkpoint)


def fill_config(cfg) -> None:
    """The config's model section (and data.tokenizer, if empty) from model.init_from, in place. A resumed run whose
    dimensions are already its own does not need the directory any more."""
    m = cfg.model
    if not Path(m.init_from).expanduser().exists() and m.dim and m.n_layers:
        return
    pretrained = describe(m.init_from)
    apply_fields(m, pretrained)
    if not cfg.data.tokenizer:
        if not pretrained.tokenizer.is_file():
            raise ConfigError(f"model.init_from: {pretrained.tokenizer} is missing; set data.tokenizer to the "
                              "model's tokenizer.json")
        cfg.data.tokenizer = str(pretrained.tokenizer)


def apply_fields(model_section, pretrained: Pretrained) -> None:
    """Fills the `model` section from the checkpoint's fields, in place; a dimension given that differs is one
    ConfigError naming the key (context-extension settings, OVERRIDABLE, may differ: the given value wins)."""
    for key, value in pretrained.fields.items():
        given = getattr(model_section, key)
        if not given:  # 0, 0.0, False, {}: not given
            setattr(model_section, key, value)
        elif given != value and key not in OVERRIDABLE:
            raise ConfigError(f"model.{key} = {given!r} differs from model.init_from's {value!r} "
                              f"({pretrained.directory}); leave model.{key} unset")


# --------------------------------------------------------------------------------------------------------
# Loading


@torch.no_grad()
def load_hf_weights(model: nn.Module, pretrained: Pretrained) -> int:
    """Copies the checkpoint's tensors into the placed model's parameters (plain tensors or DTensor shards), each
    rank reading only its slice; returns the bytes read. Files are opened one at a time (memory-mapped), so host
    memory holds at most one file's touched pages and one tensor slice."""
    from safetensors import safe_open

    params = dict(_plain_names(model))
    by_file: dict[Path, list[str]] = {}
    for name in params:
        if name not in pretrained.weight_files:
            raise ConfigError(f"{pretrained.directory}: the weights lack {to_hf_name(name)}")
        by_file.setdefault(pretrained.weight_files[name], []).append(name)
    read = 0
    for path in sorted(by_file):
        with safe_open(str(path), framework="pt") as f:
            for name in by_file[path]:
                read += _copy_slice(params[name], f.get_slice(to_hf_name(name)), name, path)
        _drop_from_page_cache(path)
    return read


def _drop_from_page_cache(path: Path) -> None:
    """The file's pages leave the page cache once read: a 7B-14B checkpoint would otherwise hold as much host memory
    as the offload engine's pinned buffers need next."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _plain_names(model: nn.Module):
    """(the plain model's parameter name, parameter), wrappers (activation checkpointing, compile) removed."""
    for name, p in model.named_parameters():
        yield name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""), p


def _copy_slice(param: torch.Tensor, stored, name: str, path: Path) -> int:
    from torch.distributed.tensor import DTensor

    shape = tuple(stored.get_shape())
    if shape != tuple(param.shape):
        raise ConfigError(f"{path}: {to_hf_name(name)} has shape {list(shape)}, the model expects {list(param.shape)}")
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = param.to_local()
        local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if local.numel() == 0:
            return 0
        index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    else:
        local, index = param, tuple(slice(None) for _ in shape)
    values = stored[index] if index else stored[:]
    local.copy_(values.to(local.device, non_blocking=False).view(local.shape))
    return values.numel() * values.element_size()

