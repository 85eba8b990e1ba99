"""Converting config values, from TOML or the command line, to the types of the config's fields; a value that does
not convert is one ConfigError naming its key."""

from __future__ import annotations

import difflib
import json
import typing
from typing import Any

from holotrain.errors import ConfigError


def closest(name: str, known, cutoff: float = 0.6) -> str | None:
    """The known name closest to a misspelt one (for "did you mean ...?"), or None when none is as close as `cutoff`
    (difflib's similarity, 0 to 1)."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
    return close[0] if close else None


def _int_list(key: str, value: Any) -> list[int]:
    """A list of integers from TOML ([10, 11]) or the command line ("10,11" or "[10, 11]")."""
    if isinstance(value, str):
        text = value.strip().strip("[]")
        try:
            value = [int(x) for x in text.replace(",", " ").split()]
        except ValueError:
            raise ConfigError(f"{key}: expected a list of integers, got {value!r}") from None
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ConfigError(f"{key}: expected a list of integers, got {value!r}")
    return value


def _str_list(key: str, value: Any) -> list[str]:
    """A list of names from TOML (["output", "layers.*.wq"]) or the command line ("output,layers.0.*")."""
    if isinstance(value, str):
        value = [x.strip().strip("'\"") for x in value.strip().strip("[]").split(",") if x.strip()]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ConfigError(f"{key}: expected a list of names, got {value!r}")
    return value


def _type_name(typ: Any) -> str:
    """'float', or for a union such as float | str: 'float or str'."""
    args = typing.get_args(typ)
    return " or ".join(a.__name__ for a in args) if args else getattr(typ, "__name__", str(typ))


def coerce(key: str, value: Any, typ: type) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise ConfigError naming the key."""
    if typ is list:
        return _int_list(key, value)
    if typ is dict and isinstance(value, str):  # from the command line: a JSON object
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            raise ConfigError(f"{key}: expected a JSON object, got {value!r}") from None
    if typing.get_origin(typ) is list:
        return _str_list(key, value)
    if isinstance(value, str) and typ is not str:
        text = value.strip()
        try:
            if typ is bool:
                low = text.lower()
                if low in ("true", "1", "yes", "on", ""):
                    return True
                if low in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if typ is int:
                return int(text)
            if typ is float:
                return float(text)
        except ValueError:
            raise ConfigError(f"{key}: expected {_type_name(typ)}, got {value!r}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected bool, got {value!r}")
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}: expected int, got {value!r}")
    if typing.get_args(typ) and float in typing.get_args(typ) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)  # a TOML integer where a number is meant (offload_ratio = 1)
    if not isinstance(value, typ):
        raise ConfigError(f"{key}: expected {_type_name(typ)}, got {value!r}")
    return value
