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
from holotrain.model.args import FIELDS, ModelArgs
from holotrain.model.hf import Piece, hf_pieces, model_fields_from_hf, to_hf_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Fields a run may set otherwise than the model it starts from (the given value wins): the context extension, and
# how a router's load is balanced (a fine-tune's choice; a balancing bias the source lacked starts at zero). Every
# other model dimension given beside init_from must equal the checkpoint's.
OVERRIDABLE = ("max_seq_len", "rope_theta", "rope_scaling", "router_bias", "router_bias_update",
               "router_bias_weights")


@dataclass
class Pretrained:
    """What init_from names: where its weights and tokenizer are, and the model fields it implies."""

    kind: str  # "hf" | "run" (a DCP checkpoint of ours)
    directory: Path
    fields: dict  # ModelArgs fields
    tokenizer: Path  # tokenizer.json
    # hf: our parameter name -> the checkpoint tensors that hold it, each with its file (one, or a mixture of
    # experts' stacked weights expert by expert: model/hf.py's Piece).
    weight_files: dict[str, list[tuple[Piece, Path]]] = field(default_factory=dict)
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
    wanted, experts = expected_names(fields), fields.get("n_experts", 0)
    files = {ours: _whole(names.get(ours, []), experts) for ours in wanted}
    missing = sorted((ours for ours, pieces in files.items() if not pieces), key=_natural)
    if missing:
        raise ConfigError(f"{directory}: the weights lack {_hf_label(missing[0], names.get(missing[0]), experts)}"
                          f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} (for {CONFIG}'s shape)")
    return Pretrained("hf", directory, fields, directory / "tokenizer.json", weight_files=files)


def _whole(pieces: list[tuple[Piece, Path]], n_experts: int) -> list[tuple[Piece, Path]]:
    """The pieces that make the whole tensor: one that holds all of it (or its half of a fused tensor), else one
    per expert for every expert; [] if they do not."""
    for piece, path in pieces:
        if piece.expert is None:
            return [(piece, path)]
    by_expert = {piece.expert: (piece, path) for piece, path in pieces}
    return [by_expert[e] for e in range(n_experts)] if pieces and set(by_expert) == set(range(n_experts)) else []


def _hf_label(ours: str, pieces: list[tuple[Piece, Path]] | None = None, n_experts: int = 0) -> str:
    """A missing tensor as the checkpoint would name it (of a stacked expert weight with some experts present: the
    experts missing)."""
    if pieces:
        lacking = sorted(set(range(n_experts)) - {p.expert for p, _ in pieces})
        return f"experts {lacking[:8]}{' ...' if len(lacking) > 8 else ''} of {ours} (as {pieces[0][0].hf})"
    try:
        return to_hf_name(ours)
    except KeyError:
        return f"{ours} (its Hugging Face tensors)"


def _weight_map(directory: Path) -> dict[str, list[tuple[Piece, Path]]]:
    """Our tensor's name -> the checkpoint's tensors that hold it, or a part of it, with their safetensors files."""
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
    out: dict[str, list[tuple[Piece, Path]]] = {}
    for name, path in hf_files.items():
        if name.endswith("rotary_emb.inv_freq"):  # older exports keep the rotary buffer; it is recomputed
            continue
        try:
            pieces = hf_pieces(name)
        except KeyError:
            raise ConfigError(f"{path}: unexpected tensor {name!r} for this model family") from None
        for piece in pieces:
            out.setdefault(piece.ours, []).append((piece, path))
    return out


def expected_names(fields: dict) -> list[str]:
    """Our tensors a checkpoint holds for a model of these fields (a tied head shares the embedding): the state
    dict of the model they build, on "meta"."""
    from holotrain.model.registry import build

    with torch.device("meta"):
        state = build(ModelArgs(**{k: v for k, v in fields.items() if k in FIELDS})).state_dict()
    return [n for n in state if not (fields["tie_embeddings"] and n == "output.weight")]


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
    by_file: dict[Path, list[tuple[str, Piece]]] = {}
    for name in params:
        if name not in pretrained.weight_files:
            if name.endswith(".expert_bias"):  # a balancing bias the model lacked (model.router_bias): it starts at 0
                continue
            raise ConfigError(f"{pretrained.directory}: the weights lack {_hf_label(name)}")
        for piece, path in pretrained.weight_files[name]:
            by_file.setdefault(path, []).append((name, piece))
    read = 0
    for path in sorted(by_file):
        with safe_open(str(path), framework="pt") as f:
            for name, piece in by_file[path]:
                read += _copy_slice(params[name], f.get_slice(piece.hf), piece, path)
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
    """(the plain model's name, tensor) of its parameters and the buffers a checkpoint keeps (a sigmoid router's
    expert bias), wrappers (activation checkpointing, compile) removed."""
    kept = set()
    for prefix, module in model.named_modules():
        kept.update(f"{prefix}.{b}" if prefix else b for b in module._buffers
                    if b not in module._non_persistent_buffers_set)
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in kept)]
    for name, p in tensors:
        yield name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""), p


def _copy_slice(param: torch.Tensor, stored, piece: Piece, path: Path) -> int:
    """The part of the stored tensor that is this rank's of `param` (all of it, or its DTensor shard), through
    what the piece holds of it (all, one expert's slice, or a half of dimension 1); returns the bytes read."""
    from torch.distributed.tensor import DTensor

    shape, expected = tuple(stored.get_shape()), piece.stored_shape(tuple(param.shape))
    if shape != expected:
        raise ConfigError(f"{path}: {piece.hf} has shape {list(shape)}, the model expects {list(expected)}")
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = param.to_local()
        local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if local.numel() == 0:
            return 0
        index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    else:
        local, index = param, tuple(slice(0, n) for n in param.shape)
    target = local
    if piece.expert is not None:  # one expert's [F, D] of our [E, F, D]: if this rank holds it
        rows, index = index[0], index[1:]
        if not rows.start <= piece.expert < rows.stop:
            return 0
        target = local[piece.expert - rows.start]
    elif piece.half is not None:  # our rows of dimension 1 within the fused tensor's
        F, rows = param.shape[1], index[1]
        index = (index[0], slice(rows.start + piece.half * F, rows.stop + piece.half * F), *index[2:])
    values = stored[index] if index else stored[:]
    target.copy_(values.to(target.device, non_blocking=False).view(target.shape))
    return values.numel() * values.element_size()

