"""Stopping a run early and cleanly, for every trainer: stop signals, a time limit, a step count.

A cluster stops jobs with signals: SLURM sends ``--signal=USR1@120`` 120 s before the time limit,
and SIGTERM on preemption or at the limit. With :class:`StopPolicy` installed, such a signal only
sets a flag; the trainer asks :meth:`StopPolicy.check` after each step (or update), every rank
finishes that step, the trainer writes a checkpoint and raises :class:`RunStopped`, and the
per-rank entry point prints where the run stopped and how to resume, and exits 0. The same
happens after ``training.exit_duration_in_mins`` minutes and after a step divisible by
``training.exit_interval`` (Megatron-LM's names and meaning).

Use (any trainer; DiPaCo workers too)::

    stop = StopPolicy.from_training(recipe.training)   # installs the signal handlers
    for step in range(start, total):
        ...one step...
        reason = stop.check(step + 1)                  # collective: same answer on every rank
        if reason:
            path = save(...)
            raise RunStopped(step + 1, total, reason, path)
    stop.uninstall()

:meth:`StopPolicy.check` agrees over the ranks (one all-reduce of a small integer), so every
rank stops after the same step even when only one was signalled or ranks see the clock
differently; ``collective=False`` decides from this rank alone (ranks that never communicate,
e.g. SOMA's FSO experts, or a task-queue worker that releases its task). :meth:`requested`
says whether a stop is due without any communication.

This module's top level imports no torch (the recipe schema validates its fields).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from megatron_ext.errors import ConfigError

__all__ = ["LAUNCH_COMMAND_VAR", "STOP_SIGNALS", "RunStopped", "StopPolicy", "check_stop_fields"]

# Set by the launcher for its ranks: its own command line, which resumes a stopped run.
LAUNCH_COMMAND_VAR = "MEGATRON_EXT_LAUNCH_COMMAND"

STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
_INTERVAL, _DURATION, _SIGNAL = 1, 2, 100  # agreed as a maximum; a signal adds its number


class RunStopped(Exception):
    """A run stopped early on purpose, its state saved: the entry point prints
    :meth:`message` and exits 0. ``unit``: what ``step`` counts (steps, updates)."""

    def __init__(
        self, step: int, total: int, reason: str, checkpoint: Path | str | None, unit: str = "step"
    ) -> None:
        super().__init__(f"stopped at {unit} {step} of {total} ({reason})")
        self.step, self.total, self.reason, self.unit = step, total, reason, unit
        self.checkpoint = checkpoint

    def message(self, resume_command: str) -> str:
        where = f"; checkpoint {self.checkpoint}" if self.checkpoint else ""
        return f"megatron-ext: {self}{where}. Resume with: {resume_command}"


def check_stop_fields(training: Any) -> None:
    """``training.exit_signals`` names only signals a run can stop on (``ConfigError``)."""
    bad = [s for s in training.exit_signals if s not in STOP_SIGNALS]
    if bad:
        raise ConfigError(
            f"training.exit_signals: {', '.join(map(repr, bad))} is not a stop signal; "
            f"choose from {', '.join(STOP_SIGNALS)} ([] = none)"
        )


@dataclass
class StopPolicy:
    """When a run stops early (see the module docstring); its signal handlers are installed
    on construction and restored by :meth:`uninstall`.

    Args:
        signals: signal names (``STOP_SIGNALS``) that request a stop.
        exit_duration_in_mins: stop after this many minutes since ``start`` (None: never).
        exit_interval: stop after a step divisible by this (None: never).
        start: ``time.monotonic()`` the duration counts from (default: now).
    """

    signals: Sequence[str] = ("SIGTERM", "SIGUSR1")
    exit_duration_in_mins: float | None = None
    exit_interval: int | None = None
    start: float | None = None

    def __post_init__(self) -> None:
        self.start = time.monotonic() if self.start is None else self.start
        self.received: int | None = None  # the signal number caught, if any
        self._previous: dict[int, Any] = {}
        for name in self.signals:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._catch)
            signal.siginterrupt(signum, False)  # system calls resume after the handler

    @classmethod
    def from_training(cls, training: Any) -> StopPolicy:
        """From a recipe's ``training`` section (``exit_signals``, ``exit_duration_in_mins``,
        ``exit_interval``)."""
        return cls(training.exit_signals, training.exit_duration_in_mins, training.exit_interval)

    def _catch(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum

    def uninstall(self) -> None:
        """Put the handlers back that were there before."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _code(self, step: int) -> int:
        code = 0
        if self.exit_interval and step % self.exit_interval == 0:
            code = _INTERVAL
        assert self.start is not None
        minutes = (time.monotonic() - self.start) / 60
        if self.exit_duration_in_mins is not None and minutes > self.exit_duration_in_mins:
            code = _DURATION
        if self.received is not None:
            code = _SIGNAL + self.received
        return code

    def requested(self, step: int) -> str | None:
        """Why this rank should stop after ``step`` (no communication), or None."""
        return self._reason(self._code(step))

    def check(self, step: int, collective: bool = True, device: Any = None) -> str | None:
        """Why the run stops after ``step``, or None; with ``collective`` (every rank of the
        default group calls it) the strongest reason any rank has, so all stop together.
        ``device``: where the all-reduce's tensor lives (the default group's device)."""
        code = self._code(step)
        if collective:
            import torch
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_world_size() > 1:
                flag = torch.tensor([code], dtype=torch.int64, device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                code = int(flag.item())
        return self._reason(code)

    def _reason(self, code: int) -> str | None:
        if code >= _SIGNAL:
            return signal.Signals(code - _SIGNAL).name
        if code == _DURATION:
            return f"training.exit_duration_in_mins={self.exit_duration_in_mins} reached"
        if code == _INTERVAL:
            return f"training.exit_interval={self.exit_interval}"
        return None
