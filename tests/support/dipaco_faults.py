"""The stop-signal fault scenario (tests only; the benchmark's scenarios are in
:mod:`megatron_ext.bench._dipaco_faults`, whose worker processes this one uses too).

:func:`signalled_run`: two workers are sent a stop signal: ``mid`` in the middle of a train task
(it stops itself at the task's first lease check; SIGTERM, then SIGCONT), which gives the task
back unfinished and exits 0; ``end`` after finishing one (before completing it), which completes
it and exits 0. A third worker then finishes the run.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_ext.bench._dipaco_faults import finish, kill, queue_events, wait_stopped, worker
from megatron_ext.config.schema import Recipe

__all__ = ["signalled_run"]


def signalled_run(
    recipe_name: str,
    overrides: Sequence[str],
    recipe: Recipe,
    logs: Path,
    sig: signal.Signals = signal.SIGTERM,
    timeout: float = 300,
) -> dict[str, Any]:
    """The scenario of the module docstring; returns each signalled worker's exit
    code and output (``codes``, ``logs``) and the queue's events."""
    logs.mkdir(parents=True, exist_ok=True)
    mid = ("", logs / "mid.log", "--pause-mid-task", "train")
    workers = {
        "mid": worker(recipe_name, overrides, "mid", *mid),
        "end": worker(recipe_name, overrides, "end", "train", logs / "end.log"),
    }
    try:
        wait_stopped(workers, logs, timeout)
        for proc in workers.values():
            proc.send_signal(sig)  # pending while stopped: handled as soon as it runs again
            proc.send_signal(signal.SIGCONT)
        codes = {n: p.wait(timeout=timeout) for n, p in workers.items()}
        helper = worker(recipe_name, overrides, "helper", "", logs / "helper.log")
        finish("helper", helper, logs, timeout)
    finally:
        kill(*workers.values())
    return {
        "codes": codes,
        "logs": {n: (logs / f"{n}.log").read_text() for n in workers},
        "events": queue_events(recipe),
    }
