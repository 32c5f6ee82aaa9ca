"""Progress of a command's slow steps, on a terminal only.

``convert`` spends seconds importing torch, megatron-core and transformers and loading weights;
``soma generate`` runs its experts byte by byte. On a terminal each step shows as one transient
status line on stderr (``megatron-ext: convert: loading the Hugging Face model ...``),
rewritten in place and erased when the step ends, so the terminal keeps only the result.
Where stderr is a pipe or a file (scripts, CI, the tests) nothing is written: an error stays
the first and only stderr line. Torch-free.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["on_terminal", "step"]


def on_terminal() -> bool:
    """Whether stderr is a terminal (progress is shown there only)."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


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
