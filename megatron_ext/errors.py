"""The errors a user acts on: a bad recipe or launch setting, and a run that diverged.

The CLI prints either as one line (``megatron-ext: error: ...``) without a traceback: exit code 2
for :class:`ConfigError`, 1 for :class:`TrainingDivergedError`.
"""


class ConfigError(ValueError):
    """A user mistake in a recipe or on the command line; the CLI prints it and exits 2."""


class TrainingDivergedError(RuntimeError):
    """A training loss (or what it is estimated from) became NaN or inf, in any trainer.

    Raised before that state is checkpointed, so the newest checkpoint is the last good one.
    ``on_every_rank``: every rank raises the same error (its loss was reduced over the ranks),
    so one rank's message is enough; False when only the ranks holding the diverged part raise.
    """

    def __init__(self, message: str, *, on_every_rank: bool = True) -> None:
        super().__init__(message)
        self.on_every_rank = on_every_rank
