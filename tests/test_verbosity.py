"""Quiet by default (issue 38): gloo's connection lines dropped from a process's stdout, the
libraries' repeated warnings hidden, everything shown with ``--verbose``."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

from megatron_ext import verbosity
from megatron_ext.verbosity import VERBOSE_VAR, quiet_libraries

#: what a rank does: gloo's C++ prints straight to file descriptor 1, Python through sys.stdout
RANK = (
    "import os, sys\n"
    "from megatron_ext.verbosity import filter_native_stdout\n"
    "from megatron_ext.run.ending import end_process\n"
    "filter_native_stdout()\n"
    "print('step 1 | loss 3.0', flush=True)\n"
    "for r in range(3):\n"
    "    os.write(1, b'[Gloo] Rank %d is connected to 1 peer ranks. Expected number of "
    "connected peer ranks is : 1\\n' % r)\n"
    "os.write(1, b'a native line\\n')\n"
    "print('step 2 | loss 2.5')\n"
    "sys.stdout.write('no newline at the end')\n"
    "end_process(0)\n"  # os._exit after the atexit handlers: the filter's rest still arrives
)


def _rank(verbose: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != VERBOSE_VAR}
    if verbose:
        env[VERBOSE_VAR] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", RANK], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_gloo_connection_lines_are_dropped_unless_verbose() -> None:
    assert _rank(verbose=False) == (
        "step 1 | loss 3.0\na native line\nstep 2 | loss 2.5\nno newline at the end"
    )
    assert _rank(verbose=True).count("[Gloo] Rank") == 3


def test_library_warnings_are_hidden_unless_verbose(monkeypatch) -> None:
    messages = [
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        "Apex is not installed. Falling back to Torch Norm",
        "something else",
    ]
    for verbose, shown in ((False, ["something else"]), (True, messages)):
        if verbose:
            monkeypatch.setenv(VERBOSE_VAR, "1")
        monkeypatch.setattr(verbosity, "_QUIETED", False)  # as in a fresh process
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()  # without what main() installed earlier in this process
            warnings.simplefilter("always")
            quiet_libraries()
            for message in messages:
                warnings.warn(message, UserWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == shown
