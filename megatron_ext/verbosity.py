"""Quiet by default: the libraries' repeated start-up noise is hidden unless ``--verbose``.

What is hidden (each seen on every rank of every CPU run, none actionable there):

* megatron-core's "Transformer Engine and Apex are not installed" / "Apex is not installed"
  warnings (one per module that falls back, five per rank), its "full scope is deprecated"
  warning, its "GPTModel IS DEPRECATED" and "MCore's async save is deprecated" log lines (the
  checkpoint writer is megatron-core's own, chosen here);
* torch.distributed.checkpoint's warnings on every checkpoint load, each twice per rank:
  "Please use DTensor instead and we are deprecating ShardedTensor" (a FutureWarning:
  megatron-core's dist_checkpointing reads through it; nothing here builds ShardedTensors), "The
  argument order of load has been changed" and "torch.distributed is disabled, unavailable or
  uninitialized, assuming the intent is to load in a single process" (megatron-core's reads of a
  checkpoint's common state);
* torch's "No CUDA runtime is found, using CUDA_HOME=..." log line (``torch.utils.cpp_extension``
  on a host with a CUDA toolkit but no GPU): it was the first stderr line of a failing
  ``data``/``convert``/``ckpt`` command, above the error itself;
* gloo's "[Gloo] Rank N is connected to M peer ranks" lines, which its C++ code prints to the
  process's stdout for every process group created (47 in a 20-step demo): no environment
  variable turns them off, so :func:`filter_native_stdout` passes file descriptor 1 through a
  pipe that drops them.

``--verbose`` on any command (or ``MEGATRON_EXT_VERBOSE=1``, which the launcher's ranks
inherit) shows everything. Torch-free.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import sys
import threading
import warnings

__all__ = ["VERBOSE_VAR", "filter_native_stdout", "is_verbose", "quiet_libraries"]

VERBOSE_VAR = "MEGATRON_EXT_VERBOSE"

#: start of each hidden library warning's message (``warnings`` matches from the start)
_LIBRARY_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"The argument order of load has been changed",
    r"torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
    r"load in a single process",
)
#: torch.distributed.checkpoint's deprecation warning on every load (a FutureWarning)
_SHARDED_TENSOR = r"Please use DTensor instead and we are deprecating ShardedTensor"
_GLOO_LINE = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. .*\n")
_END = b"\x00megatron-ext: end of stdout\n"
_QUIETED = False


def is_verbose() -> bool:
    """True when ``--verbose`` was given (or ``MEGATRON_EXT_VERBOSE`` is set to 1)."""
    return os.environ.get(VERBOSE_VAR, "") == "1"


class _DropMessages(logging.Filter):
    def __init__(self, *starts: str) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_libraries() -> None:
    """Hide the library warnings and log lines listed in the module docstring (this process),
    unless verbose. Call before torch or megatron-core is imported."""
    global _QUIETED
    if is_verbose() or _QUIETED:
        return
    _QUIETED = True  # once per process (the logging filters would pile up)
    for message in _LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    warnings.filterwarnings("ignore", message=_SHARDED_TENSOR, category=FutureWarning)
    # torch's CUDA_HOME line: a WARNING of this logger, about a toolkit nothing here compiles with
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(
        _DropMessages("GPTModel IS DEPRECATED")
    )
    logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").addFilter(
        _DropMessages("MCore's async save is deprecated")
    )


def filter_native_stdout() -> None:
    """Route this process's file descriptor 1 through a pipe whose reader thread drops gloo's
    connection lines and copies every other line, in order, to the original stdout; children
    inherit the pipe (torchrun's ranks: their lines are filtered too). At exit (``atexit``;
    :func:`megatron_ext.run.ending.end_process` runs it) the rest is copied and fd 1 restored.
    Does nothing when verbose or when stdout has no file descriptor."""
    if is_verbose():
        return
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    sys.stdout.flush()
    original = os.dup(fd)
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)

    def pump() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as src:
            for line in iter(src.readline, b""):
                if line.endswith(_END):  # the last line: what came before the marker, then stop
                    os.write(original, line[: -len(_END)])
                    return
                if not _GLOO_LINE.fullmatch(line):
                    _write_all(original, line)

    thread = threading.Thread(target=pump, name="stdout-filter", daemon=True)
    thread.start()

    def close() -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        with contextlib.suppress(OSError):
            os.write(fd, _END)
        thread.join(timeout=10)
        os.dup2(original, fd)

    atexit.register(close)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError):
        while data:
            data = data[os.write(fd, data) :]
