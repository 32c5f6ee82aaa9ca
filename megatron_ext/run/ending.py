"""How a rank process ends: Python's own exit, less the interpreter's teardown.

After ``train`` returns (process groups already torn down by the entry point), the process
still holds ~3,000 modules of torch and megatron-core. CPython's finalization frees them one by
one: 1.1 s per rank measured on a 2-core CPU host (0.5 s for torch alone), paid by every rank of
every run at its end, and torchrun waits for the slowest. That teardown is also where gloo's C++
transport, destroyed while a peer still closes its own, has aborted a finished rank now and
then (``terminate called without an active exception``, exit -6). Nothing of ours needs it: our
files are written atomically and closed where they are written.

:func:`end_process` does what the interpreter's exit does for Python code — run the
threading-exit hooks (idle ``concurrent.futures`` workers told to stop) and wait for the
non-daemon threads, run the ``atexit`` handlers (multiprocessing's finalizers among them, which
stop helper processes such as a checkpoint writer's Manager), flush stdout and stderr — then
``os._exit(code)``. The test ranks (``tests/warm.py``) end through it too.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

__all__ = ["end_process"]


def end_process(code: int) -> NoReturn:
    """End this process with exit status ``code`` as described above; never returns."""
    try:
        # Exactly what the interpreter's exit does first: the threading-atexit hooks (which stop
        # e.g. concurrent.futures' idle workers), then a join of the non-daemon threads. A
        # plain join of every thread would wait forever on an idle ThreadPoolExecutor worker.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()  # the handlers Python's exit would run, in its order
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)
