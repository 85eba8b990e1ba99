"""Errors shared by every part of holotrain (kept free of heavy imports: loader processes import it)."""


class ConfigError(ValueError):
    """A user mistake (config key, file, record); the CLI prints it as one line and exits with code 2."""


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. too many consecutive non-finite steps); the CLI prints it as one line and
    exits with code 3. The last good checkpoint is kept."""
