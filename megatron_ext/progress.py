"""Progress of a command's slow work, on a terminal only.

Two forms, both on stderr and both transient (erased when done, so the terminal keeps only the
command's result):

- :func:`step`: one status line for a step of unknown length (``convert`` importing torch,
  megatron-core and transformers, loading weights): ``megatron-ext: convert: loading ...``;
- :func:`bar`: a tqdm bar, as training shows, for work counted in units (documents tokenized by
  ``data build``, tensors checked by ``ckpt verify``/``upgrade``, a benchmark's runs).

Where stderr is a pipe or a file (scripts, CI, the tests), or with ``--quiet`` on any command
(``MEGATRON_EXT_QUIET=1``), nothing is written: an error stays the first and only stderr line.
Torch-free (tqdm is imported only when a bar is shown).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["QUIET_VAR", "bar", "on_terminal", "step"]

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
