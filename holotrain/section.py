"""The base class of every config section: a dataclass that is read-only once the config is resolved."""

from __future__ import annotations

from typing import Any

from holotrain.errors import ConfigError


class Section:
    """A config section; read-only once the config is resolved (Config.freeze). A section's `check` raises one
    ConfigError line for the first bad value among its own keys; rules across sections live in config_checks.py."""

    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise AttributeError(f"the resolved config is read-only: {type(self).__name__}.{name} cannot change "
                                 "after resolution (make a changed copy with dataclasses.replace)")
        object.__setattr__(self, name, value)

    def check(self) -> None:
        """Raises ConfigError for the first bad value among this section's own keys; none by default."""


def need(cond: bool, msg: str) -> None:
    """Raises ConfigError(msg) unless `cond`."""
    if not cond:
        raise ConfigError(msg)
