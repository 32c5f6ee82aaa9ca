"""Time from the launch command to a run's first step, and where a rank's start-up went.

The launcher writes the moment its own process started (``MEGATRON_EXT_LAUNCHED_AT``, seconds
since the epoch, this node's clock) into every rank's environment; a rank started without it
(``megatron-ext train`` under a bare torchrun, srun or mpirun) counts from its own process
start. A trainer marks its phases on one :class:`StartupClock`:

    launch ──► rank process ──► train() entered ──► set up ──► first step done
      launcher + torchrun │  imports, recipe  │ model, data, │ the first step
                          │                   │ optimizer    │

and reports them once, at its first step (:meth:`StartupClock.report`). Torch-free.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

__all__ = ["LAUNCHED_AT_VAR", "StartupClock", "process_start_time"]

LAUNCHED_AT_VAR = "MEGATRON_EXT_LAUNCHED_AT"


def process_start_time(pid: int | None = None) -> float:
    """When process ``pid`` (default: this one) started, in seconds since the epoch."""
    import psutil

    return psutil.Process(pid).create_time()


@dataclass
class StartupClock:
    """Wall-clock marks of one rank's start-up (seconds since the epoch)."""

    launched: float
    process: float
    marks: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, environ: dict[str, str] | None = None) -> StartupClock:
        """The clock of this process, from the launcher's mark when it left one."""
        env = os.environ if environ is None else environ
        process = process_start_time()
        launched = float(env[LAUNCHED_AT_VAR]) if env.get(LAUNCHED_AT_VAR) else process
        return cls(launched=min(launched, process), process=process)

    def mark(self, name: str) -> None:
        """Record that phase ``name`` ended now."""
        self.marks[name] = time.time()

    def phases(self) -> dict[str, float]:
        """Seconds per phase, in order: ``launcher`` (the launch command and torchrun, up to this
        process's start), then each mark since the one before, and ``to_first_step`` in all."""
        out = {"launcher": self.process - self.launched}
        previous = self.process
        for name, at in self.marks.items():
            out[name] = at - previous
            previous = at
        out["total"] = previous - self.launched
        return out

    def report(self) -> str:
        """One line: the total, then each phase."""
        phases = self.phases()
        total = phases.pop("total")
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())
        return f"first step {total:.1f} s after the launch command ({parts})"
