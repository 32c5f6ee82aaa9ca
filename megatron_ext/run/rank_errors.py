"""Why ranks failed, in one line each, for the launcher to report once; and where a stopped run
stopped, for the launcher to print last.

A rank that fails (a bad recipe, a diverged run, an unexpected exception) records its exit code
and its one-line message in ``$MEGATRON_EXT_ERRORS_DIR/rank_<rank>.json`` when the launcher set
that variable; the launcher groups the records by message and prints each message once, with the
ranks that raised it (:func:`summarize`). A rank killed outright (a signal, the OOM killer)
leaves no record; the launcher then reports torchrun's exit code for it.

A run that stops early on purpose (:class:`~megatron_ext.run.stopping.RunStopped`) has rank 0
record its one line (where it stopped, how to resume) as ``stopped.json`` in the same folder;
the launcher prints it on stdout after torchrun has exited, so that it is whole and the last line
of the job's output rather than interleaved with the other ranks' output. Without the launcher
rank 0 prints it itself.

Torch-free: both the ranks and the launcher use it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.atomic import write_json

__all__ = [
    "ERRORS_DIR_VAR",
    "RankError",
    "read_errors",
    "read_stop",
    "record_error",
    "record_stop",
    "summarize",
]

ERRORS_DIR_VAR = "MEGATRON_EXT_ERRORS_DIR"
STOP_FILE = "stopped.json"


@dataclass(frozen=True)
class RankError:
    rank: int
    code: int  # the exit code this rank returned
    line: str  # its message, one line


def record_error(rank: int, code: int, line: str, environ: Mapping[str, str] = os.environ) -> None:
    """Record this rank's failure where the launcher looks (nothing without the variable)."""
    folder = environ.get(ERRORS_DIR_VAR)
    if folder:
        first = line.strip().splitlines()[0] if line.strip() else "(no message)"
        write_json(Path(folder) / f"rank_{rank}.json", {"rank": rank, "code": code, "line": first})


def record_stop(line: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Leave the stop line for the launcher to print; False when no launcher reads it (then
    the caller prints it)."""
    folder = environ.get(ERRORS_DIR_VAR)
    if not folder:
        return False
    write_json(Path(folder) / STOP_FILE, {"line": line})
    return True


def read_stop(folder: Path) -> str | None:
    """The recorded stop line in ``folder`` (removing the record), or None."""
    path = folder / STOP_FILE
    if not path.is_file():
        return None
    line = str(json.loads(path.read_text(encoding="utf-8"))["line"])
    path.unlink()
    return line


def read_errors(folder: Path) -> list[RankError]:
    """The records in ``folder``, by rank."""
    errors = []
    for path in sorted(folder.glob("rank_*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        errors.append(RankError(int(data["rank"]), int(data["code"]), str(data["line"])))
    return sorted(errors, key=lambda e: e.rank)


def ranks_text(ranks: Iterable[int]) -> str:
    """``0-3, 6`` for ranks 0, 1, 2, 3, 6."""
    ranks = sorted(set(ranks))
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def summarize(errors: Iterable[RankError]) -> tuple[list[str], int]:
    """Each distinct message once, with its ranks (``rank 0`` / ``ranks 0-7``), in the order of
    the lowest rank that raised it; and the exit code to return: that of the lowest failed
    rank (0 when there is none)."""
    by_line: dict[str, list[RankError]] = {}
    for e in sorted(errors, key=lambda e: e.rank):
        by_line.setdefault(e.line, []).append(e)
    lines = []
    for line, group in by_line.items():
        ranks = [e.rank for e in group]
        label = "rank" if len(ranks) == 1 else "ranks"
        lines.append(f"{line} [{label} {ranks_text(ranks)}]")
    first = min(errors, key=lambda e: e.rank, default=None)
    return lines, (first.code if first else 0)
