"""The checks both inner loops (gradient, :mod:`.inner`; zero-order, :mod:`.zero_order`) make on
each step's loss and on their batches."""

from __future__ import annotations

import math
from collections.abc import Sized

from megatron_ext.errors import TrainingDivergedError

__all__ = ["check_every_step_ran", "check_finite_loss"]


def check_finite_loss(value: float, where: str, step: int, what: str, remedy: str) -> None:
    """Raise :class:`TrainingDivergedError` (this rank's, naming ``where`` and the inner step)
    when ``value`` — the step's ``what``, e.g. "loss" — is not finite; ``remedy`` says what to
    change."""
    if not math.isfinite(value):
        raise TrainingDivergedError(
            f"{where} inner step {step}: {what} is {value}; {remedy}", on_every_rank=False
        )


def check_every_step_ran(losses: Sized, lrs: Sized, where: str) -> None:
    """ValueError when the batches ran out before the ``len(lrs)`` inner steps."""
    if len(losses) != len(lrs):
        raise ValueError(f"{where}: {len(lrs)} inner steps but only {len(losses)} batches")
