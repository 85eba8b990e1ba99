"""Errors shared by every part of holotrain (kept free of heavy imports: loader processes import it)."""


class ConfigError(ValueError):
    """A user mistake (config key, file, record); the CLI prints it as one line and exits with code 2."""


class TrainingStopped(RuntimeError):
    """The run stopped itself (e.g. too many consecutive non-finite steps); the CLI prints it as one line and
    exits with code 3. The last good checkpoint is kept."""


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped the run after a step: `checkpoint` is the one saved for it (None if none could be).
    The CLI prints one line with the command that resumes, and exits with 128 + the signal's number (130, 143)."""

    def __init__(self, signum: int, step: int, checkpoint):
        super().__init__(f"signal {signum} after step {step}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class SaveFailed(RuntimeError):
    """The final checkpoint (checkpoint.save_final) could not be written (its disk had no room, or the write
    failed); the message names the newest intact checkpoint. The CLI prints it as one line and exits with code 4."""
