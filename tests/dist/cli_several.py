"""Several ``megatron-ext`` command lines in one process (one torch import for all of them):
each argument group, separated by ``--``, is one command line, run by the CLI's own ``main``
(what ``megatron-ext ARGS`` runs: its exit code, its one-line errors). Prints one JSON line per
command: ``{"argv", "code", "stdout", "stderr"}`` (an uncaught exception is exit code 1 with
its traceback in ``stderr``, as in a process of its own).

A group starting with ``--fail-in MODULE:NAME`` runs with ``MODULE.NAME`` replaced, for that
command only, by a function that raises ``RuntimeError("injected failure")``: an interruption
at that point.

Usage (under torchrun, one rank): cli_several.py ARGS... [-- ARGS...]...
"""

import contextlib
import importlib
import io
import json
import sys
import traceback
from unittest import mock

from megatron_ext.launch.cli import main


def injected_failure(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected failure")


def run(argv: list[str]) -> dict:
    patch: contextlib.AbstractContextManager = contextlib.nullcontext()
    if argv[:1] == ["--fail-in"]:
        module, name = argv[1].split(":")
        patch = mock.patch.object(importlib.import_module(module), name, injected_failure)
        argv = argv[2:]
    out, err = io.StringIO(), io.StringIO()
    with patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception:
            traceback.print_exc()
            code = 1
    return {"argv": argv, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


# Guarded: dist_checkpointing's writer starts helper processes that re-import __main__.
if __name__ == "__main__":
    groups, current = [], []
    for arg in sys.argv[1:]:
        if arg == "--":
            groups.append(current)
            current = []
        else:
            current.append(arg)
    groups.append(current)
    for argv in groups:
        print(json.dumps(run(argv)), flush=True)
