"""What the launcher shows of the ranks' stderr, and how it reports ranks that failed.

Every line the ranks and torchrun write to stderr goes to a log file in the run directory
(:class:`StderrTee`); the terminal gets the same lines except Python tracebacks, torchrun's own
failure report and log lines, and the ranks' one-line errors: those are reported once, at the
end, by :func:`failure_report` -- each distinct error line once with the ranks that raised it
(from the ranks' records, :mod:`megatron_ext.run.rank_errors`), ranks that died without a word
by the exit code torchrun saw, and where the full log is.

Torch-free (the launcher never imports torch).
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from megatron_ext.run.rank_errors import RankError, ranks_text, read_errors, summarize

__all__ = ["StderrTee", "failure_report", "torchrun_exit_codes"]

_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
_TORCHRUN_LOG = re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ \S*torch/")  # glog lines
# torch's C++ side: its log lines ([W1205 07:25:53.86 socket.cpp:767] ...) and the stack of a
# c10::Error (Exception raised from ..., frame #N: ..., <omitting python frames>)
_CPP_LOG = re.compile(
    r"^\[[EWI]\d{4} \d\d:\d\d:\d\d\.\d+ \S+\]|^frame #\d+:|^Exception raised from |"
    r"^<omitting python frames>"
)
_ERROR = "megatron-ext: error:"
_RENDEZVOUS = re.compile(r"\b(Rendezvous(?:Timeout|Connection|Closed)Error)\b")


class StderrTee:
    """Copy a stream's lines to ``log`` and, filtered, to ``terminal``, in a thread.

    Hidden from the terminal (kept in the log): a traceback from its first line to its
    exception line, torchrun's ``=====`` failure table, torchrun's own log lines, and
    ``megatron-ext: error:`` lines (the launcher reports those once, at the end).
    """

    def __init__(self, stream: IO[str], log: IO[str], terminal: IO[str]) -> None:
        self._stream, self._log, self._terminal = stream, log, terminal
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        in_traceback = in_table = False
        for raw in self._stream:
            self._log.write(raw)
            self._log.flush()
            line = _RANK_PREFIX.sub("", raw.rstrip("\n"))
            if line.startswith("Traceback (most recent call last)"):
                in_traceback = True
            elif (
                in_traceback
                and line
                and not line[0].isspace()
                and not line.startswith(("During handling", "The above exception"))
            ):
                in_traceback = False  # the exception line closes the traceback
                continue
            if line.startswith("====="):
                in_table = not in_table
                continue
            hidden = _TORCHRUN_LOG.match(line) or _CPP_LOG.match(line) or line.startswith(_ERROR)
            if in_traceback or in_table or hidden:
                continue
            self._terminal.write(raw)
            self._terminal.flush()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def torchrun_exit_codes(log_text: str) -> dict[int, int]:
    """``{global rank: exit code}`` from torchrun's failure table in ``log_text``."""
    found = re.findall(
        r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", log_text
    )
    return {int(rank): int(code) for rank, code in found}


def _exit_code_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def failure_report(errors_dir: Path, log_path: Path, torchrun_code: int) -> tuple[list[str], int]:
    """The lines the launcher prints when torchrun failed, and the exit code it returns: the
    code of the lowest failed rank that said why; when none did, the ranks torchrun saw fail
    and the lowest one's code (128+N for a signal N), else torchrun's own."""
    errors: list[RankError] = read_errors(errors_dir) if errors_dir.is_dir() else []
    lines, code = summarize(errors)
    if not errors:  # no rank said why: the ones torchrun saw die (the others it stopped)
        text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.is_file() else ""
        died = torchrun_exit_codes(text)
        by_code: dict[int, list[int]] = {}
        for rank, c in sorted(died.items()):
            by_code.setdefault(c, []).append(rank)
        for c, ranks in by_code.items():
            where = f"{'rank' if len(ranks) == 1 else 'ranks'} {ranks_text(ranks)}"
            lines.append(f"megatron-ext: error: {where} failed ({_exit_code_text(c)}) [{where}]")
        first = died[min(died)] if died else 0
        code = (128 - first if first < 0 else first) or torchrun_code
        rendezvous = _RENDEZVOUS.search(text) if not died else None
        if rendezvous:
            lines.append(
                f"megatron-ext: error: torchrun's rendezvous failed ({rendezvous.group(1)}): "
                "not every node joined within launch.rdzv_timeout_s, or the first node's "
                "store became unreachable; start every node with the same --rdzv-endpoint"
            )
    lines.append(f"megatron-ext: the ranks' tracebacks and torchrun's report: {log_path}")
    return lines, code


def print_lines(lines: Iterable[str], out: IO[str]) -> None:
    for line in lines:
        print(line, file=out, flush=True)
