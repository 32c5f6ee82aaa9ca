"""What a whole ``make test`` cost, printed at its end: wall time per test file (the slowest)
and the processes the suite started.

Process starts are counted in the pytest process: every ``subprocess.Popen`` of a Python
interpreter, ``megatron-ext`` or torchrun running this project's code (:data:`tests.tiers.OURS`;
a launcher's own children, e.g. the ranks torchrun starts, are not seen here), and every warm
launch with its ranks (forked from the zygote, :mod:`tests.warm`, instead of started cold).
The figures are a report, never a pass/fail: the suite asserts no time.

Under pytest-xdist (``make test`` runs two workers) every worker counts its own process starts
and hands them to the controlling process when it ends (:func:`send`, :func:`receive`); the
durations reach the controller with each test's report.
"""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from typing import Any

import pytest

from tests.tiers import OURS

#: counts of the session so far (the pytest process only)
STARTS: Counter[str] = Counter()
FILE_SECONDS: Counter[str] = Counter()
FILE_TESTS: Counter[str] = Counter()
_installed = False


def install() -> None:
    """Count this project's process starts for the rest of the session (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    real_init = subprocess.Popen.__init__

    def counting(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [str(a) for a in ([args] if isinstance(args, str | os.PathLike) else args)]
        program = os.path.basename(argv[0]) if argv else ""
        if program.startswith("megatron-ext") or (
            program.startswith("python") and any(w in a for a in argv for w in OURS)
        ):
            STARTS["cold"] += 1
        real_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = counting  # type: ignore[method-assign]


def warm_launch(nproc: int) -> None:
    """Record one launch forked from the zygote."""
    STARTS["warm launches"] += 1
    STARTS["warm ranks"] += nproc


def send(config: pytest.Config) -> None:
    """In an xdist worker: hand this process's counts to the controller (no-op elsewhere)."""
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["tally_starts"] = dict(STARTS)


def receive(node: Any) -> None:
    """In the xdist controller: add the counts a finished worker handed over."""
    STARTS.update(getattr(node, "workeroutput", {}).get("tally_starts", {}))


def record(report: pytest.TestReport) -> None:
    """Add a test phase's duration to its file."""
    path = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[path] += report.duration
    if report.when == "call":
        FILE_TESTS[path] += 1


def summary(top: int = 20) -> list[str]:
    """The report's lines: the ``top`` slowest files, then the totals."""
    lines = [f"{'seconds':>8}  {'tests':>5}  file (setup + call + teardown, slowest {top})"]
    for path, seconds in FILE_SECONDS.most_common(top):
        lines.append(f"{seconds:8.1f}  {FILE_TESTS[path]:5d}  {path}")
    lines.append(
        f"{sum(FILE_SECONDS.values()):8.1f}  {sum(FILE_TESTS.values()):5d}  all "
        f"{len(FILE_SECONDS)} files"
    )
    lines.append(
        f"process starts by the pytest process: {STARTS['cold']} cold (python / megatron-ext "
        f"/ torchrun), {STARTS['warm launches']} warm launches forked from a zygote "
        f"per pytest process ({STARTS['warm ranks']} ranks)"
    )
    return lines
