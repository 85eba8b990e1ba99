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


def softmax_router_only(args, architecture: str) -> None:
    """A Hugging Face mixture-of-experts class that routes by the softmax of the router's logits alone: a model with
    another router, or a balancing bias on the choice, routes differently there, so its export is refused."""
    if args.router != "softmax":
        raise ConfigError(f"model.router = {args.router!r}: Hugging Face's {architecture} routes by softmax only, so "
                          "this model cannot be exported")
    if args.router_bias:
        raise ConfigError(f"model.router_bias = true: Hugging Face's {architecture} chooses experts without a "
                          "balancing bias, so this model cannot be exported")
