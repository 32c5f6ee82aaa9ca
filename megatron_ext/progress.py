"""Progress of a command's slow work, on a terminal only.

Three forms, all on stderr and all transient (erased when done, so the terminal keeps only the
command's result):

- :func:`step`: one status line for a step of unknown length (``convert`` importing torch,
  megatron-core and transformers, loading weights): ``megatron-ext: convert: loading ...``;
- :func:`bar`: a tqdm bar, as training shows, for work counted in units (documents tokenized by
  ``data build``, bytes checked by ``ckpt verify``/``upgrade``);
- :func:`tally`: a tqdm bar over named units of work, naming what runs now (``k/n``): a
  benchmark's runs, arms, rounds (``megatron-ext bench NAME``, through
  :func:`megatron_ext.bench.common.progress`); the lines the command prints go above it.

Where stderr is a pipe or a file (scripts, CI, the tests), or with ``--quiet`` on any command
(``MEGATRON_EXT_QUIET=1``), nothing is written: an error stays the first and only stderr line.
Torch-free (tqdm is imported only when a bar is shown).
"""

from __future__ import annotations

import io
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["QUIET_VAR", "Tally", "bar", "on_terminal", "step", "tally"]

#: set to 1 by ``--quiet`` (any command): no progress, on a terminal too
QUIET_VAR = "MEGATRON_EXT_QUIET"


def on_terminal() -> bool:
    """Whether progress is shown: stderr is a terminal and ``--quiet`` was not given."""
    if os.environ.get(QUIET_VAR, "") == "1":
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


@contextmanager
def bar(
    command: str, what: str, *, total: int | None = None, unit: str = "it"
) -> Iterator[Callable[[int], object]]:
    """Yield ``update(n)``: advances a tqdm bar ``megatron-ext: COMMAND: WHAT`` by ``n``
    ``unit``s (of ``total``, or a count and a rate when None) on a terminal; elsewhere a
    function that does nothing. The bar is erased on leaving."""
    if not on_terminal():
        yield _nothing
        return
    from tqdm import tqdm

    with tqdm(
        total=total,
        desc=f"megatron-ext: {command}: {what}",
        unit=unit,
        unit_scale=unit == "B",  # bytes as kB, MB, GB
        leave=False,
        dynamic_ncols=True,
        file=sys.stderr,
    ) as shown:
        yield shown.update


def _nothing(n: int) -> None:
    del n


@contextmanager
def step(command: str, what: str) -> Iterator[None]:
    """Show ``megatron-ext: COMMAND: WHAT`` while the block runs (terminal only), then its
    time; the line is erased on leaving (an error then prints on a clean line)."""
    if not on_terminal():
        yield
        return
    sys.stderr.write(f"\r\033[Kmegatron-ext: {command}: {what} ...")
    sys.stderr.flush()
    try:
        yield
    finally:
        sys.stderr.write("\r\033[K")  # erased: the terminal keeps the command's own output
        sys.stderr.flush()


class Tally:
    """The named units of work a :func:`tally` bar counts (a benchmark's runs, arms, rounds):
    :meth:`running` around each one. Off a terminal every method does nothing."""

    def __init__(self, shown: Any | None, total: int | None) -> None:
        self._shown, self.total = shown, total
        self._now: dict[int, str] = {}  # started and not finished: index -> "NAME (k/n)"
        self._started = 0
        self._lock = threading.Lock()  # runs may finish on worker threads (bench paper)

    @contextmanager
    def running(self, name: str) -> Iterator[None]:
        """Show ``NAME (k/n)`` as running while the block runs (beside any other running unit);
        the bar advances by one when the block ends without an error."""
        if self._shown is None:
            yield
            return
        with self._lock:
            self._started += 1
            k = self._started
            self._now[k] = f"{name} ({k}/{self.total})" if self.total else f"{name} ({k})"
            self._show()
        ok = False
        try:
            yield
            ok = True
        finally:
            with self._lock:
                del self._now[k]
                self._show(refresh=not ok)
                if ok:
                    self._shown.update(1)
                    self._shown.refresh()  # the count and the names now running, at once

    def _show(self, *, refresh: bool = True) -> None:
        assert self._shown is not None
        self._shown.set_postfix_str(", ".join(self._now.values()), refresh=refresh)


@contextmanager
def tally(
    command: str, what: str, *, total: int | None = None, unit: str = "run"
) -> Iterator[Tally]:
    """Yield a :class:`Tally`: a tqdm bar ``megatron-ext: COMMAND: WHAT`` (``k/total``,
    elapsed, rate) naming what runs now, on a terminal; elsewhere a :class:`Tally` that does
    nothing, and the streams are left alone.

    While the bar is shown, ``sys.stdout`` and ``sys.stderr`` write whole lines above it (the
    bar is cleared, the lines written unchanged to the same streams, the bar redrawn), so a
    command's printed figures never share a line with it; they say they are not terminals, so
    progress of work run inside the block (a trainer's own tqdm bar, :func:`bar`, :func:`step`)
    stays off: one bar on the terminal, never two fighting over a line. The bar is erased on
    leaving."""
    if not on_terminal():
        yield Tally(None, total)
        return
    from tqdm import tqdm

    with tqdm(
        total=total,
        desc=f"megatron-ext: {command}: {what}",
        unit=unit,
        leave=False,
        dynamic_ncols=True,
        file=sys.stderr,
    ) as shown:
        lock = threading.RLock()
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Above(out, shown, lock), _Above(err, shown, lock)
        try:
            yield Tally(shown, total)
        finally:
            for proxy in (sys.stdout, sys.stderr):
                if isinstance(proxy, _Above):
                    proxy.flush_rest()
            sys.stdout, sys.stderr = out, err


class _Above(io.TextIOBase):
    """A text stream that writes whole lines to ``real`` above the bar ``shown``: the bar is
    cleared, the lines written, the bar redrawn (a partial line waits for its newline)."""

    def __init__(self, real: TextIO, shown: Any, lock: threading.RLock) -> None:
        self.real, self._shown, self._lock = real, shown, lock
        self._pending = ""

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            lines, newline, self._pending = self._pending.rpartition("\n")
            if newline:
                self._shown.clear()
                self.real.write(lines + newline)
                self.real.flush()
                self._shown.refresh()
        return len(text)

    def flush_rest(self) -> None:
        """Write a last partial line (the block ended without its newline)."""
        with self._lock:
            if self._pending:
                self._shown.clear()
                self.real.write(self._pending)
                self._pending = ""
            self.real.flush()

    def flush(self) -> None:
        self.real.flush()  # a partial line stays pending: the bar is drawn after it otherwise

    def isatty(self) -> bool:
        return False  # progress inside the block stays off: this bar is the only one

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.real.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.real.encoding
