"""One module per model family, each on the shared parts (model/parts.py, model/decoder.py); model/registry.py lists
them."""

from __future__ import annotations

from holotrain.errors import ConfigError


def hf_int(config: dict, key: str, where: str, default: int | None = None) -> int:
    """An integer of a Hugging Face config.json (a family's from_hf), or a ConfigError naming the key."""
    value = config.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
    return value
